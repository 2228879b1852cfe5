"""``ringmpi run``: attention over an HDF5 file (the job itself is :mod:`ringmpi.filejob`).

This module parses the options into a :class:`ringmpi.filejob.JobOptions` and
reports: progress on rank 0 (:mod:`ringmpi.cli.progress`: the pass, the ring step,
the rate and the time left; ``--quiet`` silences it) and the summary of times and rates.
"""

from __future__ import annotations

import click

from ..core.flops import attention_flops
from ..core.layout import BALANCED, KINDS
from ..core.modifiers import FIELDS as MODIFIER_FIELDS
from ..options import SCHEDULES
from .flags import attention_flags


# the attention options ringmpi run offers as flags (their flags and help: options.py)
ATTENTION_FLAGS = ("causal", "window", "softmax_scale", "check_finite", "timeout", "head_parallel", "softcap",
                   *MODIFIER_FIELDS, "return_max_logit", "dropout_p", "dropout_seed", "schedule", "invariant")


@click.command("run")
@click.argument("input_path", metavar="IN.h5", type=click.Path(dir_okay=False))
@click.option("-o", "--output", "output_path", required=True, type=click.Path(dir_okay=False),
              help="Output HDF5 file (written atomically).")
@click.option("--layout", type=click.Choice(KINDS + (BALANCED,)), default=None,
              help="Token layout over ranks [default: zigzag when --causal, else contiguous]; balanced: "
                   "the documents of the segment ids placed so every rank sees as many (query, key) pairs.")
@click.option("--backward", is_flag=True, help="Also compute dq, dk, dv from dataset 'do'.")
@click.option("--backend", type=click.Choice(["auto", "numpy", "cupy"]), default="auto", show_default=True)
@click.option("--overwrite", is_flag=True, help="Replace an existing output file.")
@click.option("--resume", is_flag=True,
              help="Continue an interrupted job from its partial output (same input and options).")
@click.option("--heads-per-pass", type=int, default=None, metavar="K",
              help="Query heads per pass (a multiple of H/H_kv) to bound memory [default: all].")
@click.option("--quiet", "-q", is_flag=True, help="No progress report on rank 0 (the summary stays).")
@click.option("--sinks-dataset", default=None, metavar="NAME",
              help="Attention sinks: the (H,) float32/float64 dataset NAME of the input (one logit per "
                   "query head); writes sinks and, with --backward, dsinks.")
@attention_flags(*ATTENTION_FLAGS, check_finite=dict(default=True, show_default=True),
                 timeout=dict(default=600.0, show_default=True), dropout_p=dict(show_default=True),
                 schedule=dict(type=click.Choice(SCHEDULES)))
def run(input_path, output_path, layout, backward, backend, overwrite, resume, heads_per_pass, quiet, sinks_dataset,
        **attention):
    """Attention over an HDF5 file: each rank reads its shard, runs the ring, writes its outputs.

    \b
    Input datasets: q (B,N,H,D) or (N,H,D); k, v (B,N_kv,H_kv,D); optional do,
    segment_ids / segment_ids_q + segment_ids_kv.  Outputs: o, lse (B,H,N) and,
    with --backward, dq, dk, dv.  See docs/file-format.md.
    \b
      mpirun -n 4 ringmpi run in.h5 -o out.h5 --causal --backward
      mpirun -n 4 ringmpi run in.h5 -o out.h5 --sinks-dataset sinks --softcap 30 --max-logit
      mpirun -n 4 ringmpi run in.h5 -o out.h5 --causal --alibi-slopes 0.5,0.25,0.125,0.0625
      mpirun -n 4 ringmpi run packed.h5 -o out.h5 --causal --layout balanced --backward
    """
    from mpi4py import MPI

    from ..filejob.job import JobOptions, run_job
    from ..parallel.ring_schedule import observe_steps
    from .progress import Progress

    options = JobOptions.of_flags(layout=layout, backward=backward, backend=backend, heads_per_pass=heads_per_pass,
                                  sinks_dataset=sinks_dataset, **attention)
    with observe_steps(Progress(MPI.COMM_WORLD.Get_rank(), quiet=quiet)) as progress:
        result = run_job(input_path, output_path, options, progress, overwrite=overwrite, resume=resume)
    if result.every is not None:  # rank 0
        click.echo(_summary(result))


