"""Local block throughput of the CPU backend, one rank, against torch SDPA and the core's peak.

    python -m ringmpi.bench.kernel [--seq 4096] [--dims 64 128] [--repeat 3] [--rounds 2] [--paths] [--no-torch]

Runs ``ring_attention`` / ``ring_attention_backward`` on a single rank (the
ring degenerates to the local block) with one BLAS thread, and, when torch is
installed, ``torch.nn.functional.scaled_dot_product_attention`` on the same
shapes with one thread.  FLOPs as FlashAttention counts them: forward
``4 B H S^2 D`` (halved for causal), backward 2.5x forward.

Each vector path (the one in use, or with ``--paths`` every path of the compiled tile pass
this CPU runs: ``avx512``, ``avx2``, ``plain``) is measured in a process of its own with
every library pinned to the path's instructions (:data:`PINS`): our tile pass
(``RINGMPI_CPU_VECTOR``), NumPy's OpenBLAS (``OPENBLAS_CORETYPE``) and NumPy's loops
(``NPY_DISABLE_CPU_FEATURES``), torch's kernels (``ATEN_CPU_CAPABILITY``) and its MKL
(``MKL_ENABLE_INSTRUCTIONS``), so every comparison is like with like.  That process first
measures the core's **FMA peak** at the path's vector width (a compiled loop of 12
independent FMA chains, :func:`fma_peak`) and prints every FLOP rate as a share of it
(``%peak``), then the exp rates (the compiled pass, ``np.exp``, ``torch.exp`` on one block-op tile,
``cost_model.TILE_ROWS`` a side), then the shapes.  ``/bnd`` is the share of the bound of a GEMM +
exp design on this machine: per visible score the forward does ``4 D`` GEMM FLOPs and one ``exp``,
the backward ``10 D`` and one ``exp``, so it cannot beat ``4 D / (4 D / G + 1 / E)`` (``10 D`` for
the backward) with ``G`` the float32 GEMM rate on a tile's shapes and ``E`` the better of the
compiled pass's and ``np.exp``'s exp rates, measured in the same process.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import numpy as np

from ..core.cost_model import TILE_ROWS
from ..core.flops import attention_flops
from .sdpa import measure_sdpa


def _best(fn, repeat):
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def gemm_rate(dim, tile=TILE_ROWS, repeat=5):
    """FLOP/s of a tile's two float32 GEMMs, a (tile, D) x (D, tile) and a (tile, tile) x (tile, D)
    product, one thread, best of ``repeat``."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((tile, dim), dtype=np.float32)
    b = rng.standard_normal((tile, dim), dtype=np.float32)
    s = np.empty((tile, tile), np.float32)
    pv = np.empty((tile, dim), np.float32)
    seconds = _best(lambda: (np.matmul(a, b.T, out=s), np.matmul(s, b, out=pv)), repeat)
    return 4 * tile * tile * dim / seconds


def _exp_args(tile):
    """A (tile, tile) float32 tile of exp arguments in [-1, 0): scores less their maximum, in the
    range where most of a softmax's weight lies."""
    return -np.random.default_rng(0).random((tile, tile), dtype=np.float32)


def exp_rates(tile=TILE_ROWS, repeat=20, paths=None):
    """float32 exp elements/s on a (tile, tile) tile, one thread, best of ``repeat`` rounds of 10
    calls, no copies: ``np.exp(a, out=b)``, and the compiled pass in place on ``-a``'s exps with
    the scale -1 (its arguments stay in [-1, -1/e]: the same range), with the row sums it makes in
    the forward.  ``{"np.exp": ..., "<path>": ...}``, one entry per vector path of the compiled tile
    pass this CPU runs (none where it is not built), or of ``paths`` when given."""
    from ..backends import tile_pass

    args = _exp_args(tile)
    out = np.empty_like(args)
    rates = {"np.exp": 10 * args.size / _best(lambda: [np.exp(args, out=out) for _ in range(10)], repeat)}
    chosen = tile_pass.vector_path()
    sums = np.empty(tile, np.float32)
    try:
        for path in (tile_pass.vector_paths() if paths is None else paths):
            tile_pass.use(path)
            s = np.exp(args)
            seconds = _best(lambda: [tile_pass.exp_pass(s, np.float32(-1), None, None, sums) for _ in range(10)],
                            repeat)
            rates[path] = 10 * args.size / seconds
    finally:
        if chosen is not None:
            tile_pass.use(chosen)
    return rates


