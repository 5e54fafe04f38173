#!/usr/bin/env bash
# Set up, then run the main job on the embedded default: calibrate SmolLM2-135M on Wikipedia text,
# show its spectra, export a checkpoint that keeps 99% of its next-token accuracy, and verify it
# (integrity, held-out accuracy against the original on Wikipedia and on Python's docs, KV bytes of the
# live cache, generations), then
# serve it with vLLM's OpenAI-compatible server (127.0.0.1, a free port) and print one completion.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
OUT=${KVFOLD_DEMO_DIR:-${KVFOLD_CACHE:-$HOME/.cache/kvfold}/demo}
mkdir -p "$OUT"
.venv/bin/kvfold calibrate smollm2 --source text --text wiki:calib --tokens 16384 -o "$OUT/calib" --force
.venv/bin/kvfold inspect "$OUT/calib"
.venv/bin/kvfold export smollm2 --calib "$OUT/calib" --accuracy 0.99 -o "$OUT/SmolLM2-135M-kvfold" --force
# verify exits 1 when a check fails (2 on bad input). On pydoc:eval (Python topics that neither calibration
# nor the search read) the 0.99 perplexity bound does not hold yet (README, "Accuracy out of domain"): the
# demo shows that table and goes on to serving.
.venv/bin/kvfold verify "$OUT/SmolLM2-135M-kvfold" || [ $? -eq 1 ]
.venv/bin/kvfold-bench openai --export "$OUT/SmolLM2-135M-kvfold"
