"""Local block throughput of the CPU backend, one rank, against torch SDPA.

    python -m ringmpi.bench.kernel [--seq 4096] [--dims 64 128] [--repeat 3]

Runs ``ring_attention`` / ``ring_attention_backward`` on a single rank (the
ring degenerates to the local block) with one BLAS thread, and, when torch is
installed, ``torch.nn.functional.scaled_dot_product_attention`` on the same
shapes with one thread.  FLOPs as FlashAttention counts them: forward
``4 B H S^2 D`` (halved for causal), backward 2.5x forward.  Prints GFLOP/s
and the ratio ours/torch measured in this run, and the bound of a GEMM + exp
design on this machine (``bound``): per visible score the forward does
``4 D`` GEMM FLOPs and one ``exp``, the backward ``10 D`` and one ``exp``, so
it cannot beat ``4 D / (4 D / G + 1 / E)`` (``10 D`` for the backward) with
``G`` the float32 GEMM rate on a tile's shapes and ``E`` the float32 rate of
the backend's ``exp`` pass (the compiled tile pass where it is built, else
NumPy's ``exp``), both measured here.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from ..flops import attention_flops
from .sdpa import measure_sdpa


def _best(fn, repeat):
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def machine_rates(dim, tile=512, repeat=5):
    """(GEMM FLOP/s on a (tile, D) x (D, tile) and a (tile, tile) x (tile, D) product,
    float32 exp elements/s of the backend's exp pass on a (tile, tile) tile, copy included),
    one thread, best of ``repeat``."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((tile, dim), dtype=np.float32)
    b = rng.standard_normal((tile, dim), dtype=np.float32)
    s = np.empty((tile, tile), np.float32)
    pv = np.empty((tile, dim), np.float32)
    gemm = _best(lambda: (np.matmul(a, b.T, out=s), np.matmul(s, b, out=pv)), repeat)
    s[...] = rng.standard_normal((tile, tile), dtype=np.float32)
    np.minimum(s, 0, out=s)
    x = s.copy()
    from ..backends.tile_pass import exp_pass

    exp = _best(lambda: (np.copyto(s, x), exp_pass(s, np.float32(1))), repeat)
    return 4 * tile * tile * dim / gemm, tile * tile / exp


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


def gemm_exp_bound(dim, gemm_rate, exp_rate, backward=False):
    """FLOP/s bound of a GEMM + exp design (see the module docstring)."""
    flops = (10 if backward else 4) * dim
    return flops / (flops / gemm_rate + 1 / exp_rate)


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
    import sys

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
    args = parser.parse_args(argv)
    head = (f"{'D':>4} {'causal':>6} | {'fwd GF/s':>9} {'torch':>9} {'ratio':>6} {'bound':>7} {'of bnd':>6} "
            f"| {'bwd GF/s':>9} {'torch':>9} {'ratio':>6} {'bound':>7} {'of bnd':>6}")
    print(f"S={args.seq} B={args.batch} H={args.heads} float32, 1 thread; bound = GEMM + exp design "
          f"at this machine's rates (GEMM G, exp E, measured now)")
    from ..backends.tile_pass import implementation, vector_path

    path = vector_path()
    print(f"CPU {cpu_model()}; BLAS {blas_name()} (NumPy's); float32 tile pass: {implementation()}"
          + (f" ({path})" if path else ""))
    print(head)
    print("-" * len(head))
    if measure_torch(64, 8, 1, 1, False, 1) is None:
        print("(torch not installed: no ratio; pip install 'ringmpi[bench]')")
    for dim in args.dims:
        gemm_rate, exp_rate = machine_rates(dim)
        bounds = [gemm_exp_bound(dim, gemm_rate, exp_rate, backward) for backward in (False, True)]
        print(f"D={dim}: G = {gemm_rate / 1e9:.1f} GF/s, E = {exp_rate / 1e9:.2f} G exp/s; bound forward "
              f"{bounds[0] / 1e9:.1f} GF/s, backward {bounds[1] / 1e9:.1f} GF/s", flush=True)
        for causal in (False, True):
            shape = (args.seq, dim, args.heads, args.batch, causal, args.repeat)
            ours, theirs = measure_ours(*shape), measure_torch(*shape)
            cells = []
            for i in range(2):
                cells.append(f"{ours[i] / 1e9:9.2f} " + (
                    f"{theirs[i] / 1e9:9.2f} {ours[i] / theirs[i]:6.2f}x" if theirs
                    else f"{'-':>9} {'-':>6}") + f" {bounds[i] / 1e9:7.1f} {ours[i] / bounds[i]:6.2f}")
            print(f"{dim:>4} {str(causal):>6} | {cells[0]} | {cells[1]}", flush=True)


if __name__ == "__main__":
    main()