_TORCH_EXP = r"""
import sys, time, torch
torch.set_num_threads(1)
tile, repeat = int(sys.argv[1]), int(sys.argv[2])
a = -torch.rand(tile, tile, generator=torch.Generator().manual_seed(0))
b = torch.empty_like(a)
def best(fn):
    fn(); out = []
    for _ in range(repeat):
        t = time.perf_counter(); fn(); out.append(time.perf_counter() - t)
    return min(out)
print("TORCH_EXP", 10 * a.numel() / best(lambda: [torch.exp(a, out=b) for _ in range(10)]))
"""


def torch_exp_rate(tile=TILE_ROWS, repeat=20):
    """``torch.exp``'s float32 elements/s on the same kind of tile (``torch.exp(a, out=b)``, no
    copies) with one thread, in a child process (see :mod:`ringmpi.bench.sdpa`), or None without
    torch."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return None
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    try:
        proc = subprocess.run([sys.executable, "-c", _TORCH_EXP, str(tile), str(repeat)], capture_output=True,
                              text=True, timeout=600, env=env)
    except subprocess.TimeoutExpired:
        return None
    for line in proc.stdout.splitlines():
        if line.startswith("TORCH_EXP "):
            return float(line.split()[1])
    return None


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else the platform's processor string."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith(("model name", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def blas_name() -> str:
    """NumPy's BLAS as its build reports it (name and version), with the kernels' core where
    threadpoolctl can tell it (OpenBLAS picks them per CPU: SkylakeX, Haswell, ...)."""
    try:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        name = f"{blas.get('name', '?')} {blas.get('version', '')}".strip()
    except Exception:  # noqa: BLE001 - older NumPy: no dict mode
        name = "unknown"
    try:
        import threadpoolctl
    except ImportError:
        return name
    cores = {i.get("architecture") for i in threadpoolctl.threadpool_info() if i.get("user_api") == "blas"}
    cores.discard(None)
    return f"{name} ({', '.join(sorted(cores))} kernels)" if cores else name


def gemm_exp_bound(dim, gemm, exp, backward=False):
    """FLOP/s bound of a GEMM + exp design (see the module docstring): GEMM FLOP/s ``gemm``,
    exp elements/s ``exp``."""
    flops = (10 if backward else 4) * dim
    return flops / (flops / gemm + 1 / exp)


def measure_ours(seq, dim, heads, batch, causal, repeat):
    """(forward, backward) FLOP/s of ringmpi's numpy backend on one rank."""
    import ringmpi

    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((batch, seq, heads, dim), dtype=np.float32) for _ in range(4))
    flops = {phase: attention_flops(batch, heads, seq, seq, dim, causal, phase) for phase in ("forward", "backward")}
    ctx = ringmpi.RingContext(backend="numpy")
    out = ringmpi.ring_attention(q, k, v, causal=causal, context=ctx)
    fwd = flops["forward"] / _best(lambda: ringmpi.ring_attention(q, k, v, causal=causal, context=ctx), repeat)
    bwd = flops["backward"] / _best(lambda: ringmpi.ring_attention_backward(
        do, q, k, v, out, causal=causal, context=ctx), repeat)
    return fwd, bwd


def measure_torch(seq, dim, heads, batch, causal, repeat):
    """(forward, backward) FLOP/s of torch SDPA with one thread, or None without torch."""
    res = measure_sdpa(batch, heads, heads, seq, dim, "float32", causal, True, warmup=1, repeat=repeat,
                       threads=1, statistic="min")
    if not res["available"]:
        if "not importable" in res["reason"]:
            return None
        raise RuntimeError(f"torch measurement failed:\n{res['reason']}")
    flops = {phase: attention_flops(batch, heads, seq, seq, dim, causal, phase) for phase in ("forward", "backward")}
    return flops["forward"] / res["forward_seconds"], flops["backward"] / res["backward_seconds"]


# what each vector path pins, so that every library runs the same instructions: our tile pass
# (RINGMPI_CPU_VECTOR), NumPy's OpenBLAS (OPENBLAS_CORETYPE, where the CPU has the core's flags),
# torch's own kernels (ATEN_CPU_CAPABILITY) and its MKL (MKL_ENABLE_INSTRUCTIONS: otherwise AVX-512)
PINS = {
    "avx512": dict(ATEN_CPU_CAPABILITY="avx512", MKL_ENABLE_INSTRUCTIONS="AVX512", OPENBLAS_CORETYPE="SkylakeX"),
    "avx2": dict(ATEN_CPU_CAPABILITY="avx2", MKL_ENABLE_INSTRUCTIONS="AVX2", OPENBLAS_CORETYPE="Haswell"),
    "plain": dict(ATEN_CPU_CAPABILITY="default", MKL_ENABLE_INSTRUCTIONS="SSE4_2", OPENBLAS_CORETYPE="Nehalem"),
}
# the CPU flags each OpenBLAS core needs (a core the CPU lacks is not pinned: OpenBLAS would refuse it)
CORE_FLAGS = {"SkylakeX": {"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"}, "Haswell": {"avx2", "fma"},
              "Nehalem": {"sse4_2", "popcnt"}}