def _size(nbytes: float) -> str:
    if nbytes < 1024:
        return f"{nbytes:.0f} B"
    return f"{nbytes / 1024:.1f} KiB" if nbytes < 1 << 20 else f"{nbytes / (1 << 20):.1f} MiB"


def _summary(result) -> str:
    """Rank 0's report: the problem, wall time and rates, the ring's balance, HDF5's share."""
    import numpy as np

    spec, o, size = result.spec, result.options, result.world_size
    a = o.attention
    walls, rings, computes, waits, reads, writes = (np.array(col) for col in zip(*result.every))
    wall = float(walls.max())
    phases = "forward+backward" if o.backward else "forward"
    flops = attention_flops(spec.batch, spec.heads, spec.n_q, spec.n_kv, spec.dim, a.causal, phases,
                            dim_v=spec.dim_v)
    mask = ("causal" if a.causal else "full") + (f" window {a.window}" if a.window is not None else "")
    io_s = float(reads.max() + writes.max())
    spread = (rings.max() - rings.min()) / rings.max() * 100 if rings.max() > 0 else 0.0
    lines = [
        f"ringmpi run: N={spec.n_q}" + (f" N_kv={spec.n_kv}" if spec.n_kv != spec.n_q else "")
        + f" B={spec.batch} H={spec.heads} H_kv={spec.kv_heads} D={spec.dim}"
        + (f" D_v={spec.dim_v}" if spec.dim_v != spec.dim else "") + f" {spec.dtype}, "
        f"P={size}, layout {o.layout_name}, {mask}, {phases}, backend {result.backend}, "
        f"{len(result.passes)} pass(es)",
        f"  time: {wall:.3f} s wall; {flops / wall / 1e12:.4f} TFLOP/s overall "
        f"({flops:.3g} FLOP, FlashAttention count)",
        f"  ring per rank: max {rings.max():.3f} s, min {rings.min():.3f} s (spread {spread:.1f}%); "
        f"compute max {computes.max():.3f} s, ring wait max {waits.max():.3f} s; "
        f"{flops / rings.max() / 1e12:.4f} TFLOP/s in the ring" if rings.max() > 0 else "  ring: no time",
        f"  HDF5 (max over ranks): read {reads.max():.3f} s, write {writes.max():.3f} s "
        f"= {io_s / wall * 100:.1f}% of wall",
        f"  output: {result.path}",
    ]
    if result.traffic is not None:
        received = np.array([t[0] for t in result.traffic], dtype=np.float64)
        ran = sorted({s for _, names in result.traffic for s in names})
        auto = a.kv_schedule(o.layout_name == BALANCED) == "auto"
        lines.append(f"  K/V schedule: {', '.join(ran) or 'none'}"
                     + (f" (chosen by schedule auto{_predicted(result.choice)})" if auto else "")
                     + f"; bytes received per rank: max {_size(received.max())}, min {_size(received.min())}")
    u = result.head_parallel
    chosen = ""
    if result.head_parallel_auto:
        named = f" {result.choice[0]}," if result.choice is not None and result.choice[0] else ""
        chosen = f" (chosen by head_parallel auto:{named}{_predicted(result.choice)[1:]})" if result.choice \
            else " (chosen by head_parallel auto)"
    if u > 1:
        lines.append(f"  schedule: head x ring, {u} ranks per group (all-to-all), ring of {size // u} groups"
                     f"{chosen}")
    elif chosen:
        lines.append(f"  schedule: flat ring, head_parallel U=1{chosen}")
    return "\n".join(lines)


def _predicted(choice) -> str:
    """``": predicted X s, runner-up NAME Y s"`` of a job's auto choice, or ``""``."""
    if choice is None:
        return ""
    return f": predicted {choice[1]:.3g} s" + (f", runner-up {choice[2]} {choice[3]:.3g} s" if choice[2] else "")
