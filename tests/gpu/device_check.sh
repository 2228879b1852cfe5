#!/usr/bin/env bash
# GPU check, for a machine with a CUDA GPU and no network (< 10 minutes):
# GPU backend tests, ringmpi.torch on CUDA tensors, then the kernel benchmark;
# prints a short table last.
#
#   tests/gpu/device_check.sh [WHEEL_DIR]
#
# WHEEL_DIR (optional): wheels to install offline first (cupy-cuda12x,
# nvidia-cuda-nvrtc-cu12, pytest, ... ; torch for the comparison column).
# PYTHON picks the interpreter (default: .venv/bin/python, else python3).
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$here"
py=${PYTHON:-}
[ -z "$py" ] && { [ -x .venv/bin/python ] && py=.venv/bin/python || py=python3; }
wheels=${1:-}
log=$(mktemp -d)

if [ -n "$wheels" ]; then
    echo "[check] installing from $wheels (offline)"
    "$py" -m pip install -q --no-index --find-links "$wheels" \
        $(ls "$wheels" | sed -n 's/^\([A-Za-z0-9_.]*\)-[0-9].*\.whl$/\1/p' | sort -u) \
        || echo "[check] WARNING: offline install failed; using what is installed"
fi
export PYTHONPATH="$here/src${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi -L 2>/dev/null || echo "[check] nvidia-smi not available"
"$py" -c 'import cupy; print("[check] cupy", cupy.__version__, "devices:", cupy.cuda.runtime.getDeviceCount())' \
    || { echo "[check] CuPy cannot see a GPU"; exit 1; }

echo "[check] GPU tests"
timeout 300 "$py" -m pytest tests/gpu -q -rfEs -p no:cacheprovider 2>&1 | tee "$log/tests.txt"
test_rc=${PIPESTATUS[0]}

echo "[check] ringmpi.torch on CUDA tensors (mpirun, P = 2)"
timeout 120 "$py" -m pytest tests/test_torch.py -k cuda -q -rfEs -p no:cacheprovider 2>&1 | tee "$log/torch.txt"
torch_rc=${PIPESTATUS[0]}

echo "[check] benchmark"
timeout 170 "$py" -m ringmpi.bench.gpu --repeats 3 2>&1 | tee "$log/bench.txt"
bench_rc=${PIPESTATUS[0]}

echo
echo "================ device check summary ================"
echo "tests  (rc=$test_rc): $(tail -n 1 "$log/tests.txt")"
grep -E '^(FAILED|ERROR)' "$log/tests.txt" | head -n 20
echo "torch  (rc=$torch_rc): $(tail -n 1 "$log/torch.txt")"
grep -E '^(FAILED|ERROR|SKIPPED)' "$log/torch.txt" | head -n 10
echo "bench  (rc=$bench_rc):"
sed -n '/^bf16, B=/,$p' "$log/bench.txt"
[ "$test_rc" = 0 ] && [ "$torch_rc" = 0 ] && [ "$bench_rc" = 0 ]
