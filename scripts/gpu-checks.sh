#!/usr/bin/env bash
# The checks a CUDA machine runs for kvfold's GPU path, in one go and within a time budget: the kernel timings
# (kvfold-bench kernels: JSON, PNG), the Triton kernels' tests on CUDA (newest code paths first), then the decode
# steps' timings replayed from CUDA graphs (kernels-graphs.json). ~11 minutes on a cold H100.
#
#   scripts/gpu-checks.sh OUT [EXPORT]
#
# OUT: a folder for kernels.json, kernels.png and the logs. EXPORT: an export's folder whose median layer is also
# timed (its config.json and kvfold.json suffice). Runs from the repository root with the machine's own torch and
# Triton; a machine without a package registry takes missing wheels from .whl/ (pydantic and its needs: see
# /work/.library/device/README.md for how to download them). A cold machine spends ~2–3 minutes compiling the
# kernels before the first timing (H100, Triton 3.6).
set -uo pipefail
out=${1:?usage: scripts/gpu-checks.sh OUT [EXPORT]}
export_dir=${2:-}
mkdir -p "$out"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "error: the wheels in .whl/ did not install" >&2; exit 1; }
fi
export PYTHONPATH="/tmp/site:$PWD/runtime:$PWD:$PWD/bench${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

timeout "${KERNELS_TIMEOUT:-420}" python3 -m kvfold_bench kernels ${export_dir:+--export "$export_dir"} --reps 10 \
  --json "$out/kernels.json" --png "$out/kernels.png" > "$out/kernels.log" 2>&1
echo "kernels: exit $?"
tail -3 "$out/kernels.log"

timeout "${TESTS_TIMEOUT:-240}" python3 -m pytest -q -m "" -k "not test_in_the_interpreter" -p no:cacheprovider \
  tests/runtime/test_cuda_graphs.py tests/runtime/test_triton_pages_window.py tests/runtime/test_triton_pages.py \
  tests/runtime/test_triton_encode.py \
  tests/runtime/test_triton_bits.py tests/runtime/test_triton.py tests/test_devices.py > "$out/tests.log" 2>&1
echo "tests: exit $?"
tail -5 "$out/tests.log"

# last, the same decode steps replayed from CUDA graphs (what the backend would gain by declaring CUDA-graph support);
# a separate run, so that a step that cannot be captured costs none of the figures above
timeout "${GRAPHS_TIMEOUT:-240}" python3 -m kvfold_bench kernels ${export_dir:+--export "$export_dir"} --reps 10 \
  --graphs --json "$out/kernels-graphs.json" > "$out/kernels-graphs.log" 2>&1
echo "kernels --graphs: exit $?"
tail -3 "$out/kernels-graphs.log"
