"""``ringmpi bench --linear gdn|gla|linear``: the sharded linear-attention layers' scan.

    mpirun -n 4 ringmpi bench --linear gdn --n 262144 --heads 4 --dim 64 --backward --json gdn.json

Every rank makes its contiguous shard of synthetic inputs (keys l2-normalised, log decays in
[-0.1, 0)) and times ``--repeat`` calls (after ``--warmup``), each started after a barrier,
of :class:`ringmpi.linear_attention.ShardRecurrence` (the forward of
:func:`ringmpi.gated_delta_rule` / :func:`ringmpi.simple_gla`, and its backward with
``--backward``), reporting per configuration the slowest rank's median seconds per call, wall and CPU (the
CPU seconds of the busiest rank: what the call costs where every rank has its own core, as on
an oversubscribed test machine it does not), and the split of that rank's time between its
local chunked runs (and corrections) and the scans (waiting for the ranks before it included):

* ``bytes``: at the whole job's ``P``, the bytes each rank receives per call (the scans'
  messages), for ``N = n/16, n/8, .., n`` (``n = --n``; 2^14 .. 2^18 for ``--n 262144``), one call
  each: flat in ``N``;
* ``strong``: ``N = n/16`` on ``P = 1, 2, 4, ...`` ranks of the job, speedup ``t(1) / t(P)``;
* ``weak``: ``n/16 / size`` tokens per rank on ``P = 1, 2, 4, ...``, efficiency ``t(1) / t(P)``;
  beside each ``P > 1``, ``alone``: the same ``P`` ranks each running the one-rank call on its
  own tokens at the same time (no scan, no wait for another rank), so that ``alone / t(P)``
  is the scaling of the scan itself and ``t(1) / alone`` what the ranks cost each other on
  this machine (cores, memory bandwidth, caches shared).
"""

from __future__ import annotations

import json
import os

import numpy as np

from .measure import idle_barrier, sweep_sizes

KINDS = {"gdn": "gated delta rule", "gla": "scalar decay (simple GLA / Mamba-2)", "linear": "linear attention"}
DOUBLINGS = 4  # the bytes are measured at n / 2^4 .. n


def _inputs(cfg, n, comm):
    from ..core.layout import Layout

    rank = comm.Get_rank()
    t = len(Layout("contiguous", n, comm.Get_size()).indices(rank))
    b, h, d, dv = cfg["batch"], cfg["heads"], cfg["dim"], cfg["dim_v"]
    rng = np.random.default_rng([cfg["seed"], comm.Get_size(), rank, n])
    dt = np.dtype(cfg["dtype"])
    k = rng.standard_normal((b, t, h, d))
    x = dict(q=rng.standard_normal((b, t, h, d)), k=k / np.linalg.norm(k, axis=-1, keepdims=True),
             v=rng.standard_normal((b, t, h, dv)),
             g=None if cfg["linear"] == "linear" else -rng.uniform(0, 0.1, (b, t, h)),
             beta=rng.uniform(0.1, 1, (b, t, h)) if cfg["linear"] == "gdn" else None,
             do=rng.standard_normal((b, t, h, dv)))
    return {name: None if a is None else a.astype(dt) for name, a in x.items()}


def _measure(comm, cfg, n):
    """This rank's per-call (wall, local, scan) seconds and bytes received."""
    import time

    from ..linear_attention import ShardRecurrence, agree_call

    x = _inputs(cfg, n, comm)
    delta = cfg["linear"] == "gdn"
    call = agree_call(comm, x["q"], x["k"], x["v"], x["g"], x["beta"], scale=None, initial_state=None,
                      output_final_state=False, cu_seqlens=None, delta=delta)
    do = np.ascontiguousarray(np.moveaxis(x["do"], 1, 2))
    out = {"wall": [], "cpu": [], "local": [], "scan": [], "bytes": []}
    for i in range(cfg["warmup"] + cfg["repeat"]):
        shard = ShardRecurrence(call, x["q"], x["k"], x["v"], x["g"], x["beta"], None)
        comm.Barrier()
        start, cpu = time.perf_counter(), time.process_time()
        if cfg["backward"]:
            shard.backward(do, None, reduce_dinitial=False)  # recomputes the forward, scans both ways
        else:
            shard.forward()
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        if i >= cfg["warmup"]:
            out["wall"].append(wall)
            out["cpu"].append(cpu)
            out["local"].append(shard.seconds["local"])
            out["scan"].append(shard.seconds["scan"])
            out["bytes"].append(shard.bytes_received)
    return out


