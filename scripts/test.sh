#!/usr/bin/env bash
# Set up, then run the whole test suite: fast unit tests, the real-model tests (slow) and the vLLM-engine tests.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
.venv/bin/ruff check kvfold runtime tests
exec .venv/bin/python -m pytest -m "" "$@"
