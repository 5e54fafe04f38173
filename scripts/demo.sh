#!/usr/bin/env bash
# Set up, then run the main job on the embedded default, SmolLM2-135M:
# 1. calibrate on Wikipedia text and show the spectra;
# 2. export in the bits format (each kept dim stored at 2–16 bits) at 99% of the original's next-token
#    accuracy at 4K context, each layer's first 16 and last 64 tokens kept whole: about 0.29 of fp16's KV bytes;
# 3. verify it: integrity, held-out accuracy against the original on Wikipedia and on Python's docs, pass keys,
#    the live cache's bytes, generations (exit 1 when a check fails, which stops the demo);
# 4. serve it in vLLM beside the original and vLLM's own fp8 cache, each given the same KV budget: the table
#    shows each one's KV token capacity and its ratio to the original's (serve.json holds the figures);
# 5. serve it with vLLM's OpenAI-compatible server (127.0.0.1, a free port) and print its answers.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
OUT=${KVFOLD_DEMO_DIR:-${KVFOLD_CACHE:-$HOME/.cache/kvfold}/demo}
EXPORT="$OUT/SmolLM2-135M-kvfold"  # the export the kvfold-bench commands read by default
mkdir -p "$OUT"
.venv/bin/kvfold calibrate smollm2 --source text --text wiki:calib --tokens 16384 -o "$OUT/calib" --force
.venv/bin/kvfold inspect "$OUT/calib"
.venv/bin/kvfold export smollm2 --calib "$OUT/calib" --format bits --accuracy 0.99 -o "$EXPORT" --force
.venv/bin/kvfold verify "$EXPORT"
.venv/bin/kvfold-bench serve --export "$EXPORT" --kv-cache-dtype fp8 --workload none --eager \
  --json "$OUT/serve.json" > /dev/null
.venv/bin/kvfold-bench openai --export "$EXPORT"
