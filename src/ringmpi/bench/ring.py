"""``ringmpi bench``: does the transfer hide behind compute, and how does it scale?

    mpirun -n 4 ringmpi bench --n 16384 --causal --layout zigzag --backward \\
        --json bench.json --plot timeline.png
    mpirun -n 4 ringmpi bench --sweep weak --n 4096 --json weak.json --plot weak.png

Every rank generates its own synthetic shard (no file I/O), runs ``--warmup``
untimed and ``--repeat`` timed calls of :func:`ringmpi.ring_attention` (and
:func:`ringmpi.ring_attention_backward` with ``--backward``), each started
after a barrier, and keeps the ring's per-step records (compute seconds,
seconds blocked waiting, bytes, tiles computed/skipped).  Rank 0 collects
everything with one gather at the end and reports, per phase:

* ``tflops``: FlashAttention FLOPs (forward ``4 B H N_q N_kv D``, halved when
  causal; backward 2.5x forward) over ``seconds_median``, the median over
  repeats of the job's ring time (the slowest rank's wall time of the call);
* per rank (median over repeats): ``rank_seconds`` (wall time of the call),
  ``compute_seconds`` (sum of step compute), ``wait_seconds`` (sum of time
  blocked on the ring), ``exposed_comm_seconds`` (wall minus compute);
* ``exposed_comm_fraction``: ``(seconds_median - max compute) / seconds_median``,
  the share of ring time the busiest rank's compute does not cover;
* ``overlap_efficiency``: the busiest rank's compute over its own wall time
  (1 when the transfers hide completely behind compute);
* ``imbalance``: max / mean of per-rank compute (``tile_imbalance``: the same
  for tiles computed, free of timing noise);
* ``peak_memory_bytes``: per-rank high-water mark, RSS (``VmHWM``, reset per
  configuration) on CPU, the CuPy memory pool's footprint with ``--backend cupy``;
* ``peak_alloc_bytes`` (CPU): per-rank high-water mark of what one call
  allocates, from ``tracemalloc`` in one extra untimed call (NumPy buffers and
  Python objects the call creates; not its inputs, the interpreter, MPI's or
  BLAS's own buffers): the figure that shows what the ring itself costs per P.

``--sweep strong`` keeps the global length ``--n`` and runs on the first
``P = 1, 2, 4, ...`` ranks of the job (sub-communicators, ending with the whole
job); ``--sweep weak`` reads ``--n`` as the per-rank length ``S_local`` and
runs ``N = P * S_local``.  Attention is quadratic, so in weak scaling each
rank's work grows with ``P``; both sweeps therefore report the efficiency
``tflops(P) / (P * tflops(1))``, per-rank throughput against one rank.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import sys
import time

import click

from ..flops import attention_flops
from ..layout import KINDS
from .sdpa import measure_sdpa

INSTALL_PLOT = "pip install 'ringmpi[plot]'"


@click.command("bench")
@click.option("--n", "n", type=click.IntRange(min=1), default=4096, show_default=True,
              help="Global sequence length (per-rank length S_local with --sweep weak).")
@click.option("--heads", type=click.IntRange(min=1), default=8, show_default=True, help="Query heads H.")
@click.option("--kv-heads", type=click.IntRange(min=1), default=None,
              help="Key/value heads (GQA/MQA); must divide --heads.  [default: --heads]")
@click.option("--dim", type=click.IntRange(min=1), default=64, show_default=True, help="Head dimension D.")
@click.option("--dim-v", type=click.IntRange(min=1), default=None,
              help="Value head dimension D_v of v, o, do [default: D].")
@click.option("--batch", type=click.IntRange(min=1), default=1, show_default=True, help="Batch size B.")
@click.option("--dtype", type=click.Choice(["float16", "bfloat16", "float32", "float64"]), default="float32",
              show_default=True)
@click.option("--causal", is_flag=True, help="Causal mask.")
@click.option("--layout", type=click.Choice(KINDS), default="contiguous", show_default=True,
              help="Token layout over ranks (zigzag/striped balance causal work).")
@click.option("--backward", is_flag=True, help="Also time ring_attention_backward.")
@click.option("--repeat", type=click.IntRange(min=1), default=5, show_default=True, help="Timed calls per phase.")
@click.option("--warmup", type=click.IntRange(min=0), default=1, show_default=True,
              help="Untimed calls before the timed ones.")
@click.option("--backend", type=click.Choice(["auto", "numpy", "cupy"]), default="auto", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the synthetic inputs.")
@click.option("--dropout", type=float, default=0.0, show_default=True, metavar="P",
              help="Dropout on the attention weights (0 <= P < 1), seeded by --seed; "
                   "the torch SDPA column runs without dropout.")
@click.option("--sweep", type=click.Choice(["strong", "weak", "head-parallel"]), default=None,
              help="Scaling sweep over P = 1, 2, 4, ... ranks of the job; head-parallel: every U "
                   "dividing P and H on all ranks (ringmpi.bench.head_parallel).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Write every figure and the environment to this JSON file.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help=f"Write a PNG: per-rank step timeline, or efficiency against P with --sweep ({INSTALL_PLOT}).")
@click.option("--decode", is_flag=True, help="Time decode_attention over a sharded cache against the ring "
              "(ringmpi.bench.decode; P = 1, 2, 4, ... of the job).")
@click.option("--cache", type=click.IntRange(min=1), default=16384, show_default=True,
              help="With --decode: cache length N.")
@click.option("--new", type=click.IntRange(min=1), default=1, show_default=True,
              help="With --decode: new tokens per call S_new.")
@click.option("--head-parallel", "head_parallel", default=None, metavar="U|auto",
              help="Time the head x ring schedule with U ranks per group [default: RINGMPI_HEAD_PARALLEL, else 1].")
@click.option("--inter-node-gbps", type=click.FloatRange(min=0, min_open=True), default=None, metavar="X",
              help="Bench-only link model: delay each message between (pretend, RINGMPI_NODE_SIZE) nodes "
                   "by bytes / X Gbit/s (ringmpi.bench.linkmodel).")
@click.option("--softcap", type=float, default=None, metavar="C", help="Logit softcap C > 0 (ring only).")
@click.option("--sinks", is_flag=True, help="Attention sinks: one random logit per query head (ring only).")
def bench(n, heads, kv_heads, dim, dim_v, batch, dtype, causal, layout, backward, repeat, warmup, backend, seed,
          dropout, sweep, json_path, plot_path, decode, cache, new, head_parallel, inter_node_gbps, softcap, sinks):
    """Time the ring: per-step timeline, exposed communication, balance, scaling.

    Launch under MPI (``mpirun -n P ringmpi bench ...``); rank 0 prints the
    report.  Figures are defined in ``ringmpi.bench``'s module docstring.
    """
    from mpi4py import MPI

    from ..backends import get_backend
    from ..errors import agree
    from ..ring import resolve_comm

    kv_heads = heads if kv_heads is None else kv_heads
    dim_v = dim if dim_v is None else dim_v
    if decode:
        from .decode import run
        return run(dict(cache=cache, new=new, batch=batch, heads=heads, kv_heads=kv_heads, dim=dim, dtype=dtype,
                        layout=layout, repeat=repeat, warmup=warmup, backend=backend, seed=seed,
                        **({"dim_v": dim_v} if dim_v != dim else {})), json_path)
    comm = resolve_comm(None)
    problem = None
    from ..options import softcap_problem
    from ..dropout import validate as validate_dropout
    if heads % kv_heads:
        problem = f"--heads ({heads}) must be a multiple of --kv-heads ({kv_heads})"
    elif softcap_problem(softcap):
        problem = f"--softcap: {softcap_problem(softcap)}"
    elif plot_path and not _have_matplotlib():
        problem = f"--plot needs matplotlib: {INSTALL_PLOT}"
    elif dropout and validate_dropout(dropout, seed if seed >= 0 else None):
        problem = "--dropout/--seed: " + validate_dropout(dropout, seed if seed >= 0 else None)
    else:
        head_parallel, problem = _head_parallel_option(head_parallel, sweep)
    agree(comm, problem)
    if backend == "cupy":
        from ..device import require_gpu
        require_gpu(comm)
    be = get_backend(backend)

    cfg = dict(batch=batch, heads=heads, kv_heads=kv_heads, dim=dim, dtype=dtype, causal=causal,
               layout=layout, backward=backward, repeat=repeat, warmup=warmup, seed=seed)
    if dim_v != dim:
        cfg["dim_v"] = dim_v
    if head_parallel != 1:
        cfg["head_parallel"] = head_parallel
    if softcap is not None or sinks:  # only then: the report of a plain run keeps its keys
        cfg.update(softcap=softcap, sinks=bool(sinks))
    if dropout:
        cfg["dropout"] = float(dropout)
    if sweep == "head-parallel":
        from .head_parallel import run as run_head_parallel
        return run_head_parallel(comm, be, cfg, n, inter_node_gbps, json_path, plot_path)
    uninstall_links = _link_model(comm, inter_node_gbps)
    rank, size = comm.Get_rank(), comm.Get_size()
    sizes = [size] if sweep is None else _sweep_sizes(size)
    load_before = os.getloadavg()
    gemm = _gemm_rate(be, dtype) if rank == 0 else None
    _idle_barrier(comm)

    mine = []
    for p in sizes:
        sub = comm.Split(0 if rank < p else MPI.UNDEFINED, rank)
        if sub == MPI.COMM_NULL:
            mine.append(None)  # not in this configuration: wait without taking a core
        else:
            n_global = n * p if sweep == "weak" else n
            mine.append(_measure(sub, be, cfg, n_global))
            if rank == 0 and sweep:
                click.echo(f"  measured P={p} N={n_global}", err=True)
            sub.Free()
        _idle_barrier(comm)
    uninstall_links()
    instrument = _instrumentation_unit_costs(be) if rank == 0 else None
    env_rank = {"host": socket.gethostname(), "pid": os.getpid(), "cpus": _cpus(),
                "rss_peak_reset": _reset_rss_peak()}
    gathered = comm.gather((env_rank, mine), root=0)
    if rank != 0:
        return

    env = _environment(be, [g[0] for g in gathered], gemm)
    # other work on the same cores distorts every figure: record it next to them
    env["load_average_1min"] = {"before": load_before[0], "after": os.getloadavg()[0]}
    points = []
    for i, p in enumerate(sizes):
        per_rank = [g[1][i] for g in gathered[:p]]
        points.append(_point(per_rank, cfg, gemm, instrument))
    base = {"world_size": size, "backend": be.name, "n": n,
            **{k: v for k, v in cfg.items() if k != "backward"}, "environment": env}
    if sweep is None:
        report = {**base, "mode": "single", **points[0]}
        click.echo(_format_single(report))
    else:
        for pt in points:
            pt["efficiency"] = {ph: pt[ph]["tflops"] / (pt["world_size"] * points[0][ph]["tflops"])
                                for ph in ("forward", "backward") if ph in pt}
        report = {**base, "mode": sweep, "sweep": sweep,
                  "n_meaning": "per-rank length S_local" if sweep == "weak" else "global length",
                  "forward": points[-1]["forward"], "points": points}
        if backward:
            report["backward"] = points[-1]["backward"]
        click.echo(_format_sweep(report))
    if json_path:
        _write_json(report, json_path)
        click.echo(f"wrote {json_path}")
    if plot_path:
        from .plots import plot_scaling, plot_timeline
        (plot_timeline if sweep is None else plot_scaling)(report, plot_path)
        click.echo(f"wrote {plot_path}")


# ---------------------------------------------------------------------------- measurement
def _head_parallel_option(value, sweep):
    """``(U or "auto", problem)`` of ``--head-parallel`` (default ``RINGMPI_HEAD_PARALLEL``, else 1)."""
    from ..topology import head_parallel_setting

    try:
        setting = head_parallel_setting(value)
    except ValueError as exc:
        return 1, f"--head-parallel: {exc}"
    if sweep in ("strong", "weak") and setting != 1:
        return setting, f"--head-parallel {setting} with --sweep {sweep}: use --sweep head-parallel to compare U"
    if sweep == "head-parallel" and value is not None:
        return setting, "--sweep head-parallel runs every U: drop --head-parallel"
    return setting, None


def _link_model(comm, gbps):
    """Install the bench-only inter-node link model (:mod:`ringmpi.bench.linkmodel`) when ``gbps`` is
    given; return the function that removes it."""
    if not gbps:
        return lambda: None
    from ..topology import node_ids
    from .linkmodel import install

    return install(comm, gbps, node_ids(comm))


def _have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _sweep_sizes(size: int):
    sizes, p = [], 1
    while p < size:
        sizes.append(p)
        p *= 2
    return sizes + [size]


def _idle_barrier(comm) -> None:
    """A barrier that sleeps while it waits, so idle ranks leave the cores to the busy ones."""
    req = comm.Ibarrier()
    nap = 0.0
    while not req.Test():
        time.sleep(nap)
        nap = min(2 * nap + 1e-4, 5e-3)


def _measure(comm, be, cfg, n):
    """This rank's raw timings for one configuration on ``comm`` (collective)."""
    import numpy as np

    from ..attention import ring_attention, ring_attention_backward
    from ..layout import Layout

    rank, p = comm.Get_rank(), comm.Get_size()
    memory = _PeakMemory(be)
    local = int(Layout(cfg["layout"], n, p).counts()[rank])
    rng = np.random.default_rng([cfg["seed"], p, rank])
    b, h, hkv, d, dt = cfg["batch"], cfg["heads"], cfg["kv_heads"], cfg["dim"], cfg["dtype"]

    dv = cfg.get("dim_v", d)

    def randn(heads, width=d):
        return be.asarray(rng.standard_normal((b, local, heads, width), dtype=np.float32).astype(dt))

    q, k, v = randn(h), randn(hkv), randn(hkv, dv)
    kw = dict(comm=comm, layout=cfg["layout"], causal=cfg["causal"], backend=be.name)
    if "head_parallel" in cfg:
        kw["head_parallel"] = cfg["head_parallel"]
    if cfg.get("softcap") is not None:
        kw["softcap"] = cfg["softcap"]
    if cfg.get("sinks"):
        kw["sinks"] = be.asarray(np.random.default_rng(cfg["seed"]).standard_normal(h).astype(np.float32))
    if cfg.get("dropout"):
        kw.update(dropout_p=cfg["dropout"], dropout_seed=cfg["seed"])
    out = {"s_local": local, "baseline_rss_bytes": memory.baseline_rss}

    def forward(stats):
        return ring_attention(q, k, v, stats=stats, **kw)

    o, lse = _repeat(comm, be, forward, cfg, out, "forward")
    out["forward"]["peak_memory_bytes"], out["forward"]["peak_rss_bytes"] = memory.peak()
    out["forward"]["peak_alloc_bytes"] = _traced_peak(comm, be, forward)
    if cfg["backward"]:
        do = randn(h, dv)

        def backward_call(stats):
            return ring_attention_backward(do, q, k, v, o, lse, stats=stats, **kw)

        _repeat(comm, be, backward_call, cfg, out, "backward")
        out["backward"]["peak_memory_bytes"], out["backward"]["peak_rss_bytes"] = memory.peak()
        out["backward"]["peak_alloc_bytes"] = _traced_peak(comm, be, backward_call)
    if p == 1:
        threads = int(os.environ.get("OMP_NUM_THREADS") or os.environ.get("OPENBLAS_NUM_THREADS") or 1)
        out["torch_sdpa"] = measure_sdpa(cfg["batch"], cfg["heads"], cfg["kv_heads"], n, cfg["dim"], cfg["dtype"],
                                         cfg["causal"], cfg["backward"], cfg["warmup"], cfg["repeat"], threads,
                                         device="cuda" if be.name == "cupy" else "cpu", dim_v=cfg.get("dim_v"))
    return out


