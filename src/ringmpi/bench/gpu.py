"""GPU kernel benchmark: TFLOP/s of the local block kernels.

    python -m ringmpi.bench.gpu [--seqlens 4096 16384] [--dims 64 128] [--dtypes bfloat16 float16] [--quick]

FLOPs as FlashAttention counts them: forward 4*B*H*S*S*D (halved for
causal), backward 2.5x forward.  One block covers the whole sequence
(single GPU, no MPI).  When torch is importable, the same shapes run through
``torch.nn.functional.scaled_dot_product_attention`` with the flash backend
and the table shows our rate as a fraction of torch's.  K and V are stored in
the benchmarked dtype (bfloat16 or float16), the resident queries and the
accumulators in float32, as the ring holds them.  Each row prints as soon as it
is measured, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse

import numpy as np

from ..core.flops import attention_flops
from .sdpa import flash_sdpa_cuda_seconds


def _time(fn, stream, repeats):
    import cupy as cp
    fn()  # warm-up (compiles on first use)
    stream.synchronize()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record(stream)
    for _ in range(repeats):
        fn()
    stop.record(stream)
    stop.synchronize()
    return cp.cuda.get_elapsed_time(start, stop) / 1e3 / repeats


def bench_ours(batch, heads, seqlen, d, causal, repeats, dtype="bfloat16"):
    import cupy as cp
    from ..backends.cupy_backend import CupyBackend
    from ..core.masks import BlockMask, ScoreSpec

    be = CupyBackend.instance()
    rng = cp.random.default_rng(0)
    shape = (batch, heads, seqlen, d)
    qh = rng.standard_normal(shape, dtype=cp.float32)
    kh = be.to_heads(rng.standard_normal((batch, seqlen, heads, d), dtype=cp.float32), dtype)
    vh = be.to_heads(rng.standard_normal((batch, seqlen, heads, d), dtype=cp.float32), dtype)
    o_acc = cp.zeros(shape, cp.float32)
    m = cp.full(shape[:3], -cp.inf, cp.float32)
    l = cp.zeros(shape[:3], cp.float32)
    pos = np.arange(seqlen, dtype=np.int64)
    mask = BlockMask(ScoreSpec(causal=causal), pos, pos)
    scale = 1.0 / np.sqrt(d)

    def fwd():
        be.forward_block(qh, kh, vh, o_acc, m, l, scale, mask)

    t_fwd = _time(fwd, be.stream, repeats)
    m.fill(-cp.inf), l.fill(0), o_acc.fill(0)
    fwd()
    o, lse = be.finalize(o_acc, m, l, dtype)
    doh = rng.standard_normal(shape, dtype=cp.float32)
    dvec = be.row_dot(doh, be.to_heads(o, cp.float32))
    dq, dk, dv = cp.zeros(shape, cp.float32), cp.zeros(shape, cp.float32), cp.zeros(shape, cp.float32)

    def bwd():
        be.backward_block(qh, doh, lse, dvec, kh, vh, dq, dk, dv, scale, mask)

    t_bwd = _time(bwd, be.stream, repeats)
    return t_fwd, t_bwd


HEADER = (f"{'dtype':>8} {'S':>6} {'D':>4} {'causal':>6} {'fwd TF/s':>9} {'bwd TF/s':>9} "
          f"{'fwd/torch':>9} {'bwd/torch':>9}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16"], choices=("bfloat16", "float16"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="S=4096 only, 2 repeats")
    args = parser.parse_args(argv)
    if args.quick:
        args.seqlens, args.repeats = [4096], 2
    from ..runtime.device import gpu_unavailable_reason
    reason = gpu_unavailable_reason()
    if reason is not None:
        raise SystemExit(f"ringmpi.bench.gpu: {reason}")

    print(f"B={args.batch}, H={args.heads}, {args.repeats} timed calls after one warm-up; "
          f"ratio = torch flash SDPA time / ours (1.0 = parity)")
    print(HEADER, flush=True)
    for seqlen in args.seqlens:
        for d in args.dims:
            for dtype in args.dtypes:
                for causal in (False, True):
                    flops = {phase: attention_flops(args.batch, args.heads, seqlen, seqlen, d, causal, phase)
                             for phase in ("forward", "backward")}
                    t_fwd, t_bwd = bench_ours(args.batch, args.heads, seqlen, d, causal, args.repeats, dtype)
                    ref = flash_sdpa_cuda_seconds(args.batch, args.heads, seqlen, d, causal, args.repeats,
                                                  dtype)
                    ratios = (ref[0] / t_fwd, ref[1] / t_bwd) if ref is not None else (float("nan"),) * 2
                    print(f"{dtype:>8} {seqlen:>6} {d:>4} {'yes' if causal else 'no':>6} "
                          f"{flops['forward'] / t_fwd / 1e12:>9.1f} {flops['backward'] / t_bwd / 1e12:>9.1f} "
                          f"{ratios[0]:>9.2f} {ratios[1]:>9.2f}", flush=True)


if __name__ == "__main__":
    main()