def cpu_flags() -> set:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _numpy_targets_above(path) -> list:
    """NumPy's dispatch targets that use more than ``path``'s instructions (NPY_DISABLE_CPU_FEATURES)."""
    try:
        from numpy._core import _multiarray_umath as umath
    except ImportError:  # NumPy 1.x
        from numpy.core import _multiarray_umath as umath
    targets = list(getattr(umath, "__cpu_dispatch__", []))
    if path == "avx512":
        return []
    if path == "avx2":
        return [t for t in targets if "AVX512" in t or t == "X86_V4"]
    return targets


def pinned_env(path) -> dict:
    """The environment that pins every library of this benchmark to ``path``'s instructions."""
    env = dict(os.environ, RINGMPI_CPU_VECTOR=path, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1",
               MKL_NUM_THREADS="1")
    pins = dict(PINS.get(path, {}))
    core = pins.pop("OPENBLAS_CORETYPE", None)
    env.update(pins)
    env.pop("OPENBLAS_CORETYPE", None)
    if core is not None and CORE_FLAGS[core] <= cpu_flags() and "openblas" in blas_name().lower():
        env["OPENBLAS_CORETYPE"] = core
    above = _numpy_targets_above(path)
    if above:
        env["NPY_DISABLE_CPU_FEATURES"] = " ".join(above)
    else:
        env.pop("NPY_DISABLE_CPU_FEATURES", None)
    return env


