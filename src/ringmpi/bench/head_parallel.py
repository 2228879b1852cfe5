"""``ringmpi bench --sweep head-parallel``: when does the head x ring schedule win?

    RINGMPI_NODE_SIZE=2 mpirun -n 4 ringmpi bench --sweep head-parallel --n 8192 \\
        --backward --causal --layout zigzag --plot hp.png

Runs the same problem on all ``P`` ranks of the job with ``head_parallel = U``
for every ``U`` that divides both ``P`` and ``H`` (``U = 1``: the flat ring;
``U = P``: all-to-all only), with :func:`ringmpi.bench.measure.measure`'s
repeats and records, and reports per ``U`` and phase: the job's time
(median over repeats of the slowest rank), the busiest rank's compute,
exposed communication (time not covered by that compute, seconds and share),
bytes sent per rank (max over ranks) inside the groups (the all-to-alls) and
between groups (the ring), and peak memory.  ``auto`` marks the ``U`` that
``head_parallel="auto"`` picks by predicted cost (:func:`auto_choice`) on the nodes of
:func:`ringmpi.parallel.topology.node_ids` (``RINGMPI_NODE_SIZE`` pretends several on one machine).
"""

from __future__ import annotations

import os
import statistics

import click

from .machine import environment, gemm_rate, rank_environment
from .measure import idle_barrier, measure, measure_flops
from .summary import describe, phase_flops, phase_summary, write_json


def candidates(size: int, heads: int):
    """Every ``U`` that divides both ``P`` and ``H``, ascending."""
    return [u for u in range(1, size + 1) if size % u == 0 and heads % u == 0]