def _repeat(comm, be, call, cfg, out, phase):
    walls, records, result = [], [], None
    for i in range(cfg["warmup"] + cfg["repeat"]):
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


class _PeakMemory:
    """Per-rank memory high-water mark since construction: host RSS, or the CuPy pool."""

    def __init__(self, be):
        self.cupy_pool = None
        if be.name == "cupy":
            import cupy
            be.synchronize()
            self.cupy_pool = cupy.get_default_memory_pool()
            self.cupy_pool.free_all_blocks()
        _reset_rss_peak()
        self.baseline_rss = _status_bytes("VmRSS")

    def peak(self):
        """(peak_memory_bytes, peak_rss_bytes)."""
        rss = _status_bytes("VmHWM")
        if rss is None:
            import resource
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        # a pool keeps freed blocks cached, so its total is its high-water mark since free_all_blocks
        device = None if self.cupy_pool is None else int(self.cupy_pool.total_bytes())
        return (rss if device is None else device), rss


def _reset_rss_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where that is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _status_bytes(field: str):
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _gemm_rate(be, dtype):
    """This machine's single-process GEMM rate in TFLOP/s (the backend's compute dtype)."""
    xp = be.xp
    n = 4096 if be.name == "cupy" else 1024
    a = xp.ones((n, n), dtype=be.compute_dtype(dtype))
    xp.matmul(a, a)
    be.synchronize()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        xp.matmul(a, a)
        be.synchronize()
        best = min(best, time.perf_counter() - start)
    return {"tflops": 2 * n ** 3 / best / 1e12, "n": n, "dtype": str(be.compute_dtype(dtype))}


