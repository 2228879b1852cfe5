#!/usr/bin/env bash
# GPU check, for a machine with a CUDA GPU and no network (< 8 minutes):
# the device's compute capability and the block kernels the planner picks on it
# per dtype, GPU backend tests, ringmpi.torch on CUDA tensors, then the kernel
# benchmark; prints a short table last.
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

# time limits keep the whole check within 8 minutes (480 s)
start=$SECONDS
step() {  # step NAME LIMIT_S COMMAND...: run, log to $log/NAME.txt, record rc and seconds
    local name=$1 limit=$2 t0=$SECONDS
    shift 2
    echo "[check] $name: $*"
    timeout "$limit" "$@" 2>&1 | tee "$log/$name.txt"
    echo "${PIPESTATUS[0]} $((SECONDS - t0))" > "$log/$name.rc"
}
# which path this GPU exercises: compute capability, opt-in shared memory, kernels per dtype and D
plan_kernels='
from ringmpi.backends.cupy_backend import CupyBackend, compute_capability, smem_optin_limit
from ringmpi.runtime.errors import ConfigError
import cupy
cc, name = compute_capability(0), cupy.cuda.runtime.getDeviceProperties(0)["name"]
name = name.decode() if isinstance(name, bytes) else name
print(f"[plan] device 0: {name}, compute capability {cc // 10}.{cc % 10}, "
      f"{smem_optin_limit(0)} B opt-in shared memory per block")
be = CupyBackend(0, cuda_aware=False)  # (no MPI needed to plan)
for dtype in ("float16", "bfloat16", "float32", "float64"):
    for d in (64, 128, 256):
        try:
            chosen = [be.block_kernel(way, dtype, d).expr for way in ("forward", "backward")]
            print(f"[plan] {dtype:8s} D={d:3d}: forward {chosen[0]:36s} backward {chosen[1]}")
        except ConfigError as exc:
            print(f"[plan] {dtype:8s} D={d:3d}: none ({exc})")
'
step plan 60 "$py" -c "$plan_kernels"
# tests/gpu/*.py: block kernels vs float64 dense, launch limits (B*H > 65535, the plans of cc 8.6,
# 7.5 and 7.0), bf16 through the public API (multi-rank on one GPU, CUDA-aware and staged), non-finite
step tests 270 "$py" -m pytest tests/gpu -q -rfEs -p no:cacheprovider
step torch 80 "$py" -m pytest tests/mpi/test_torch.py -k cuda -q -rfEs -p no:cacheprovider
step bench 100 "$py" -m ringmpi.bench.gpu --quick

echo
echo "[check] kernels chosen on this GPU"
grep '^\[plan\]' "$log/plan.txt"
echo
echo "[check] benchmark table"
sed -n '/^bf16, B=/,$p' "$log/bench.txt"
echo
echo "================ device check summary ($((SECONDS - start)) s) ================"
printf '%-6s %4s %5s  %s\n' step rc secs result
ok=0
for name in plan tests torch bench; do
    read -r rc secs < "$log/$name.rc"
    [ "$rc" = 0 ] || ok=1
    printf '%-6s %4s %5s  %s\n' "$name" "$rc" "$secs" "$(grep -v '^\s*$' "$log/$name.txt" | tail -n 1 | cut -c1-90)"
done
grep -hE '^(FAILED|ERROR)' "$log/tests.txt" "$log/torch.txt" | head -n 10
exit $ok