def _split_bytes(per_rank_phase):
    """(intra-group, inter-group) bytes sent per rank in the median repeat's records: the
    all-to-alls' records (:class:`ringmpi.parallel.head_parallel.ExchangeRecord`, with a ``stage``) and
    the ring's."""
    intra, inter = [], []
    for raw in per_rank_phase:
        walls = raw["walls"]
        at = sorted(range(len(walls)), key=walls.__getitem__)[(len(walls) - 1) // 2]
        recs = raw["records"][at]
        intra.append(sum(r["bytes_sent"] for r in recs if "stage" in r))
        inter.append(sum(r["bytes_sent"] for r in recs if "stage" not in r))
    return intra, inter


def _a2a_seconds(per_rank_phase):
    """Median over repeats of each rank's seconds in the all-to-alls."""
    return [statistics.median(sum(r["wait_s"] for r in rep if "stage" in r) for rep in raw["records"])
            for raw in per_rank_phase]


def sweep(comm, be, cfg, n, nodes, progress):
    """Measure every candidate ``U`` on ``comm`` (collective); rank 0 gets the points, others None.
    ``progress``: rank 0's report (:class:`ringmpi.cli.progress.Progress`)."""
    size, rank = comm.Get_size(), comm.Get_rank()
    us = candidates(size, cfg["heads"])
    progress.start(len(us) * measure_flops(cfg, n))
    mine = []
    for u in us:
        mine.append(measure(comm, be, dict(cfg, head_parallel=u), n, progress))
        progress.note(f"measured head_parallel={u}")
        idle_barrier(comm)
    progress.close()
    auto = auto_choice(comm, be, cfg, n, nodes)
    gathered = comm.gather(mine, root=0)
    if rank != 0:
        return None
    return us, auto, [[g[i] for g in gathered] for i in range(len(us))]


def auto_choice(comm, be, cfg, n, nodes) -> int:
    """The ``U`` that ``head_parallel="auto"`` picks for this problem (collective): the cost
    model's fastest prediction on this communicator's measured parts among
    :func:`ringmpi.parallel.topology.head_parallel_candidates`, with the bench's schedule (the
    ring by default; ``auto``: the ring or the all-gather)."""
    from ..core.cost_model import Shape
    from ..core.dtypes import resolve
    from ..parallel.cost_measure import choose_plan
    from ..parallel.topology import head_parallel_candidates

    us = head_parallel_candidates(nodes, cfg["heads"])
    if len(us) == 1:
        return 1
    dtype = resolve(cfg["dtype"])
    schedule = cfg.get("schedule") or "ring"
    shape = Shape(n_q=n, n_kv=n, batch=cfg["batch"], heads=cfg["heads"], kv_heads=cfg["kv_heads"], dim=cfg["dim"],
                  dim_v=cfg.get("dim_v") or cfg["dim"], itemsize=dtype.itemsize,
                  grad_itemsize=be.compute_dtype(dtype).itemsize, density=0.5 if cfg["causal"] else 1.0)
    best, _ = choose_plan(comm, be, dtype, shape, ("ring", "allgather") if schedule == "auto" else (schedule,), us,
                          backward=bool(cfg["backward"]))
    return best.head_parallel


def points(us, auto, per_u, cfg, gemm, flops):
    """One report point per ``U``: the ring bench's phase summary plus the byte split."""
    out = []
    for u, per_rank in zip(us, per_u):
        point = {"head_parallel": u, "auto": u == auto, "groups": len(per_rank) // u}
        for ph in ("forward", "backward"):
            if ph not in per_rank[0]:
                continue
            raw = [r[ph] for r in per_rank]
            s = phase_summary(raw, flops[ph], gemm)
            s["bytes_sent_intra_group"], s["bytes_sent_inter_group"] = _split_bytes(raw)
            s["all_to_all_seconds"] = _a2a_seconds(raw)
            busiest = max(range(len(s["compute_seconds"])), key=s["compute_seconds"].__getitem__)
            s["exposed_comm_seconds_job"] = s["seconds_median"] - s["compute_seconds"][busiest]
            point[ph] = s
        out.append(point)
    return out


def format_table(report) -> str:
    mib = 2 ** 20
    lines = [f"ringmpi bench --sweep head-parallel: P={report['world_size']} N={report['n']} {describe(report)}, "
             f"nodes {report['nodes']}",
             f"{'U':>3} {'groups':>6} {'phase':>8} {'time s':>9} {'compute s':>9} {'exposed s':>9} "
             f"{'exposed':>8} {'a2a s':>7} {'MiB intra':>9} {'MiB inter':>9} {'peak MiB':>9}"]
    for pt in report["points"]:
        for ph in ("forward", "backward"):
            if ph not in pt:
                continue
            s = pt[ph]
            mark = "*" if pt["auto"] else " "
            lines.append(f"{pt['head_parallel']:>2}{mark} {pt['groups']:>6} {ph:>8} {s['seconds_median']:>9.4f} "
                         f"{max(s['compute_seconds']):>9.4f} {s['exposed_comm_seconds_job']:>9.4f} "
                         f"{100 * s['exposed_comm_fraction']:>7.2f}% {max(s['all_to_all_seconds']):>7.4f} "
                         f"{max(s['bytes_sent_intra_group']) / mib:>9.2f} "
                         f"{max(s['bytes_sent_inter_group']) / mib:>9.2f} "
                         f"{max(s['peak_memory_bytes']) / mib:>9.0f}")
    lines.append("* = the U that head_parallel='auto' picks on these nodes; exposed = time not covered by "
                 "the busiest rank's compute; MiB per rank (max): intra = all-to-all, inter = ring "
                 "(with one group the backward's dK/dV hop home goes to the rank itself)")
    return "\n".join(lines)


def plot(report, path) -> None:
    """Time and exposed communication against ``U``, per phase, as a PNG."""
    from .plots import pyplot

    plt = pyplot()
    phases = [ph for ph in ("forward", "backward") if ph in report["points"][0]]
    fig, axes = plt.subplots(1, len(phases), figsize=(5.5 * len(phases), 4), squeeze=False)
    us = [pt["head_parallel"] for pt in report["points"]]
    labels = [f"{u}{' (auto)' if pt['auto'] else ''}" for u, pt in zip(us, report["points"])]
    for ax, ph in zip(axes[0], phases):
        total = [pt[ph]["seconds_median"] for pt in report["points"]]
        exposed = [max(pt[ph]["exposed_comm_seconds_job"], 0.0) for pt in report["points"]]
        x = range(len(us))
        ax.bar(x, [t - e for t, e in zip(total, exposed)], color="tab:blue", label="covered by compute")
        ax.bar(x, exposed, bottom=[t - e for t, e in zip(total, exposed)], color="tab:red",
               label="exposed communication")
        ax.set_xticks(list(x), labels)
        ax.set_xlabel("head_parallel U (ranks per all-to-all group)")
        ax.set_ylabel(f"{ph} seconds (median)")
        ax.legend(fontsize=8)
    fig.suptitle(f"head x ring sweep: P={report['world_size']} N={report['n']} H={report['heads']}, "
                 f"nodes {report['nodes']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(comm, be, cfg, n, json_path, plot_path, progress) -> None:
    """The sweep as a command: measure (collective), then rank 0 prints, writes JSON and the plot."""
    from ..parallel.topology import node_ids

    nodes = node_ids(comm)
    load_before = os.getloadavg()
    gemm = gemm_rate(be, cfg["dtype"]) if comm.Get_rank() == 0 else None
    idle_barrier(comm)
    measured = sweep(comm, be, cfg, n, nodes, progress)
    every = comm.gather(rank_environment(), root=0)
    if measured is None:
        return
    us, auto, per_u = measured
    report = {"world_size": comm.Get_size(), "backend": be.name, "n": n,
              **{k: v for k, v in cfg.items() if k not in ("backward", "head_parallel")},
              "mode": "head-parallel", "sweep": "head-parallel", "nodes": nodes, "auto": auto,
              "environment": environment(be, every, gemm, load_before),
              "points": points(us, auto, per_u, cfg, gemm, phase_flops(cfg, n))}
    click.echo(format_table(report))
    if json_path:
        write_json(report, json_path)
        click.echo(f"wrote {json_path}")
    if plot_path:
        plot(report, plot_path)
        click.echo(f"wrote {plot_path}")
