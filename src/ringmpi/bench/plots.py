"""Figures of a ``ringmpi bench`` report (matplotlib, the optional ``[plot]`` extra).

:func:`plot_timeline` draws one row per rank with, step after step, the time
spent computing and the time blocked waiting on the ring (the repetition
whose ring time is the median); :func:`plot_scaling` draws efficiency and
exposed communication against the number of ranks of a sweep.
"""

from __future__ import annotations

COMPUTE, WAIT, OTHER = "#3b75af", "#ef8636", "#c9c9c9"


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _headline(report, phase):
    s = report[phase]
    return (f"{phase}: {s['tflops']:.3g} TFLOP/s, exposed comm {100 * s['exposed_comm_fraction']:.1f}%, "
            f"overlap {s['overlap_efficiency']:.2f}, imbalance {s['imbalance']:.2f}")


def plot_timeline(report, path) -> None:
    """Per-rank, per-step compute and wait bars of a single ``bench`` run, as a PNG."""
    plt = pyplot()
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    phases = [ph for ph in ("forward", "backward") if ph in report]
    p = report["world_size"]
    fig, axes = plt.subplots(len(phases), 1, figsize=(10, 1.0 + (0.9 + 0.45 * p) * len(phases)),
                             squeeze=False)
    for ax, ph in zip(axes[:, 0], phases):
        tl = report[ph]["timeline"]
        for rank, (steps, wall) in enumerate(zip(tl["steps"], tl["rank_seconds"])):
            t = 0.0
            for s in steps:
                ax.plot([t, t], [rank - 0.4, rank + 0.4], color="black", linewidth=0.6)  # step start
                ax.barh(rank, s["compute_s"], left=t, color=COMPUTE, height=0.7, edgecolor="white", linewidth=0.4)
                t += s["compute_s"]
                ax.barh(rank, s["wait_s"], left=t, color=WAIT, height=0.7, edgecolor="white", linewidth=0.4)
                t += s["wait_s"]
            # what the call spent outside its steps (agreement, copies, finalize), drawn last
            ax.barh(rank, max(wall - t, 0.0), left=t, color=OTHER, height=0.7)
        ax.set_yticks(range(p))
        ax.set_yticklabels([f"rank {r}" for r in range(p)])
        ax.invert_yaxis()
        ax.set_xlabel(f"{ph} seconds (repeat {tl['repeat']}, steps in order)")
        ax.set_title(_headline(report, ph), fontsize=9)
    fig.legend(handles=[Patch(color=COMPUTE, label="compute"), Patch(color=WAIT, label="wait on ring"),
                        Patch(color=OTHER, label="outside steps"),
                        Line2D([], [], color="black", linewidth=0.6, label="step start")],
               loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.suptitle(f"ringmpi bench: P={p}, N={report['n']}, H={report['heads']}, D={report['dim']}, "
                 f"{report['dtype']}, {'causal' if report['causal'] else 'non-causal'} {report['layout']}, "
                 f"{report['backend']}", fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_scaling(report, path) -> None:
    """Efficiency and exposed communication against P for a ``bench --sweep`` report, as a PNG."""
    plt = pyplot()

    points = report["points"]
    ps = [pt["world_size"] for pt in points]
    phases = [ph for ph in ("forward", "backward") if ph in points[0]]
    fig, (eff, exp) = plt.subplots(1, 2, figsize=(10, 3.6))
    for ph, marker in zip(phases, ("o", "s")):
        eff.plot(ps, [pt["efficiency"][ph] for pt in points], marker=marker, label=ph)
        exp.plot(ps, [100 * pt[ph]["exposed_comm_fraction"] for pt in points], marker=marker, label=ph)
    eff.axhline(1.0, color="grey", linestyle=":", linewidth=1)
    eff.set_ylim(0, 1.1)
    eff.set_ylabel("efficiency  TFLOP/s(P) / (P TFLOP/s(1))")
    exp.set_ylabel("exposed communication, % of ring time")
    for ax in (eff, exp):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ps)
        ax.set_xticklabels([str(p) for p in ps])
        ax.set_xlabel("ranks P")
        ax.legend(fontsize=8)
    what = "S_local" if report["sweep"] == "weak" else "N"
    fig.suptitle(f"ringmpi {report['sweep']} scaling: {what}={report['n']}, H={report['heads']}, "
                 f"D={report['dim']}, {report['dtype']}, {'causal' if report['causal'] else 'non-causal'} "
                 f"{report['layout']}, {report['backend']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
