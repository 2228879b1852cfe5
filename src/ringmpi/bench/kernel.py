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
    flops = 4.0 * batch * heads * seq * seq * dim * (0.5 if causal else 1.0)
    o, lse = ringmpi.ring_attention(q, k, v, causal=causal, backend="numpy")
    fwd = flops / _best(lambda: ringmpi.ring_attention(q, k, v, causal=causal, backend="numpy"), repeat)
    bwd = 2.5 * flops / _best(lambda: ringmpi.ring_attention_backward(
        do, q, k, v, o, lse, causal=causal, backend="numpy"), repeat)
    return fwd, bwd


# torch runs in a child process: importing it into ours slows NumPy's BLAS by several times
_TORCH_CHILD = """
import json, sys, time
import torch
torch.set_num_threads(1)
seq, dim, heads, batch, causal, repeat = json.loads(sys.argv[1])
def best(fn):
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter(); fn(); times.append(time.perf_counter() - t)
    return min(times)
g = torch.Generator().manual_seed(0)
q, k, v, do = (torch.randn(batch, heads, seq, dim, generator=g) for _ in range(4))
sdpa = torch.nn.functional.scaled_dot_product_attention
flops = 4.0 * batch * heads * seq * seq * dim * (0.5 if causal else 1.0)
with torch.no_grad():
    fwd = flops / best(lambda: sdpa(q, k, v, is_causal=causal))
rq, rk, rv = (t.clone().requires_grad_(True) for t in (q, k, v))
ro = sdpa(rq, rk, rv, is_causal=causal)
bwd = 2.5 * flops / best(lambda: torch.autograd.grad(ro, (rq, rk, rv), do, retain_graph=True))
print(json.dumps([fwd, bwd]))
"""


def measure_torch(seq, dim, heads, batch, causal, repeat):
    """(forward, backward) FLOP/s of torch SDPA with one thread, or None without torch."""
    import json
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", _TORCH_CHILD,
                           json.dumps([seq, dim, heads, batch, causal, repeat])],
                          capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        if "No module named 'torch'" in proc.stderr:
            return None
        raise RuntimeError(f"torch measurement failed:\n{proc.stderr[-2000:]}")
    return tuple(json.loads(proc.stdout.strip().splitlines()[-1]))


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
