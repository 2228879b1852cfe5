"""``ringmpi bench`` on the flat ring (or one ``head_parallel``): one run or a scaling sweep.

One configuration (:func:`ringmpi.bench.measure.measure`) on the whole job,
or with ``sweep="strong"`` the global length ``n`` on the first
``P = 1, 2, 4, ...`` ranks of the job (sub-communicators, ending with the whole
job); ``sweep="weak"`` reads ``n`` as the per-rank length ``S_local`` and
runs ``N = P * S_local``.  Attention is quadratic, so in weak scaling each
rank's work grows with ``P``; both sweeps therefore report the efficiency
``tflops(P) / (P * tflops(1))``, per-rank throughput against one rank.
Rank 0 collects everything with one gather at the end and reports the
figures of :mod:`ringmpi.bench.summary`.
"""

from __future__ import annotations

import os

import click

from ..core.modifiers import FIELDS as MODIFIER_FIELDS
from .machine import environment, gemm_rate, instrumentation_unit_costs, rank_environment
from .measure import idle_barrier, measure, measure_flops, sweep_sizes
from .summary import chosen_head_parallel, describe, point, write_json


def run(comm, be, cfg, n, sweep, json_path, plot_path, progress) -> None:
    """Measure every configuration (collective); rank 0 prints the report, writes JSON and the plot.

    ``cfg``: the problem and repeats (batch, heads, kv_heads, dim, dtype, causal, layout,
    backward, repeat, warmup, seed, and dim_v, head_parallel, softcap, sinks, dropout, invariant when
    used); ``sweep``: None, ``"strong"`` or ``"weak"``; ``progress``: rank 0's report
    (:class:`ringmpi.cli.progress.Progress`).
    """
    from mpi4py import MPI

    rank, size = comm.Get_rank(), comm.Get_size()
    sizes = [size] if sweep is None else sweep_sizes(size)
    load_before = os.getloadavg()
    gemm = gemm_rate(be, cfg["dtype"]) if rank == 0 else None
    idle_barrier(comm)
    progress.start(sum(measure_flops(cfg, n * p if sweep == "weak" else n) for p in sizes))
    mine = []
    for p in sizes:
        sub = comm.Split(0 if rank < p else MPI.UNDEFINED, rank)
        if sub == MPI.COMM_NULL:
            mine.append(None)  # not in this configuration: wait without taking a core
        else:
            n_global = n * p if sweep == "weak" else n
            mine.append(measure(sub, be, cfg, n_global, progress))
            if sweep:
                progress.note(f"measured P={p} N={n_global}")
            sub.Free()
        idle_barrier(comm)
    progress.close()
    instrument = instrumentation_unit_costs(be) if rank == 0 else None
    gathered = comm.gather((rank_environment(), mine), root=0)
    if rank != 0:
        return
    env = environment(be, [g[0] for g in gathered], gemm, load_before)
    points = [point([g[1][i] for g in gathered[:p]], cfg, gemm, instrument) for i, p in enumerate(sizes)]
    base = {"world_size": size, "backend": be.name, "n": n,
            **{k: v for k, v in cfg.items() if k != "backward"}, "environment": env}
    report = _report(base, points, sweep, cfg["backward"])
    if sweep is None and cfg.get("head_parallel") == "auto":
        report["head_parallel_chosen"] = chosen_head_parallel(gathered[0][1][0]["forward"]["records"][0])
    click.echo(_format_single(report) if sweep is None else _format_sweep(report))
    if json_path:
        write_json(report, json_path)
        click.echo(f"wrote {json_path}")
    if plot_path:
        from .plots import plot_scaling, plot_timeline
        (plot_timeline if sweep is None else plot_scaling)(report, plot_path)
        click.echo(f"wrote {plot_path}")


def _report(base: dict, points: list, sweep, backward: bool) -> dict:
    """The report of one run (``mode`` single) or of a sweep (``points`` with their efficiency)."""
    if sweep is None:
        return {**base, "mode": "single", **points[0]}
    for pt in points:
        pt["efficiency"] = {ph: pt[ph]["tflops"] / (pt["world_size"] * points[0][ph]["tflops"])
                            for ph in ("forward", "backward") if ph in pt}
    report = {**base, "mode": sweep, "sweep": sweep,
              "n_meaning": "per-rank length S_local" if sweep == "weak" else "global length",
              "forward": points[-1]["forward"], "points": points}
    if backward:
        report["backward"] = points[-1]["backward"]
    return report


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
    if s.get("schedule"):
        choice = s.get("choice")
        lines.append(f"{'':<9}K/V schedule {', '.join(s['schedule'])}" + ("" if choice is None else
                     f" (chosen by auto: {choice['chosen'] or s['schedule'][0]}, predicted {choice['predicted_s']:.4g} s"
                     + (f" of which {choice['predicted_fixed_s']:.3g} s per call" if choice.get("predicted_fixed_s")
                        else "")
                     + (f", runner-up {choice['runner_up']} {choice['runner_up_s']:.4g} s" if choice["runner_up"]
                        else "") + ")"))
    return lines


def _format_single(r):
    head = (f"ringmpi bench: P={r['world_size']} N={r['n']} {describe(r)}, "
            f"{r['repeat']} repeats after {r['warmup']} warm-up")
    head += "".join(part for part, used in ((f", softcap {r.get('softcap')}", r.get("softcap") is not None),
                                            (", sinks", r.get("sinks"))) if used)
    if r.get("dropout"):
        head += f", dropout {r['dropout']}"
    if r.get("window") is not None:
        head += f", window {tuple(r['window'])}"
    head += "".join(f", {name}" for name in MODIFIER_FIELDS if r.get(name) is not None)
    if r.get("invariant"):
        head += ", invariant"
    if "head_parallel" in r:
        chosen = f" (U={r['head_parallel_chosen']})" if "head_parallel_chosen" in r else ""
        head += f", head_parallel {r['head_parallel']}{chosen}"
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