def _instrumentation_unit_costs(be):
    """Measured seconds per instrumentation operation, for the overhead account.

    The ring's instrumentation is always on, so its cost is accounted rather than
    switched off: per ring step ``timed_compute`` (measured here around a kernel that does
    nothing), the wait timer (two clock reads and a record update) and the byte
    counters of ``post``; per tile one counter increment.
    """
    from mpi4py import MPI

    from ..ring import Ring
    from ..schedule import timed_compute

    ring = Ring(MPI.COMM_SELF)
    reps = 20000

    def per_call(fn):
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(reps):
                fn()
            best = min(best, (time.perf_counter() - start) / reps)
        return best

    def kernel(tick=None):
        return 1, 0

    def wait_timer():
        start = time.perf_counter()
        ring.record(0).wait_s += time.perf_counter() - start

    def byte_counters():
        rec = ring.record(0)
        rec.bytes_recv += 1
        rec.bytes_sent += 1

    class Counter:
        computed = 0

    counter = Counter()

    def tile():
        counter.computed += 1

    bare = per_call(lambda: kernel(tick=ring.tick))
    return {"timed_s": max(per_call(lambda: timed_compute(be, ring, kernel)) - bare, 0.0),
            "wait_timer_s": per_call(wait_timer), "byte_counters_s": per_call(byte_counters),
            "tile_counter_s": max(per_call(tile) - per_call(lambda: None), 0.0)}


