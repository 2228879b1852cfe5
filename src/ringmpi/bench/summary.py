"""The figures of a ``ringmpi bench`` report, from every rank's raw timings (:mod:`.measure`).

Per phase:

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
"""

from __future__ import annotations

import json
import os
import statistics

from ..core.flops import attention_flops


def phase_flops(cfg, n):
    return {phase: attention_flops(cfg["batch"], cfg["heads"], n, n, cfg["dim"], cfg["causal"], phase,
                                   dim_v=cfg.get("dim_v"))
            for phase in ("forward", "backward")}


def chosen_head_parallel(records) -> int:
    """The ``U`` one call ran with, from its stats (records as dicts): its all-to-alls' ``U``, or 1."""
    return next((r["head_parallel"] for r in records if "stage" in r), 1)


def _median_index(values):
    order = sorted(range(len(values)), key=values.__getitem__)
    return order[(len(order) - 1) // 2]


def _ratio_max_mean(values):
    mean = sum(values) / len(values)
    return max(values) / mean if mean > 0 else 1.0


def phase_summary(phase_per_rank, flops, gemm):
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
        "schedule": sorted({s.get("schedule", "ring") for st in steps for s in st if "stage" not in s}),
        "choice": _choice(steps[0]),
        "timeline": {"repeat": at, "rank_seconds": [w[at] for w in walls], "steps": steps},
    }


def _choice(steps):
    """``{"chosen", "predicted_s", "predicted_fixed_s", "runner_up", "runner_up_s"}`` of rank 0's first
    ring step where ``schedule="auto"`` or ``head_parallel="auto"`` chose (issue 53), else None."""
    first = next((s for s in steps if s.get("predicted_s") is not None), None)
    keys = ("chosen", "predicted_s", "predicted_fixed_s", "runner_up", "runner_up_s")
    return None if first is None else {k: first.get(k) for k in keys}


def _instrumentation(summary, costs):
    """Accounted cost of the always-on instrumentation as a share of the busiest rank's time."""
    shares = []
    for st, wall in zip(summary["timeline"]["steps"], summary["timeline"]["rank_seconds"]):
        tiles = sum(s["tiles_computed"] + s["tiles_skipped"] for s in st)
        cost = len(st) * (costs["timed_s"] + costs["wait_timer_s"] + costs["byte_counters_s"]) \
            + tiles * costs["tile_counter_s"]
        shares.append(cost / wall if wall > 0 else 0.0)
    return max(shares)


def point(per_rank, cfg, gemm, costs):
    p = len(per_rank)
    n = sum(r["s_local"] for r in per_rank)
    flops = phase_flops(cfg, n)
    point = {"world_size": p, "n": n, "s_local": [r["s_local"] for r in per_rank],
             "baseline_rss_bytes": [r["baseline_rss_bytes"] for r in per_rank]}
    phases = ("forward", "backward") if "backward" in per_rank[0] else ("forward",)
    for ph in phases:
        s = phase_summary([r[ph] for r in per_rank], flops[ph], gemm)
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


def describe(r) -> str:
    """The problem of a report, for its table's first line: shape, dtype, mask, layout, backend."""
    return (f"B={r['batch']} H={r['heads']} Hkv={r['kv_heads']} D={r['dim']}{_dim_v(r)} {r['dtype']} "
            f"{'causal' if r['causal'] else 'non-causal'} {r['layout']}, backend {r['backend']}")


def _dim_v(r) -> str:
    """`` D_v=...`` when the report's value head dim differs from D, else nothing."""
    return f" D_v={r['dim_v']}" if "dim_v" in r else ""


def write_json(report, path):
    """``report`` as indented JSON at ``path``, replaced atomically."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
