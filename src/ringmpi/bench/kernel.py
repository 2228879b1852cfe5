"""Local block throughput of the CPU backend, one rank, against torch SDPA.

    python -m ringmpi.bench.kernel [--seq 4096] [--dims 64 128] [--repeat 3]

Runs ``ring_attention`` / ``ring_attention_backward`` on a single rank (the
ring degenerates to the local block) with one BLAS thread, and, when torch is
installed, ``torch.nn.functional.scaled_dot_product_attention`` on the same
shapes with one thread.  FLOPs as FlashAttention counts them: forward
``4 B H S^2 D`` (halved for causal), backward 2.5x forward.  Prints GFLOP/s
and the ratio ours/torch measured in this run.
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
    head = f"{'D':>4} {'causal':>6} | {'fwd GF/s':>9} {'torch':>9} {'ratio':>6} | {'bwd GF/s':>9} {'torch':>9} {'ratio':>6}"
    print(f"S={args.seq} B={args.batch} H={args.heads} float32, 1 thread")
    print(head)
    print("-" * len(head))
    if measure_torch(64, 8, 1, 1, False, 1) is None:
        print("(torch not installed: no ratio; pip install 'ringmpi[bench]')")
    for dim in args.dims:
        for causal in (False, True):
            shape = (args.seq, dim, args.heads, args.batch, causal, args.repeat)
            ours, theirs = measure_ours(*shape), measure_torch(*shape)
            cells = []
            for i in range(2):
                cells.append(f"{ours[i] / 1e9:9.2f} " + (
                    f"{theirs[i] / 1e9:9.2f} {ours[i] / theirs[i]:6.2f}x" if theirs
                    else f"{'-':>9} {'-':>6}"))
            print(f"{dim:>4} {str(causal):>6} | {cells[0]} | {cells[1]}", flush=True)


if __name__ == "__main__":
    main()
