"""``ringmpi run``: attention over an HDF5 file (the job itself is :mod:`ringmpi.filejob`).

This module parses the options into a :class:`ringmpi.filejob.JobOptions` and
reports: progress on rank 0 (click's bar on a terminal, plain lines
otherwise) and the summary of times and rates.
"""

from __future__ import annotations

import sys

import click

from ..core.flops import attention_flops
from ..core.layout import KINDS
from ..core.modifiers import FIELDS as MODIFIER_FIELDS
from .flags import attention_flags


class _Progress:
    """click's progress bar on rank 0 when stderr is a terminal, plain lines otherwise."""

    def __init__(self, rank: int):
        self.rank, self.total, self.done, self.bar = rank, 0, 0, None

    def note(self, text: str) -> None:
        if self.rank == 0:
            click.echo(f"[ringmpi] {text}", err=True)

    def start(self, total: int) -> None:
        self.total = total
        if self.rank == 0 and sys.stderr.isatty():
            self.bar = click.progressbar(length=total, label="ring passes", file=sys.stderr)
            self.bar.__enter__()

    def advance(self, what: str, units: int = 1) -> None:
        """Count ``units`` done (or, after ``--resume``, found done before)."""
        self.done += units
        if self.bar is not None:
            self.bar.update(units)
        else:
            self.note(f"{self.done}/{self.total} {what}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)
            self.bar = None


# the attention options ringmpi run offers as flags (their flags and help: options.py)
ATTENTION_FLAGS = ("causal", "window", "softmax_scale", "check_finite", "timeout", "head_parallel", "softcap",
                   *MODIFIER_FIELDS, "return_max_logit", "dropout_p", "dropout_seed", "invariant")


@click.command("run")
@click.argument("input_path", metavar="IN.h5", type=click.Path(dir_okay=False))
@click.option("-o", "--output", "output_path", required=True, type=click.Path(dir_okay=False),
              help="Output HDF5 file (written atomically).")
@click.option("--layout", type=click.Choice(KINDS), default=None,
              help="Token layout over ranks [default: zigzag when --causal, else contiguous].")
@click.option("--backward", is_flag=True, help="Also compute dq, dk, dv from dataset 'do'.")
@click.option("--backend", type=click.Choice(["auto", "numpy", "cupy"]), default="auto", show_default=True)
@click.option("--overwrite", is_flag=True, help="Replace an existing output file.")
@click.option("--resume", is_flag=True,
              help="Continue an interrupted job from its partial output (same input and options).")
@click.option("--heads-per-pass", type=int, default=None, metavar="K",
              help="Query heads per pass (a multiple of H/H_kv) to bound memory [default: all].")
@click.option("--sinks-dataset", default=None, metavar="NAME",
              help="Attention sinks: the (H,) float32/float64 dataset NAME of the input (one logit per "
                   "query head); writes sinks and, with --backward, dsinks.")
@attention_flags(*ATTENTION_FLAGS, check_finite=dict(default=True, show_default=True),
                 timeout=dict(default=600.0, show_default=True), dropout_p=dict(show_default=True))
def run(input_path, output_path, layout, backward, backend, overwrite, resume, heads_per_pass, sinks_dataset,
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
    """
    from mpi4py import MPI

    from ..filejob.job import JobOptions, run_job

    options = JobOptions.of_flags(layout=layout, backward=backward, backend=backend, heads_per_pass=heads_per_pass,
                                  sinks_dataset=sinks_dataset, **attention)
    result = run_job(input_path, output_path, options, _Progress(MPI.COMM_WORLD.Get_rank()),
                     overwrite=overwrite, resume=resume)
    if result.every is not None:  # rank 0
        click.echo(_summary(result))


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
    mask = ("causal" if a.causal else "full") + (f" window {a.window_sides()}" if a.window is not None else "")
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
    u, chosen = result.head_parallel, " (chosen by head_parallel auto)" if result.head_parallel_auto else ""
    if u > 1:
        lines.append(f"  schedule: head x ring, {u} ranks per group (all-to-all), ring of {size // u} groups"
                     f"{chosen}")
    elif chosen:
        lines.append(f"  schedule: flat ring, head_parallel U=1{chosen}")
    return "\n".join(lines)
