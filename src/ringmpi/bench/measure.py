"""Timing ring calls: one configuration of ``ringmpi bench`` on a communicator.

:func:`measure` generates this rank's synthetic shard, runs ``warmup``
untimed and ``repeat`` timed calls of :func:`ringmpi.ring_attention` (and
:func:`ringmpi.ring_attention_backward`), each started after a barrier, and
keeps every call's wall time and the ring's per-step records, the memory
high-water marks and, at ``P = 1``, torch SDPA's time for the same shape.
The figures made of them are :mod:`ringmpi.bench.summary`'s.
"""

from __future__ import annotations

import os
import time

from ..core.modifiers import FIELDS as MODIFIER_FIELDS
from .machine import reset_rss_peak, status_bytes
from .sdpa import measure_sdpa


def sweep_sizes(size: int):
    sizes, p = [], 1
    while p < size:
        sizes.append(p)
        p *= 2
    return sizes + [size]


def idle_barrier(comm) -> None:
    """A barrier that sleeps while it waits, so idle ranks leave the cores to the busy ones."""
    req = comm.Ibarrier()
    nap = 0.0
    while not req.Test():
        time.sleep(nap)
        nap = min(2 * nap + 1e-4, 5e-3)


def measure_flops(cfg, n) -> float:
    """FlashAttention's FLOP count of every call :func:`measure` makes (the progress report's work)."""
    phases = ("forward", "backward") if cfg["backward"] else ("forward",)
    calls = cfg["warmup"] + cfg["repeat"] + 1  # and the traced one
    return calls * sum(_call_flops(cfg, n, ph) for ph in phases)


def _call_flops(cfg, n, phase) -> float:
    from ..core.flops import attention_flops

    return attention_flops(cfg["batch"], cfg["heads"], n, n, cfg["dim"], cfg["causal"], phase,
                           dim_v=cfg.get("dim_v"))


def measure(comm, be, cfg, n, progress=None):
    """This rank's raw timings for one configuration on ``comm`` (collective); ``progress``
    (:class:`ringmpi.cli.progress.Progress`, or None) hears of each call as it begins."""
    import numpy as np

    from ..attention import ring_attention, ring_attention_backward
    from ..context import RingContext
    from ..core.masks import window_of
    from ..core.layout import Layout

    rank, p = comm.Get_rank(), comm.Get_size()
    memory = PeakMemory(be)
    local = int(Layout(cfg["layout"], n, p).counts()[rank])
    rng = np.random.default_rng([cfg["seed"], p, rank])
    b, h, hkv, d, dt = cfg["batch"], cfg["heads"], cfg["kv_heads"], cfg["dim"], cfg["dtype"]

    dv = cfg.get("dim_v", d)

    def randn(heads, width=d):
        return be.asarray(rng.standard_normal((b, local, heads, width), dtype=np.float32).astype(dt))

    q, k, v = randn(h), randn(hkv), randn(hkv, dv)
    kw = dict(causal=cfg["causal"])  # the maths; run: where it runs
    run = dict(comm=comm, layout=cfg["layout"], backend=be.name)
    if "head_parallel" in cfg:
        run["head_parallel"] = cfg["head_parallel"]
    if cfg.get("softcap") is not None:
        kw["softcap"] = cfg["softcap"]
    if cfg.get("sinks"):
        kw["sinks"] = be.asarray(np.random.default_rng(cfg["seed"]).standard_normal(h).astype(np.float32))
    if cfg.get("dropout"):
        kw.update(dropout_p=cfg["dropout"], dropout_seed=cfg["seed"])
    if cfg.get("window") is not None:
        kw["window"] = window_of(tuple(cfg["window"]))
    if cfg.get("invariant"):
        run["invariant"] = True
    if cfg.get("schedule"):
        run["schedule"] = cfg["schedule"]
    kw.update({name: np.asarray(cfg[name], dtype=np.float32) for name in MODIFIER_FIELDS if cfg.get(name) is not None})
    out = {"s_local": local, "baseline_rss_bytes": memory.baseline_rss}

    def forward(stats):
        return ring_attention(q, k, v, **kw, context=RingContext(**run, stats=stats))

    announce = _announcer(progress, cfg, n, p)
    result = timed_calls(comm, be, forward, cfg, out, "forward", announce)
    out["forward"]["peak_memory_bytes"], out["forward"]["peak_rss_bytes"] = memory.peak()
    announce("forward", "memory trace")
    out["forward"]["peak_alloc_bytes"] = _traced_peak(comm, be, forward)
    if cfg["backward"]:
        do = randn(h, dv)

        def backward_call(stats):
            return ring_attention_backward(do, q, k, v, result, **kw, context=RingContext(**run, stats=stats))

        timed_calls(comm, be, backward_call, cfg, out, "backward", announce)
        out["backward"]["peak_memory_bytes"], out["backward"]["peak_rss_bytes"] = memory.peak()
        announce("backward", "memory trace")
        out["backward"]["peak_alloc_bytes"] = _traced_peak(comm, be, backward_call)
    if progress is not None:
        progress.end()
    if p == 1:
        threads = int(os.environ.get("OMP_NUM_THREADS") or os.environ.get("OPENBLAS_NUM_THREADS") or 1)
        out["torch_sdpa"] = measure_sdpa(cfg["batch"], cfg["heads"], cfg["kv_heads"], n, cfg["dim"], cfg["dtype"],
                                         cfg["causal"], cfg["backward"], cfg["warmup"], cfg["repeat"], threads,
                                         device="cuda" if be.name == "cupy" else "cpu", dim_v=cfg.get("dim_v"))
    return out