# ---------------------------------------------------------------------------- summaries
def _flops(cfg, n):
    return {phase: attention_flops(cfg["batch"], cfg["heads"], n, n, cfg["dim"], cfg["causal"], phase,
                                   dim_v=cfg.get("dim_v"))
            for phase in ("forward", "backward")}


def _median_index(values):
    order = sorted(range(len(values)), key=values.__getitem__)
    return order[(len(order) - 1) // 2]


def _ratio_max_mean(values):
    mean = sum(values) / len(values)
    return max(values) / mean if mean > 0 else 1.0


def _summary(phase_per_rank, flops, gemm):
    """Figures of one phase from every rank's raw timings (see the module docstring)."""
    walls = [r["walls"] for r in phase_per_rank]
    recs = [r["records"] for r in phase_per_rank]
    repeats = len(walls[0])
    job = [max(w[i] for w in walls) for i in range(repeats)]
    med = statistics.median
    seconds = med(job)
    rank_s = [med(w) for w in walls]
    compute = [med([sum(s["compute_s"] for s in rep) for rep in rr]) for rr in recs]
    wait = [med([sum(s["wait_s"] for s in rep) for rep in rr]) for rr in recs]
    at = _median_index(job)
    steps = [rr[at] for rr in recs]
    tiles_c = [sum(s["tiles_computed"] for s in st) for st in steps]
    tiles_s = [sum(s["tiles_skipped"] for s in st) for st in steps]
    busiest = max(range(len(compute)), key=compute.__getitem__)
    tflops = flops / seconds / 1e12
    p = len(walls)
    return {
        "flops": flops, "tflops": tflops, "seconds_median": seconds, "seconds_min": min(job),
        "seconds_max": max(job), "seconds_by_repeat": job,
        "rank_seconds": rank_s, "rank_seconds_min": min(rank_s), "rank_seconds_median": med(rank_s),
        "rank_seconds_max": max(rank_s), "rank_seconds_by_repeat": walls,
        "compute_seconds": compute, "wait_seconds": wait,
        "exposed_comm_seconds": [w - c for w, c in zip(rank_s, compute)],
        "exposed_comm_fraction": (seconds - compute[busiest]) / seconds,
        "last_hop_wait_seconds": ([med([rep[-1]["wait_s"] for rep in rr]) for rr in recs]
                                  if len(recs[0][0]) > len(walls) else None),
        "overlap_efficiency": compute[busiest] / rank_s[busiest],
        "overlap_efficiency_per_rank": [c / w for c, w in zip(compute, rank_s)],
        "imbalance": _ratio_max_mean(compute), "tile_imbalance": _ratio_max_mean(tiles_c),
        "tiles_computed": tiles_c, "tiles_skipped": tiles_s,
        "bytes_sent": [sum(s["bytes_sent"] for s in st) for st in steps],
        "bytes_recv": [sum(s["bytes_recv"] for s in st) for st in steps],
        "peak_memory_bytes": [r["peak_memory_bytes"] for r in phase_per_rank],
        "peak_rss_bytes": [r["peak_rss_bytes"] for r in phase_per_rank],
        "peak_alloc_bytes": [r.get("peak_alloc_bytes") for r in phase_per_rank],
        "fraction_of_gemm_rate": None if not gemm else tflops / p / gemm["tflops"],
        "timeline": {"repeat": at, "rank_seconds": [w[at] for w in walls], "steps": steps},
    }


def _instrumentation(summary, costs):
    """Accounted cost of the always-on instrumentation as a share of the busiest rank's time."""
    shares = []
    for st, wall in zip(summary["timeline"]["steps"], summary["timeline"]["rank_seconds"]):
        tiles = sum(s["tiles_computed"] + s["tiles_skipped"] for s in st)
        cost = len(st) * (costs["timed_s"] + costs["wait_timer_s"] + costs["byte_counters_s"]) \
            + tiles * costs["tile_counter_s"]
        shares.append(cost / wall if wall > 0 else 0.0)
    return max(shares)


def _point(per_rank, cfg, gemm, costs):
    p = len(per_rank)
    n = sum(r["s_local"] for r in per_rank)
    flops = _flops(cfg, n)
    point = {"world_size": p, "n": n, "s_local": [r["s_local"] for r in per_rank],
             "baseline_rss_bytes": [r["baseline_rss_bytes"] for r in per_rank]}
    phases = ("forward", "backward") if "backward" in per_rank[0] else ("forward",)
    for ph in phases:
        s = _summary([r[ph] for r in per_rank], flops[ph], gemm)
        s["instrumentation_overhead_fraction"] = _instrumentation(s, costs)
        point[ph] = s
    torch = per_rank[0].get("torch_sdpa")
    if torch is not None:
        point["torch_sdpa"] = torch
        for ph in phases:
            theirs = torch.get(f"{ph}_seconds")
            # > 1: ringmpi is faster than torch SDPA on the same shape and threads
            point[ph]["speed_vs_torch_sdpa"] = None if theirs is None else theirs / point[ph]["seconds_median"]
    point["instrumentation_unit_costs"] = costs
    return point


def _environment(be, ranks, gemm):
    import mpi4py
    import numpy as np
    from mpi4py import MPI

    from .. import __version__
    from ..backends import numpy_backend

    env = {
        "ringmpi_version": __version__, "python": sys.version.split()[0], "platform": platform.platform(),
        "mpi_library": MPI.Get_library_version().strip().splitlines()[0],
        "mpi_standard": "%d.%d" % MPI.Get_version(), "mpi4py": mpi4py.__version__, "numpy": np.__version__,
        "backend": be.name, "hostnames": [r["host"] for r in ranks], "cpus_per_rank": [r["cpus"] for r in ranks],
        "cores": os.cpu_count(), "ranks_per_host": {h: sum(r["host"] == h for r in ranks)
                                                    for h in sorted({r["host"] for r in ranks})},
        "threads": {v: os.environ.get(v) for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")},
        "tile": {"q": numpy_backend.TILE_Q, "kv": numpy_backend.TILE_KV},
        "rss_peak_reset": all(r["rss_peak_reset"] for r in ranks), "gemm": gemm,
        "argv": sys.argv,
    }
    if be.name == "cupy":
        import cupy
        env["cupy"] = cupy.__version__
        env["gpu"] = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
    return env


# ---------------------------------------------------------------------------- output
def _mib(x):
    return x / 2 ** 20


def _alloc_mib(values):
    return "-" if None in values else f"{_mib(max(values)):.1f}"


def _format_phase(name, s):
    lines = [
        f"{name:<9}{s['tflops']:.4g} TFLOP/s   ring time median {s['seconds_median']:.4g} s "
        f"(min {s['seconds_min']:.4g}, max {s['seconds_max']:.4g}); per-rank time min/median/max "
        f"{s['rank_seconds_min']:.4g}/{s['rank_seconds_median']:.4g}/{s['rank_seconds_max']:.4g} s",
        f"{'':<9}exposed comm {100 * s['exposed_comm_fraction']:.2f}% of ring time, overlap efficiency "
        f"{s['overlap_efficiency']:.3f}, imbalance {s['imbalance']:.3f} (tiles {s['tile_imbalance']:.3f}), "
        f"peak memory max {_mib(max(s['peak_memory_bytes'])):.0f} MiB",
    ]
    extra = []
    if s.get("fraction_of_gemm_rate") is not None:
        extra.append(f"{100 * s['fraction_of_gemm_rate']:.1f}% of this machine's GEMM rate per rank")
    if s.get("speed_vs_torch_sdpa") is not None:
        extra.append(f"{s['speed_vs_torch_sdpa']:.3f}x torch SDPA speed")
    extra.append(f"instrumentation ~{100 * s['instrumentation_overhead_fraction']:.4f}% (accounted)")
    if None not in s["peak_alloc_bytes"]:
        extra.append(f"peak allocated by one call max {_mib(max(s['peak_alloc_bytes'])):.1f} MiB (tracemalloc)")
    if s.get("last_hop_wait_seconds") is not None:
        extra.append(f"final dK/dV hop wait max {1e3 * max(s['last_hop_wait_seconds']):.2f} ms")
    lines.append(f"{'':<9}" + "; ".join(extra))
    return lines


def describe(r) -> str:
    """The problem of a report, for its table's first line: shape, dtype, mask, layout, backend."""
    return (f"B={r['batch']} H={r['heads']} Hkv={r['kv_heads']} D={r['dim']}{_dim_v(r)} {r['dtype']} "
            f"{'causal' if r['causal'] else 'non-causal'} {r['layout']}, backend {r['backend']}")


def _format_single(r):
    head = (f"ringmpi bench: P={r['world_size']} N={r['n']} {describe(r)}, "
            f"{r['repeat']} repeats after {r['warmup']} warm-up")
    head += "".join(part for part, used in ((f", softcap {r.get('softcap')}", r.get("softcap") is not None),
                                            (", sinks", r.get("sinks"))) if used)
    if r.get("dropout"):
        head += f", dropout {r['dropout']}"
    lines = [head]
    phases = [ph for ph in ("forward", "backward") if ph in r]
    for ph in phases:
        lines += _format_phase(ph, r[ph])
    torch = r.get("torch_sdpa")
    if torch is not None and not torch.get("available"):
        lines.append(f"torch SDPA: {torch['reason']}")
    lines.append(f"{'rank':>4} {'phase':>8} {'S_local':>8} {'wall s':>9} {'compute s':>9} {'wait s':>9} "
                 f"{'tiles':>7} {'skipped':>7} {'MiB sent':>9} {'peak MiB':>9}  host")
    for ph in phases:
        s = r[ph]
        for i in range(r["world_size"]):
            lines.append(f"{i:>4} {ph:>8} {r['s_local'][i]:>8} {s['rank_seconds'][i]:>9.4f} "
                         f"{s['compute_seconds'][i]:>9.4f} {s['wait_seconds'][i]:>9.4f} "
                         f"{s['tiles_computed'][i]:>7} {s['tiles_skipped'][i]:>7} "
                         f"{_mib(s['bytes_sent'][i]):>9.2f} {_mib(s['peak_memory_bytes'][i]):>9.0f}  "
                         f"{r['environment']['hostnames'][i]}")
    return "\n".join(lines)


def _dim_v(r) -> str:
    """`` D_v=...`` when the report's value head dim differs from D, else nothing."""
    return f" D_v={r['dim_v']}" if "dim_v" in r else ""


def _format_sweep(r):
    what = "per-rank S_local" if r["sweep"] == "weak" else "global N"
    lines = [f"ringmpi bench --sweep {r['sweep']}: {what}={r['n']} {describe(r)}; "
             f"efficiency = TFLOP/s(P) / (P * TFLOP/s(1))",
             f"{'P':>3} {'phase':>8} {'N':>8} {'time s':>9} {'TFLOP/s':>9} {'effic.':>7} {'exposed':>8} "
             f"{'overlap':>7} {'imbal.':>6} {'peak MiB':>9} {'alloc MiB':>9}"]
    for pt in r["points"]:
        for ph in ("forward", "backward"):
            if ph not in pt:
                continue
            s = pt[ph]
            lines.append(f"{pt['world_size']:>3} {ph:>8} {pt['n']:>8} {s['seconds_median']:>9.4f} "
                         f"{s['tflops']:>9.4g} {100 * pt['efficiency'][ph]:>6.1f}% "
                         f"{100 * s['exposed_comm_fraction']:>7.2f}% {s['overlap_efficiency']:>7.3f} "
                         f"{s['imbalance']:>6.3f} {_mib(max(s['peak_memory_bytes'])):>9.0f} "
                         f"{_alloc_mib(s['peak_alloc_bytes']):>9}")
    return "\n".join(lines)


def _write_json(report, path):
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