def fma_peak(path, repeat=40, rounds=200_000):
    """float32 FLOP/s of a compiled loop of independent FMAs at ``path``'s vector width (512-bit
    for avx512, 256-bit for avx2, 128-bit multiply + add for plain), best of ``repeat`` short runs
    (about a millisecond each: on a shared machine some run whole between other processes' turns);
    None where the compiled tile pass is not built."""
    from ..backends import tile_pass

    if tile_pass.compiled is None or not hasattr(tile_pass.compiled, "fma_peak"):
        return None
    tile_pass.compiled.fma_peak(path, rounds // 10)  # warm-up: the core's clock settles
    best = min(tile_pass.compiled.fma_peak(path, rounds)[0] for _ in range(repeat))
    return tile_pass.compiled.fma_peak(path, 1)[1] * rounds / best


def _pct(rate, peak):
    return f"{100 * rate / peak:5.1f}%" if peak else f"{'-':>6}"


def measure_path(path, args, torch_ok):
    """One path's block, in a process pinned to it (see :func:`pinned_env`): its FMA peak, the exp
    rates, then a row per shape with ours and torch's FLOP/s as shares of that peak."""
    from ..backends import tile_pass

    name = path or "numpy"
    peak = fma_peak(path) if path else None
    pins = " ".join(f"{k}={os.environ[k]}" for k in ("RINGMPI_CPU_VECTOR", "ATEN_CPU_CAPABILITY",
                                                      "MKL_ENABLE_INSTRUCTIONS", "OPENBLAS_CORETYPE")
                    if os.environ.get(k))
    print(f"path {name}: {pins or 'nothing pinned'}; BLAS {blas_name()}; FMA peak "
          + (f"{peak / 1e9:.1f} GF/s (compiled loop, {dict(avx512=512, avx2=256).get(path, 128)}-bit)"
             if peak else "-"), flush=True)
    # ours and torch.exp's in turn, best of three rounds each: a burst of load elsewhere hits both
    rates, torch_rate = {}, None
    for _ in range(3):
        for name, rate in exp_rates(paths=[path] if path else []).items():
            rates[name] = max(rates.get(name, 0), rate)
        theirs = torch_exp_rate() if torch_ok else None
        torch_rate = max(torch_rate or 0, theirs or 0) or None
    if path:
        print(f"  exp, float32 {TILE_ROWS} x {TILE_ROWS} tile of arguments in [-1, 0), one thread (G elements/s): "
              f"np.exp {rates['np.exp'] / 1e9:.2f}, torch.exp " + (f"{torch_rate / 1e9:.2f}" if torch_rate else "-"))
        print(f"  compiled pass, {path:>6}: {rates[path] / 1e9:.2f} = {rates[path] / rates['np.exp']:.2f}x np.exp"
              + (f", {rates[path] / torch_rate:.2f}x torch.exp" if torch_rate else ""), flush=True)
    rows = []
    for dim in args.dims:
        gemm = gemm_rate(dim)
        exp = max(rates["np.exp"], rates.get(path, 0))
        bounds = [gemm_exp_bound(dim, gemm, exp, backward) for backward in (False, True)]
        print(f"  D={dim}: GEMM G = {gemm / 1e9:.1f} GF/s ({_pct(gemm, peak).strip()} of peak), E = {exp / 1e9:.2f} "
              f"G exp/s; bound forward {bounds[0] / 1e9:.1f} GF/s, backward {bounds[1] / 1e9:.1f} GF/s", flush=True)
        for causal in (False, True):
            shape = (args.seq, dim, args.heads, args.batch, causal, args.repeat)
            # torch's and ours in turn, best of `rounds` each: a burst of load elsewhere hits both
            theirs = ours = None
            for _ in range(args.rounds):
                t = measure_torch(*shape) if torch_ok else None
                theirs = t if theirs is None else tuple(map(max, theirs, t))
                u = measure_ours(*shape)
                ours = u if ours is None else tuple(map(max, ours, u))
            cells = []
            for i in range(2):
                cells.append(f"{ours[i] / 1e9:8.2f} {_pct(ours[i], peak)} " + (
                    f"{theirs[i] / 1e9:8.2f} {_pct(theirs[i], peak)} {ours[i] / theirs[i]:5.2f}x" if theirs
                    else f"{'-':>8} {'-':>6} {'-':>6}") + f" {ours[i] / bounds[i]:5.2f}")
            rows.append(f"{name:>6} {dim:>4} {str(causal):>6} | {cells[0]} | {cells[1]}")
    return rows


HEAD = (f"{'path':>6} {'D':>4} {'causal':>6} | {'fwd GF/s':>8} {'%peak':>6} {'torch':>8} {'%peak':>6} {'ratio':>6} "
        f"{'/bnd':>5} | {'bwd GF/s':>8} {'%peak':>6} {'torch':>8} {'%peak':>6} {'ratio':>6} {'/bnd':>5}")


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if os.environ.get("OPENBLAS_NUM_THREADS") != "1" or os.environ.get("OMP_NUM_THREADS") != "1":
        # NumPy's BLAS reads its thread count at import: start again with one thread
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        os.execve(sys.executable, [sys.executable, "-m", "ringmpi.bench.kernel"] + argv, env)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--heads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--paths", action="store_true",
                        help="every vector path of the compiled tile pass this CPU runs, with the exp rates")
    parser.add_argument("--no-torch", action="store_true", help="leave torch out (no comparison columns)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="torch and ours measured in turn this many times per shape (best of each)")
    parser.add_argument("--one-path", help=argparse.SUPPRESS)  # a child: measure this path, pinned already
    args = parser.parse_args(argv)
    import importlib.util

    torch_ok = not args.no_torch and importlib.util.find_spec("torch") is not None
    if args.one_path is not None:
        rows = measure_path(args.one_path or None, args, torch_ok)
        print("ROWS " + "\x1f".join(rows), flush=True)
        return
    from ..backends import tile_pass

    chosen = tile_pass.vector_path()
    paths = list(tile_pass.vector_paths()) if args.paths else [chosen]
    print(f"S={args.seq} B={args.batch} H={args.heads} float32, 1 thread; each path in a process of its own with "
          f"torch, its MKL, NumPy and OpenBLAS pinned to the path's instructions; %peak = share of the path's "
          f"FMA peak; /bnd = share of the GEMM + exp bound (GEMM G, exp E = the better of the compiled pass "
          f"and np.exp, measured in that process)")
    calibrated = tile_pass.calibration()
    how = "pinned by RINGMPI_CPU_VECTOR" if os.environ.get("RINGMPI_CPU_VECTOR") else (
        "the fastest in the import's calibration" if calibrated else "the only one")
    print(f"CPU {cpu_model()}; BLAS {blas_name()} (NumPy's); float32 tile pass: {tile_pass.implementation()}"
          + (f" ({chosen}: {how})" if chosen else ""))
    if not torch_ok:
        print("(torch left out or not installed: no ratio; pip install 'ringmpi[bench]')")
    child_args = [a for a in argv if a != "--paths"] + (["--no-torch"] if not torch_ok else [])
    table = []
    for path in paths:
        env = pinned_env(path) if path else dict(os.environ)
        proc = subprocess.Popen([sys.executable, "-m", "ringmpi.bench.kernel", "--one-path", path or ""]
                                + child_args, env=env, stdout=subprocess.PIPE, text=True)
        for line in proc.stdout:
            if line.startswith("ROWS "):
                table += [row for row in line[5:].rstrip("\n").split("\x1f") if row]
            else:
                print(line, end="", flush=True)
        if proc.wait() != 0:
            raise SystemExit(f"the {path} path's measurement failed (exit {proc.returncode})")
    print(HEAD)
    print("-" * len(HEAD))
    for row in table:
        print(row)


if __name__ == "__main__":
    main()