def _on_ranks(comm, p, cfg, n, alone: bool = False):
    """Measure on the first ``p`` ranks together (``n`` tokens in all), or with ``alone`` each of
    them a one-rank call on ``n`` tokens of its own, all at once; every rank's record gathered to
    rank 0 (others: None)."""
    from mpi4py import MPI

    rank = comm.Get_rank()
    sub = comm.Split((rank if alone else 0) if rank < p else MPI.UNDEFINED, rank)
    mine = None
    if sub != MPI.COMM_NULL:
        mine = _measure(sub, cfg, n)
        sub.Free()
    idle_barrier(comm)
    every = comm.gather(mine, root=0)
    return None if every is None else [r for r in every if r is not None]


def _point(records, p, n):
    wall = np.max([r["wall"] for r in records], axis=0)
    slowest = int(np.argmax([np.median(r["wall"]) for r in records]))
    cpu = np.max([r["cpu"] for r in records], axis=0)
    return {"world_size": p, "n": n, "n_local_max": -(-n // p), "median_s": float(np.median(wall)),
            "cpu_median_s": float(np.median(cpu)),
            "local_median_s": float(np.median(records[slowest]["local"])),
            "scan_median_s": float(np.median(records[slowest]["scan"])),
            "bytes_received_max": int(max(max(r["bytes"]) for r in records)),
            "bytes_received_min": int(min(min(r["bytes"]) for r in records))}


def _format(report):
    c = report["config"]
    passes = "forward + backward" if c["backward"] else "forward"
    lines = [f"ringmpi bench --linear {c['linear']} ({KINDS[c['linear']]}, {passes}): "
             f"B={c['batch']} H={c['heads']} K={c['dim']} V={c['dim_v']} {c['dtype']}, {c['repeat']} calls after "
             f"{c['warmup']} warm-up; seconds per call, slowest rank; load average {report['load_average']}",
             "bytes received per rank per call (the scans) at P = %d:" % report["world_size"]]
    for pt in report["bytes"]:
        lines.append(f"  N={pt['n']:>7}  max {pt['bytes_received_max']:>9} B  min {pt['bytes_received_min']:>9} B  "
                     f"{pt['median_s']:.3e} s")
    for name, key in (("strong, N = %d" % report["strong"][0]["n"], "strong"),
                      ("weak, %d tokens per rank" % report["weak"][0]["n"], "weak")):
        base = report[key][0]["median_s"]
        base_cpu = report[key][0]["cpu_median_s"]
        ratio_name = "t1/tP" if key == "strong" else "eff"
        extra = f" {'alone':>10} {'alone/tP':>8} {'t1/alone':>8}" if key == "weak" else ""
        lines.append(f"{name}:  {'P':>3} {'median':>10} {'local':>10} {'scan':>10} {ratio_name:>7} "
                     f"{'cpu':>10} {'cpu ' + ratio_name:>9}{extra}")
        for pt in report[key]:
            alone = pt.get("alone_median_s")
            extra = (f" {alone:>10.3e} {alone / pt['median_s']:>8.2f} {base / alone:>8.2f}"
                     if alone else "") if key == "weak" else ""
            lines.append(f"  {'':{len(name)}}{pt['world_size']:>3} {pt['median_s']:>10.3e} "
                         f"{pt['local_median_s']:>10.3e} {pt['scan_median_s']:>10.3e} {base / pt['median_s']:>7.2f} "
                         f"{pt['cpu_median_s']:>10.3e} {base_cpu / pt['cpu_median_s']:>9.2f}{extra}")
    return "\n".join(lines)


def run(comm, cfg, json_path=None):
    """Collective: every measurement of the module docstring; rank 0 prints the report."""
    size, rank = comm.Get_size(), comm.Get_rank()
    report = {"mode": "linear", "world_size": size, "config": cfg,
              "load_average": [round(x, 2) for x in os.getloadavg()]}
    bytes_points = []
    for n in [max(1, cfg["n"] >> e) for e in range(DOUBLINGS, -1, -1)]:
        recs = _on_ranks(comm, size, dict(cfg, warmup=0, repeat=1), n)
        if rank == 0:
            bytes_points.append(_point(recs, size, n))
    strong, weak = [], []
    n = max(1, cfg["n"] >> DOUBLINGS)
    per_rank = max(1, n // size)
    for p in sweep_sizes(size):
        recs = _on_ranks(comm, p, cfg, n)
        if rank == 0:
            strong.append(_point(recs, p, n))
        recs = _on_ranks(comm, p, cfg, per_rank * p)
        alone = _on_ranks(comm, p, cfg, per_rank, alone=True) if p > 1 else None
        if rank == 0:
            weak.append(_point(recs, p, per_rank * p))
            if alone:  # the slowest of the ranks running alone at once, call by call
                weak[-1]["alone_median_s"] = float(np.median(np.max([r["wall"] for r in alone], axis=0)))
    if rank != 0:
        return None
    report.update(bytes=bytes_points, strong=strong, weak=weak)
    print(_format(report), flush=True)
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(report, fh, indent=1)
    return report