def _announcer(progress, cfg, n, p):
    """``announce(phase, what)``: tell ``progress`` (if any) that a call of ``phase`` begins."""
    def announce(phase, what):
        if progress is not None:
            progress.begin(f"bench P={p} N={n} {phase} {what}", _call_flops(cfg, n, phase))
    return announce


def timed_calls(comm, be, call, cfg, out, phase, announce=None):
    """``cfg["warmup"]`` untimed then ``cfg["repeat"]`` timed calls of ``call(stats)``, each after a
    barrier: ``out[phase] = {"walls": [s, ...], "records": [[record dicts], ...]}``; returns the
    last call's result; ``announce(phase, what)`` (if given) hears each call begin."""
    walls, records, result = [], [], None
    calls = cfg["warmup"] + cfg["repeat"]
    for i in range(calls):
        if announce is not None:
            announce(phase, f"call {i + 1}/{calls}" + (" (warm-up)" if i < cfg["warmup"] else ""))
        stats, result = [], None  # the previous outputs are not part of this call's memory peak
        comm.Barrier()
        start = time.perf_counter()
        result = call(stats)
        be.synchronize()
        wall = time.perf_counter() - start
        if i >= cfg["warmup"]:
            walls.append(wall)
            records.append([vars(r).copy() for r in stats])
    out[phase] = {"walls": walls, "records": records}
    return result


def _traced_peak(comm, be, call):
    """Bytes one untimed call allocates at its peak (tracemalloc), or None on a GPU backend."""
    import tracemalloc

    if be.name != "numpy":
        return None
    comm.Barrier()
    tracemalloc.start()
    try:
        call([])
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


class PeakMemory:
    """Per-rank memory high-water mark since construction: host RSS, or the CuPy pool."""

    def __init__(self, be):
        self.cupy_pool = None
        if be.name == "cupy":
            import cupy
            be.synchronize()
            self.cupy_pool = cupy.get_default_memory_pool()
            self.cupy_pool.free_all_blocks()
        reset_rss_peak()
        self.baseline_rss = status_bytes("VmRSS")

    def peak(self):
        """(peak_memory_bytes, peak_rss_bytes)."""
        rss = status_bytes("VmHWM")
        if rss is None:
            import resource
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        # a pool keeps freed blocks cached, so its total is its high-water mark since free_all_blocks
        device = None if self.cupy_pool is None else int(self.cupy_pool.total_bytes())
        return (rss if device is None else device), rss
