"""Local block throughput of the CPU backend, one rank, against torch SDPA.

    python -m ringmpi.bench.kernel [--seq 4096] [--dims 64 128] [--repeat 3] [--paths]

Runs ``ring_attention`` / ``ring_attention_backward`` on a single rank (the
ring degenerates to the local block) with one BLAS thread, and, when torch is
installed, ``torch.nn.functional.scaled_dot_product_attention`` on the same
shapes with one thread.  FLOPs as FlashAttention counts them: forward
``4 B H S^2 D`` (halved for causal), backward 2.5x forward.  Prints GFLOP/s
and the ratio ours/torch measured in this run, and the bound of a GEMM + exp
design on this machine (``bound``): per visible score the forward does
``4 D`` GEMM FLOPs and one ``exp``, the backward ``10 D`` and one ``exp``, so
it cannot beat ``4 D / (4 D / G + 1 / E)`` (``10 D`` for the backward) with
``G`` the float32 GEMM rate on a tile's shapes and ``E`` the better of two float32
``exp`` rates on a tile, the compiled tile pass's (where it is built) and NumPy's
``np.exp``, all measured here: a slow pass cannot raise the bound it is judged by.

``--paths`` runs the table once per vector path of the compiled tile pass this CPU
runs (``avx512``, ``avx2``, ``plain``), torch once per shape, and first prints every
path's exp rate beside ``np.exp``'s and ``torch.exp``'s on the same tile.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import numpy as np

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


def gemm_rate(dim, tile=512, repeat=5):
    """FLOP/s of a tile's two float32 GEMMs, a (tile, D) x (D, tile) and a (tile, tile) x (tile, D)
    product, one thread, best of ``repeat``."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((tile, dim), dtype=np.float32)
    b = rng.standard_normal((tile, dim), dtype=np.float32)
    s = np.empty((tile, tile), np.float32)
    pv = np.empty((tile, dim), np.float32)
    seconds = _best(lambda: (np.matmul(a, b.T, out=s), np.matmul(s, b, out=pv)), repeat)
    return 4 * tile * tile * dim / seconds


def _exp_tile(tile):
    """A (tile, tile) float32 tile of the values a forward pass exponentiates (scores minus
    their maximum), and one to restore it from."""
    x = np.random.default_rng(0).standard_normal((tile, tile), dtype=np.float32) * np.float32(3)
    np.minimum(x, 0, out=x)
    return x, x.copy()


def exp_rates(tile=512, repeat=20):
    """float32 exp elements/s on a (tile, tile) tile, one thread, best of ``repeat``, the copy that
    restores the tile between calls subtracted: ``{"np.exp": ..., "<path>": ...}`` with one entry
    per vector path of the compiled tile pass this CPU runs (none where it is not built)."""
    from ..backends import tile_pass

    s, x = _exp_tile(tile)
    copy = _best(lambda: np.copyto(s, x), repeat)
    rates = {"np.exp": s.size / max(_best(lambda: (np.copyto(s, x), np.exp(s, out=s)), repeat) - copy, 1e-9)}
    chosen = tile_pass.vector_path()
    try:
        for path in tile_pass.vector_paths():
            tile_pass.use(path)
            seconds = _best(lambda: (np.copyto(s, x), tile_pass.exp_pass(s, np.float32(1))), repeat)
            rates[path] = s.size / max(seconds - copy, 1e-9)
    finally:
        if chosen is not None:
            tile_pass.use(chosen)
    return rates


_TORCH_EXP = r"""
import sys, time, torch
torch.set_num_threads(1)
tile, repeat = int(sys.argv[1]), int(sys.argv[2])
g = torch.Generator().manual_seed(0)
x = (torch.randn(tile, tile, generator=g) * 3).clamp(max=0)
s = x.clone()
def best(fn):
    fn(); out = []
    for _ in range(repeat):
        t = time.perf_counter(); fn(); out.append(time.perf_counter() - t)
    return min(out)
copy = best(lambda: s.copy_(x))
print("TORCH_EXP", s.numel() / max(best(lambda: torch.exp(s.copy_(x), out=s)) - copy, 1e-9))
"""


def torch_exp_rate(tile=512, repeat=20):
    """``torch.exp``'s float32 elements/s on the same tile with one thread, in a child process
    (see :mod:`ringmpi.bench.sdpa`), or None without torch."""
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
    o, lse = ringmpi.ring_attention(q, k, v, causal=causal, backend="numpy")
    fwd = flops["forward"] / _best(lambda: ringmpi.ring_attention(q, k, v, causal=causal, backend="numpy"), repeat)
    bwd = flops["backward"] / _best(lambda: ringmpi.ring_attention_backward(
        do, q, k, v, o, lse, causal=causal, backend="numpy"), repeat)
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


