"""``ringmpi bench --documents``: a pack of documents, zigzag + ring against balanced + routed.

The global sequence of ``n`` tokens is a pack of documents (segment ids: the
document index; ``lognormal:MEAN:SIGMA`` draws the lengths, seeded by
``--seed``, else a file of lengths), attended with the segment ids (and
``--causal``, ``--window``).  Two configurations run in one job on the same problem:

* ``zigzag + ring``: ``Layout("zigzag")``, ``schedule="ring"``;
* ``balanced + routed``: ``Layout("balanced", documents=...)``, ``schedule="routed"``.

Per rank and configuration: the visible (query, key) pairs of its queries
(:func:`ringmpi.core.balance.visible_pairs`), the K/V rows its queries see on
other ranks (:func:`ringmpi.core.balance.seen_elsewhere`: what any schedule must
bring it) and the bytes those rows make, the bytes it received (the calls'
``stats`` records), its tiles and its time (median over repeats).  The report:
work max/mean (the balance target), received over seen bytes (the bytes
target), and the job's time ratio zigzag + ring over balanced + routed.
"""

from __future__ import annotations

import os
import statistics
from typing import List

import click

from .machine import environment, rank_environment
from .measure import idle_barrier, timed_calls
from .summary import write_json

CONFIGS = (("zigzag + ring", "zigzag", "ring"), ("balanced + routed", "balanced", "routed"))


def document_lengths(spec: str, n: int, seed: int) -> List[int]:
    """The pack of ``--documents``: ``lognormal:MEAN:SIGMA`` (drawn, packed to ``n``), or a file of
    lengths (whitespace or comma separated) that must sum to ``n``; ValueError otherwise."""
    from ..core.balance import lognormal_documents

    if spec.startswith("lognormal:"):
        try:
            mean, sigma = (float(x) for x in spec.split(":")[1:])
        except ValueError:
            raise ValueError(f"expected lognormal:MEAN:SIGMA, got {spec!r}") from None
        if not (mean >= 1 and sigma >= 0):
            raise ValueError(f"lognormal needs MEAN >= 1 and SIGMA >= 0, got {spec!r}")
        return lognormal_documents(n, mean, sigma, seed)
    if not os.path.isfile(spec):
        raise ValueError(f"{spec!r} is neither lognormal:MEAN:SIGMA nor a file of document lengths")
    with open(spec) as fh:
        text = fh.read().replace(",", " ").split()
    try:
        lengths = [int(x) for x in text]
    except ValueError:
        raise ValueError(f"{spec}: document lengths must be integers") from None
    if not lengths or min(lengths) < 1 or sum(lengths) != n:
        raise ValueError(f"{spec}: {len(lengths)} lengths >= 1 summing to {sum(lengths)}, need --n {n}")
    return lengths


def _measure(comm, be, cfg, n, lengths, layout, schedule):
    """This rank's raw figures for one configuration (collective)."""
    import numpy as np

    from ..attention import ring_attention, ring_attention_backward
    from ..context import RingContext
    from ..core.masks import window_of
    from ..core import balance

    rank = comm.Get_rank()
    window = _window(cfg)
    mine = layout.indices(rank)
    ends = np.cumsum(np.asarray(lengths, dtype=np.int64))
    seg = np.broadcast_to(np.searchsorted(ends, mine, side="right"), (cfg["batch"], len(mine))).copy()
    rng = np.random.default_rng([cfg["seed"], rank])
    b, h, hkv, d, dt = cfg["batch"], cfg["heads"], cfg["kv_heads"], cfg["dim"], cfg["dtype"]

    def randn(heads):
        return be.asarray(rng.standard_normal((b, len(mine), heads, d), dtype=np.float32).astype(dt))

    q, k, v = randn(h), randn(hkv), randn(hkv)
    kw = dict(causal=cfg["causal"], window=window_of(window), segment_ids=seg)
    run = dict(comm=comm, layout=layout if layout.kind == "balanced" else layout.kind, backend=be.name,
               schedule=schedule)
    out = {"s_local": len(mine), "pairs": balance.visible_pairs(mine, lengths, cfg["causal"], window),
           "seen_rows": balance.seen_elsewhere(mine, lengths, cfg["causal"], window)}
    result = timed_calls(comm, be, lambda stats: ring_attention(q, k, v, **kw, context=RingContext(**run, stats=stats)),
                         cfg, out, "forward")
    if cfg["backward"]:
        do = randn(h)
        timed_calls(comm, be, lambda stats: ring_attention_backward(do, q, k, v, result, **kw,
                                                                    context=RingContext(**run, stats=stats)),
                    cfg, out, "backward")
    return out


def _window(cfg):
    """The report's window as a :class:`~ringmpi.core.masks.ScoreSpec` holds it (None unbounded)."""
    from ..core.masks import window_sides

    return window_sides(cfg.get("window"))


def _phase(per_rank, phase):
    """Per-rank medians and the job's median time of one phase."""
    med = statistics.median
    walls = [r[phase]["walls"] for r in per_rank]
    recs = [r[phase]["records"][0] for r in per_rank]
    return {"seconds_median": med([max(w[i] for w in walls) for i in range(len(walls[0]))]),
            "rank_seconds": [med(w) for w in walls],
            "bytes_recv": [sum(s["bytes_recv"] for s in st) for st in recs],
            "tiles_computed": [sum(s["tiles_computed"] for s in st) for st in recs],
            "schedule": sorted({s["schedule"] for st in recs for s in st})}


