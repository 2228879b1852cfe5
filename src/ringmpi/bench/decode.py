"""``ringmpi bench --decode``: latency of decode over a sharded cache against the ring.

    mpirun -n 4 ringmpi bench --decode --cache 65536 --new 1 --repeat 200

For ``P = 1, 2, 4, ...`` ranks of the job (sub-communicators, ending with the
whole job) every rank holds its shard of an ``N = --cache`` token KV cache
(a :class:`ringmpi.KVCache` under ``--layout``) and ``S_new = --new`` new
tokens, and times ``--repeat`` calls (after ``--warmup``), each started after
a barrier, of

* ``decode``: :func:`ringmpi.decode_attention` (causal), split into
  ``compute`` (the local shard) and ``merge`` (packing, the one Allreduce,
  unpacking) as the call reports them;
* ``ring``: the naive alternative, :func:`ringmpi.ring_attention` with the
  ``S_new`` new tokens as queries (sharded by the same layout) over the same
  cache shards, causal, bottom-right aligned: the whole cache moves ``P - 1``
  hops.

A call's latency is the slowest rank's wall time for it; the report gives
its median and 99th percentile per configuration, the median compute and
merge seconds (slowest rank), and ``speedup = ring median / decode median``.
"""

from __future__ import annotations

import json
import os
import time

import click
import numpy as np

from .measure import sweep_sizes

def _measure(comm, be, cfg):
    """This rank's per-call seconds for decode (wall, compute, merge) and the ring (wall)."""
    from ..attention import ring_attention
    from ..context import RingContext
    from ..decode import decode_attention
    from ..kvcache import KVCache
    from ..core.layout import Layout

    rank, p = comm.Get_rank(), comm.Get_size()
    b, h, hkv, d, n, s = (cfg[x] for x in ("batch", "heads", "kv_heads", "dim", "cache", "new"))
    rng = np.random.default_rng([cfg["seed"], p, rank])
    cache_layout = Layout(cfg["layout"], n, p)
    rows = int(cache_layout.counts()[rank])

    def randn(shape):
        return rng.standard_normal(shape, dtype=np.float32).astype(cfg["dtype"])

    dv = cfg.get("dim_v") or d  # the value head dim
    cache = KVCache(b, hkv, d, cfg["dtype"], context=RingContext(comm, layout=cfg["layout"]), capacity=rows, dim_v=dv)
    cache.load_shard(randn((b, rows, hkv, d)), randn((b, rows, hkv, dv)), n)
    q = np.random.default_rng(cfg["seed"]).standard_normal((b, s, h, d), dtype=np.float32).astype(cfg["dtype"])
    q = be.asarray(q)
    views = cache.views()
    q_ring = be.asarray(Layout(cfg["layout"], s, p).shard(np.asarray(q), rank))
    k_ring, v_ring = be.asarray(np.ascontiguousarray(cache.k)), be.asarray(np.ascontiguousarray(cache.v))
    if be.name != "numpy":
        views.update(k_cache=be.asarray(views["k_cache"]), v_cache=be.asarray(views["v_cache"]))

    out = {"decode": [], "compute": [], "merge": [], "ring": []}
    for i in range(cfg["warmup"] + cfg["repeat"]):
        stats = []
        comm.Barrier()
        start = time.perf_counter()
        decode_attention(q, **views, causal=True, context=cache.ring_context(backend=be.name, stats=stats))
        wall = time.perf_counter() - start
        comm.Barrier()
        start = time.perf_counter()
        ring_attention(q_ring, k_ring, v_ring, causal=True,
                       context=RingContext(comm, layout=cfg["layout"], backend=be.name))
        be.synchronize()
        ring_wall = time.perf_counter() - start
        if i >= cfg["warmup"]:
            out["decode"].append(wall)
            out["compute"].append(stats[0].compute_s)
            out["merge"].append(stats[0].merge_s)
            out["ring"].append(ring_wall)
    return out


def _summary(per_rank, p, cfg):
    """Per-call slowest-rank figures for one configuration."""
    def slowest(key):
        return np.max(np.array([r[key] for r in per_rank]), axis=0)

    dec, ring = slowest("decode"), slowest("ring")
    point = {"world_size": p, "s_cache_local_max": -(-cfg["cache"] // p)}
    for name, x in (("decode", dec), ("ring", ring)):
        point[name] = {"median_s": float(np.median(x)), "p99_s": float(np.percentile(x, 99)),
                       "min_s": float(x.min()), "calls": len(x)}
    point["decode"]["compute_median_s"] = float(np.median(slowest("compute")))
    point["decode"]["merge_median_s"] = float(np.median(slowest("merge")))
    point["speedup_vs_ring"] = point["ring"]["median_s"] / point["decode"]["median_s"]
    return point


def _format(report):
    c = report["config"]
    lines = [f"ringmpi bench --decode: N_cache={c['cache']} S_new={c['new']} B={c['batch']} H={c['heads']} "
             f"Hkv={c['kv_heads']} D={c['dim']}{' D_v=%d' % c['dim_v'] if 'dim_v' in c else ''} {c['dtype']} "
             f"{c['layout']}, backend {report['backend']}, "
             f"{c['repeat']} calls after {c['warmup']} warm-up; seconds per call, slowest rank",
             f"{'P':>3} {'decode med':>11} {'p99':>9} {'compute':>9} {'merge':>9} {'ring med':>10} "
             f"{'p99':>9} {'speedup':>8}"]
    for pt in report["points"]:
        d, r = pt["decode"], pt["ring"]
        lines.append(f"{pt['world_size']:>3} {d['median_s']:>11.3e} {d['p99_s']:>9.3e} {d['compute_median_s']:>9.3e} "
                     f"{d['merge_median_s']:>9.3e} {r['median_s']:>10.3e} {r['p99_s']:>9.3e} "
                     f"{pt['speedup_vs_ring']:>7.2f}x")
    return "\n".join(lines)


def run(cfg, json_path=None):
    """Collective over COMM_WORLD: measure every configuration, report on rank 0."""
    from mpi4py import MPI

    from ..backends import get_backend
    from ..runtime.errors import agree
    from ..parallel.comm import resolve_comm

    comm = resolve_comm(None)
    agree(comm, None if cfg["heads"] % cfg["kv_heads"] == 0 else
          f"--heads ({cfg['heads']}) must be a multiple of --kv-heads ({cfg['kv_heads']})")
    be = get_backend(cfg["backend"])
    rank, size = comm.Get_rank(), comm.Get_size()
    mine = []
    for p in sweep_sizes(size):
        sub = comm.Split(0 if rank < p else MPI.UNDEFINED, rank)
        if sub == MPI.COMM_NULL:
            mine.append(None)
        else:
            mine.append(_measure(sub, be, cfg))
            sub.Free()
        comm.Barrier()
    gathered = comm.gather(mine, root=0)
    if rank != 0:
        return
    points = [_summary([g[i] for g in gathered[:p]], p, cfg) for i, p in enumerate(sweep_sizes(size))]
    report = {"mode": "decode", "backend": be.name, "world_size": size, "config": cfg, "points": points,
              "load_average_1min": os.getloadavg()[0]}
    click.echo(_format(report))
    if json_path:
        tmp = f"{json_path}.tmp{os.getpid()}"
        with open(tmp, "w") as fh:
            json.dump(report, fh, indent=1)
        os.replace(tmp, json_path)
        click.echo(f"wrote {json_path}")