def main(argv=None):
    if os.environ.get("OPENBLAS_NUM_THREADS") != "1" or os.environ.get("OMP_NUM_THREADS") != "1":
        # NumPy's BLAS reads its thread count at import: start again with one thread
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        os.execve(sys.executable, [sys.executable, "-m", "ringmpi.bench.kernel"] + list(
            sys.argv[1:] if argv is None else argv), env)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--heads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--paths", action="store_true",
                        help="every vector path of the compiled tile pass this CPU runs, with the exp rates")
    args = parser.parse_args(argv)
    from ..backends import tile_pass

    chosen = tile_pass.vector_path()
    paths = list(tile_pass.vector_paths()) if args.paths else [chosen]
    print(f"S={args.seq} B={args.batch} H={args.heads} float32, 1 thread; bound = GEMM + exp design "
          f"at this machine's rates (GEMM G, exp E = the better of the compiled pass and np.exp, measured now)")
    calibrated = tile_pass.calibration()
    how = "pinned by RINGMPI_CPU_VECTOR" if os.environ.get("RINGMPI_CPU_VECTOR") else (
        "the fastest in the import's calibration" if calibrated else "the only one")
    print(f"CPU {cpu_model()}; BLAS {blas_name()} (NumPy's); float32 tile pass: {tile_pass.implementation()}"
          + (f" ({chosen}: {how})" if chosen else ""))
    rates = exp_rates()
    if args.paths:
        torch_rate = torch_exp_rate()
        print("exp, float32 512 x 512 tile, one thread (G elements/s, the restoring copy excluded): np.exp "
              f"{rates['np.exp'] / 1e9:.2f}, torch.exp " + (f"{torch_rate / 1e9:.2f}" if torch_rate else "-"))
        for path in paths:
            print(f"  compiled pass, {path:>6}: {rates[path] / 1e9:.2f} = {rates[path] / rates['np.exp']:.2f}x np.exp"
                  + (f", {rates[path] / torch_rate:.2f}x torch.exp" if torch_rate else ""))
    head = (("  path " if args.paths else "") + f"{'D':>4} {'causal':>6} | {'fwd GF/s':>9} {'torch':>9} {'ratio':>6} "
            f"{'bound':>7} {'of bnd':>6} | {'bwd GF/s':>9} {'torch':>9} {'ratio':>6} {'bound':>7} {'of bnd':>6}")
    print(head)
    print("-" * len(head))
    if measure_torch(64, 8, 1, 1, False, 1) is None:
        print("(torch not installed: no ratio; pip install 'ringmpi[bench]')")
    try:
        for dim in args.dims:
            gemm = gemm_rate(dim)
            for path in paths:
                exp = max(rates["np.exp"], rates.get(path, 0))
                bounds = [gemm_exp_bound(dim, gemm, exp, backward) for backward in (False, True)]
                print(f"D={dim}" + (f", {path}" if args.paths else "") + f": G = {gemm / 1e9:.1f} GF/s, "
                      f"E = {exp / 1e9:.2f} G exp/s; bound forward {bounds[0] / 1e9:.1f} GF/s, "
                      f"backward {bounds[1] / 1e9:.1f} GF/s", flush=True)
            for causal in (False, True):
                shape = (args.seq, dim, args.heads, args.batch, causal, args.repeat)
                theirs = measure_torch(*shape)
                for path in paths:
                    if path is not None:
                        tile_pass.use(path)
                    exp = max(rates["np.exp"], rates.get(path, 0))
                    bounds = [gemm_exp_bound(dim, gemm, exp, backward) for backward in (False, True)]
                    ours = measure_ours(*shape)
                    cells = []
                    for i in range(2):
                        cells.append(f"{ours[i] / 1e9:9.2f} " + (
                            f"{theirs[i] / 1e9:9.2f} {ours[i] / theirs[i]:6.2f}x" if theirs
                            else f"{'-':>9} {'-':>6}") + f" {bounds[i] / 1e9:7.1f} {ours[i] / bounds[i]:6.2f}")
                    name = f"{path or 'numpy':>6} " if args.paths else ""
                    print(f"{name}{dim:>4} {str(causal):>6} | {cells[0]} | {cells[1]}", flush=True)
    finally:
        if chosen is not None:
            tile_pass.use(chosen)


if __name__ == "__main__":
    main()