def run(comm, be, cfg, n, spec, json_path) -> None:
    """Both configurations on the whole job (collective); rank 0 prints the report and writes JSON."""
    import numpy as np

    from ..core.layout import Layout

    rank, size = comm.Get_rank(), comm.Get_size()
    lengths = document_lengths(spec, n, cfg["seed"])
    load_before = os.getloadavg()
    idle_barrier(comm)
    mine = []
    for _, kind, schedule in CONFIGS:
        layout = Layout(kind, n, size) if kind != "balanced" else \
            Layout("balanced", n, size, documents=lengths, causal=cfg["causal"], window=_window(cfg))
        mine.append(_measure(comm, be, cfg, n, lengths, layout, schedule))
        idle_barrier(comm)
    gathered = comm.gather((rank_environment(), mine), root=0)
    if rank != 0:
        return
    itemsize = np.dtype(cfg["dtype"]).itemsize
    row_bytes = cfg["batch"] * cfg["kv_heads"] * 2 * cfg["dim"] * itemsize  # one K/V row: K and V
    report = {"mode": "documents", "world_size": size, "backend": be.name, "n": n, "documents_spec": spec,
              "documents": len(lengths), "longest_document": max(lengths), **cfg,
              "environment": environment(be, [g[0] for g in gathered], None, load_before), "configs": []}
    for i, (name, kind, schedule) in enumerate(CONFIGS):
        per_rank = [g[1][i] for g in gathered]
        pairs = [r["pairs"] for r in per_rank]
        entry = {"name": name, "layout": kind, "schedule": schedule, "s_local": [r["s_local"] for r in per_rank],
                 "pairs": pairs, "work_max_over_mean": max(pairs) / (sum(pairs) / size),
                 "seen_bytes": [r["seen_rows"] * row_bytes for r in per_rank]}
        for phase in ("forward", "backward") if cfg["backward"] else ("forward",):
            entry[phase] = _phase(per_rank, phase)
        entry["recv_over_seen_max"] = max((got / seen if seen else (0.0 if got == 0 else float("inf")))
                                          for got, seen in zip(entry["forward"]["bytes_recv"], entry["seen_bytes"]))
        report["configs"].append(entry)
    ring, routed = report["configs"]
    report["time_ratio"] = {phase: ring[phase]["seconds_median"] / routed[phase]["seconds_median"]
                            for phase in ("forward", "backward") if phase in ring}
    click.echo(_format(report))
    if json_path:
        write_json(report, json_path)
        click.echo(f"wrote {json_path}")


def _mib(x):
    return x / 2 ** 20


def _format(r) -> str:
    phases = [ph for ph in ("forward", "backward") if ph in r["configs"][0]]
    lines = [f"ringmpi bench --documents {r['documents_spec']}: N={r['n']} in {r['documents']} documents "
             f"(longest {r['longest_document']}), P={r['world_size']}, B={r['batch']} H={r['heads']} "
             f"Hkv={r['kv_heads']} D={r['dim']} {r['dtype']} {'causal' if r['causal'] else 'non-causal'} "
             + (f"window {tuple(r['window'])} " if r.get("window") is not None else "")
             + f"segment ids, backend {r['backend']}, {r['repeat']} repeats after {r['warmup']} warm-up",
             f"{'':<19}{'work max/mean':>14} {'recv MiB/rank max':>18} {'recv/seen max':>14}"
             + "".join(f" {ph + ' s':>11}" for ph in phases)]
    for c in r["configs"]:
        lines.append(f"{c['name']:<19}{c['work_max_over_mean']:>14.3f} {_mib(max(c['forward']['bytes_recv'])):>18.2f} "
                     f"{c['recv_over_seen_max']:>14.3f}"
                     + "".join(f" {c[ph]['seconds_median']:>11.3f}" for ph in phases))
    lines.append("time ratio (zigzag + ring) / (balanced + routed): "
                 + ", ".join(f"{ph} {x:.2f}x" for ph, x in r["time_ratio"].items()))
    lines.append(f"{'config':<19}{'rank':>4} {'S_local':>8} {'visible pairs':>14} {'seen MiB':>9} "
                 f"{'recv MiB':>9} {'tiles':>7}" + "".join(f" {ph + ' s':>11}" for ph in phases) + "  schedule")
    for c in r["configs"]:
        for i in range(r["world_size"]):
            lines.append(f"{c['name']:<19}{i:>4} {c['s_local'][i]:>8} {c['pairs'][i]:>14} "
                         f"{_mib(c['seen_bytes'][i]):>9.2f} {_mib(c['forward']['bytes_recv'][i]):>9.2f} "
                         f"{c['forward']['tiles_computed'][i]:>7}"
                         + "".join(f" {c[ph]['rank_seconds'][i]:>11.3f}" for ph in phases)
                         + "  " + ",".join(c["forward"]["schedule"]))
    return "\n".join(lines)
