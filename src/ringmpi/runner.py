"""``ringmpi run``: attention over an HDF5 file.

Every rank reads its own shard of ``q``, ``k``, ``v`` (and ``do``), runs the
ring, and writes its shard of ``o``, ``lse`` (and ``dq``, ``dk``, ``dv``) into
one output file, written atomically (see :mod:`ringmpi.io`).  Batch entries
and head groups are processed in passes so a rank holds one pass's shard at a
time.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import List, Optional, Tuple

import click
import numpy as np

from . import __version__
from .layout import KINDS

DEFAULT_PASS_BYTES = 4 << 30


@dataclass(frozen=True)
class Pass:
    """One slice of the work: batch entries ``[b0, b1)`` and kv heads ``[g0, g1)``."""

    b0: int
    b1: int
    g0: int
    g1: int


def plan_passes(spec, world_size: int, heads_per_pass: Optional[int], budget: int) -> List[Pass]:
    """Split (batch, kv-head groups) into passes whose per-rank shard fits ``budget`` bytes.

    ``heads_per_pass`` counts query heads and must be a multiple of the GQA group
    ``H // H_kv`` so each group stays whole; None keeps all heads together.  Batch
    entries are then grouped as many per pass as the budget allows (at least one).
    """
    group = spec.group
    kv_per = spec.kv_heads if heads_per_pass is None else max(1, heads_per_pass // group)
    rows_q = math.ceil(spec.n_q / world_size)
    rows_kv = math.ceil(spec.n_kv / world_size)
    # q, o, do, dq in the input dtype plus float32 head-major copies and accumulators;
    # k, v, dk, dv plus two ring buffers of each and float32 gradient messages
    per_entry = (rows_q * kv_per * group * spec.dim * 4 * 10
                 + rows_kv * kv_per * spec.dim * 4 * 14 + rows_q * kv_per * group * 8)
    b_per = max(1, min(spec.batch, budget // max(1, per_entry)))
    return [Pass(b0, min(b0 + b_per, spec.batch), g0, min(g0 + kv_per, spec.kv_heads))
            for b0 in range(0, spec.batch, b_per) for g0 in range(0, spec.kv_heads, kv_per)]


def flop_count(spec, causal: bool, backward: bool) -> float:
    """FlashAttention's count: forward 4*B*H*Nq*Nkv*D (halved for causal), backward 2.5x."""
    fwd = 4.0 * spec.batch * spec.heads * spec.n_q * spec.n_kv * spec.dim
    if causal:
        fwd /= 2
    return fwd * (3.5 if backward else 1.0)


class _Progress:
    """click's progress bar on rank 0 when stderr is a terminal, plain lines otherwise."""

    def __init__(self, rank: int, total: int, label: str):
        self.rank, self.total, self.done = rank, total, 0
        self.bar = None
        if rank == 0 and sys.stderr.isatty():
            self.bar = click.progressbar(length=total, label=label, file=sys.stderr)
            self.bar.__enter__()

    def advance(self, what: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
        elif self.rank == 0:
            click.echo(f"[ringmpi] {self.done}/{self.total} {what}", err=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)
            self.bar = None


def _resolve_backend(name: str, comm):
    from .backends import gpu_available
    from .errors import agree

    if name == "auto":
        name = "cupy" if gpu_available() else "numpy"
        names = comm.allgather(name)
        agree(comm, None if len(set(names)) == 1 else
              "backend auto: some ranks see a GPU and some do not; pass --backend numpy or cupy")
    if name == "cupy":
        from .device import select_device
        select_device(comm)
    return name


def _boxes(spec, p: Pass):
    """Per-dataset (row_axis, box) for one pass; the row axis entry is a placeholder."""
    h0, h1 = p.g0 * spec.group, p.g1 * spec.group
    d = (0, spec.dim)
    if spec.rank4:
        b = (p.b0, p.b1)
        return {"q": (1, [b, (0, 0), (h0, h1), d]), "kv": (1, [b, (0, 0), (p.g0, p.g1), d]),
                "lse": (2, [b, (h0, h1), (0, 0)])}
    return {"q": (0, [(0, 0), (h0, h1), d]), "kv": (0, [(0, 0), (p.g0, p.g1), d]),
            "lse": (1, [(h0, h1), (0, 0)])}


def _read_segments(fin, name, shard_io, p: Pass, spec):
    dset = fin[name]
    if dset.ndim == 2:
        ids = shard_io.read(dset, 1, [(p.b0, p.b1), (0, 0)])
    else:
        ids = np.broadcast_to(shard_io.read(dset, 0, [(0, 0)]), (p.b1 - p.b0, len(shard_io.indices)))
    return np.ascontiguousarray(ids, dtype=np.int64)


def _window_attr(window):
    return np.array([-1 if w is None else int(w) for w in window], dtype=np.int64)


def _create_outputs(fout, spec, backward: bool, attrs: dict):
    from .io import create_float_dataset

    lse_dtype = np.float64 if spec.dtype == "float64" else np.float32
    q_shape, kv_shape = spec.shapes["q"], spec.shapes["k"]
    lse_shape = (spec.batch, spec.heads, spec.n_q) if spec.rank4 else (spec.heads, spec.n_q)
    names = [("o", q_shape, spec.dtype), ("lse", lse_shape, lse_dtype)]
    if backward:
        names += [("dq", q_shape, spec.dtype), ("dk", kv_shape, spec.dtype), ("dv", kv_shape, spec.dtype)]
    for name, shape, dtype in names:  # collective: identical arguments on every rank
        create_float_dataset(fout, name, shape, dtype, fill_time="never")
    for key, value in attrs.items():
        fout.attrs[key] = value


@click.command("run")
@click.argument("input_path", metavar="IN.h5", type=click.Path(dir_okay=False))
@click.option("-o", "--output", "output_path", required=True, type=click.Path(dir_okay=False),
              help="Output HDF5 file (written atomically).")
@click.option("--causal", is_flag=True, help="Causal mask (bottom-right aligned when N_q != N_kv).")
@click.option("--window", nargs=2, type=int, default=None, metavar="L R",
              help="Sliding window: query i sees keys i-L .. i+R (-1 = unbounded side).")
@click.option("--layout", type=click.Choice(KINDS), default=None,
              help="Token layout over ranks [default: zigzag when --causal, else contiguous].")
@click.option("--backward", is_flag=True, help="Also compute dq, dk, dv from dataset 'do'.")
@click.option("--scale", type=float, default=None, help="Softmax scale [default: 1/sqrt(D)].")
@click.option("--backend", type=click.Choice(["auto", "numpy", "cupy"]), default="auto", show_default=True)
@click.option("--overwrite", is_flag=True, help="Replace an existing output file.")
@click.option("--check-finite", is_flag=True, help="Reject NaN/Inf inputs (exit 2), naming the index.")
@click.option("--timeout", type=float, default=600.0, show_default=True,
              help="Deadline in seconds for each ring wait; a peer that never answers ends the job.")
@click.option("--heads-per-pass", type=int, default=None, metavar="K",
              help="Query heads per pass (a multiple of H/H_kv) to bound memory [default: all].")
def run(input_path, output_path, causal, window, layout, backward, scale, backend, overwrite,
        check_finite, timeout, heads_per_pass):
    """Attention over an HDF5 file: each rank reads its shard, runs the ring, writes its outputs.

    \b
    Input datasets: q (B,N,H,D) or (N,H,D); k, v (B,N_kv,H_kv,D); optional do,
    segment_ids / segment_ids_q + segment_ids_kv.  Outputs: o, lse (B,H,N) and,
    with --backward, dq, dk, dv.  See docs/file-format.md.
    \b
      mpirun -n 4 ringmpi run in.h5 -o out.h5 --causal --backward
    """
    from mpi4py import MPI

    from .errors import ConfigError, fault_point
    from .io import AtomicOutput, ShardIO, inspect_input, open_file
    from .layout import Layout
    from . import ring_attention, ring_attention_backward

    t_start = time.perf_counter()
    comm = MPI.COMM_WORLD.Dup()
    rank, size = comm.Get_rank(), comm.Get_size()
    layout = layout or ("zigzag" if causal else "contiguous")
    win = None
    if window is not None:
        if any(w < -1 for w in window):
            raise ConfigError(f"--window sides must be >= 0 (or -1 for unbounded), got {window[0]} {window[1]}")
        win = tuple(None if w == -1 else int(w) for w in window)
    if timeout <= 0:
        raise ConfigError(f"--timeout must be positive, got {timeout}")
    if scale is not None and not (math.isfinite(scale) and scale > 0):
        raise ConfigError(f"--scale must be a positive finite number, got {scale}")

    spec = inspect_input(input_path, comm, backward=backward)
    if heads_per_pass is not None and (heads_per_pass < 1 or heads_per_pass % spec.group != 0):
        raise ConfigError(f"--heads-per-pass {heads_per_pass}: must be a positive multiple of "
                          f"H/H_kv = {spec.heads}/{spec.kv_heads} = {spec.group} (GQA groups stay whole)")
    backend = _resolve_backend(backend, comm)
    out = AtomicOutput(output_path, comm, overwrite=overwrite, input_path=input_path)
    budget = int(os.environ.get("RINGMPI_PASS_BYTES", DEFAULT_PASS_BYTES))
    passes = plan_passes(spec, size, heads_per_pass, budget)
    lay_q, lay_kv = Layout(layout, spec.n_q, size), Layout(layout, spec.n_kv, size)
    io_q, io_kv = ShardIO(comm, lay_q.indices(rank)), ShardIO(comm, lay_kv.indices(rank))
    softmax_scale = scale if scale is not None else 1.0 / math.sqrt(spec.dim)
    attrs = {
        "ringmpi_version": __version__, "world_size": size, "layout": layout, "causal": bool(causal),
        "window": _window_attr(win) if win is not None else np.array([], dtype=np.int64),
        "segments": bool(spec.seg_q), "softmax_scale": float(softmax_scale), "backend": backend,
        "dtype": spec.dtype, "backward": bool(backward), "input_path": os.path.abspath(input_path),
        "input_shapes": json.dumps({k: list(v) for k, v in spec.shapes.items()}, sort_keys=True),
        "heads_per_pass": -1 if heads_per_pass is None else int(heads_per_pass),
    }
    to_device, to_host = _converters(backend)
    kw = dict(comm=comm, layout=layout, causal=causal, window=win, softmax_scale=softmax_scale,
              backend=backend, timeout=timeout, check_finite=check_finite)
    ring_s, compute_s, wait_s = 0.0, 0.0, 0.0
    progress = _Progress(rank, len(passes) * (2 if backward else 1), "ring passes")
    fin = open_file(input_path, "r", comm)
    try:
        fout = out.open()
        _create_outputs(fout, spec, backward, attrs)
        for p in passes:
            boxes = _boxes(spec, p)
            ax_q, box_q = boxes["q"]
            ax_kv, box_kv = boxes["kv"]
            ax_lse, box_lse = boxes["lse"]
            lift = (lambda x: x) if spec.rank4 else (lambda x: x[None])
            drop = (lambda x: x) if spec.rank4 else (lambda x: x[0])
            q = lift(io_q.read(fin["q"], ax_q, box_q))
            k = lift(io_kv.read(fin["k"], ax_kv, box_kv))
            v = lift(io_kv.read(fin["v"], ax_kv, box_kv))
            seg = {}
            if spec.seg_q:
                seg = dict(segment_ids_q=_read_segments(fin, spec.seg_q, io_q, p, spec),
                           segment_ids_kv=_read_segments(fin, spec.seg_kv, io_kv, p, spec))
            stats: list = []
            t0 = time.perf_counter()
            qd, kd, vd = to_device(q), to_device(k), to_device(v)
            o, lse = ring_attention(qd, kd, vd, stats=stats, **kw, **seg)
            ring_s += time.perf_counter() - t0
            o_host, lse_host = to_host(o), to_host(lse)
            io_q.write(fout["o"], ax_q, drop(o_host), box_q)
            io_q.write(fout["lse"], ax_lse, drop(lse_host), box_lse)
            progress.advance(f"forward batch {p.b0}:{p.b1} kv heads {p.g0}:{p.g1} "
                             f"({time.perf_counter() - t0:.2f} s)")
            if backward:
                do = lift(io_q.read(fin["do"], ax_q, box_q))
                t0 = time.perf_counter()
                dq, dk, dv = ring_attention_backward(to_device(do), qd, kd, vd, o, lse, stats=stats, **kw, **seg)
                ring_s += time.perf_counter() - t0
                io_q.write(fout["dq"], ax_q, drop(to_host(dq)), box_q)
                io_kv.write(fout["dk"], ax_kv, drop(to_host(dk)), box_kv)
                io_kv.write(fout["dv"], ax_kv, drop(to_host(dv)), box_kv)
                progress.advance(f"backward batch {p.b0}:{p.b1} kv heads {p.g0}:{p.g1} "
                                 f"({time.perf_counter() - t0:.2f} s)")
            compute_s += sum(r.compute_s for r in stats)
            wait_s += sum(r.wait_s for r in stats)
        progress.close()
        fault_point("write", rank)
        fin.close()
        out.commit()
    except ConfigError:
        progress.close()
        fin.close()
        out.discard(collective=True)
        raise
    except BaseException:
        out.discard(collective=False)  # this rank alone: the job is about to be aborted
        raise
    wall = time.perf_counter() - t_start
    mine = (wall, ring_s, compute_s, wait_s, io_q.read_s + io_kv.read_s, io_q.write_s + io_kv.write_s)
    every = comm.gather(mine, root=0)
    if rank == 0:
        _summary(spec, size, layout, causal, win, backward, backend, passes, every, out.path)
    comm.Free()


def _converters(backend: str):
    if backend == "cupy":
        import cupy
        return cupy.asarray, cupy.asnumpy
    return (lambda x: x), np.asarray


def _summary(spec, size, layout, causal, window, backward, backend, passes, every, path):
    walls, rings, computes, waits, reads, writes = (np.array(col) for col in zip(*every))
    wall = float(walls.max())
    flops = flop_count(spec, causal, backward)
    mask = "causal" if causal else "full"
    if window is not None:
        mask += f" window {window}"
    io_s = float(reads.max() + writes.max())
    spread = (rings.max() - rings.min()) / rings.max() * 100 if rings.max() > 0 else 0.0
    lines = [
        f"ringmpi run: N={spec.n_q}" + (f" N_kv={spec.n_kv}" if spec.n_kv != spec.n_q else "")
        + f" B={spec.batch} H={spec.heads} H_kv={spec.kv_heads} D={spec.dim} {spec.dtype}, "
        f"P={size}, layout {layout}, {mask}, {'forward+backward' if backward else 'forward'}, "
        f"backend {backend}, {len(passes)} pass(es)",
        f"  time: {wall:.3f} s wall; {flops / wall / 1e12:.4f} TFLOP/s overall "
        f"({flops:.3g} FLOP, FlashAttention count)",
        f"  ring per rank: max {rings.max():.3f} s, min {rings.min():.3f} s (spread {spread:.1f}%); "
        f"compute max {computes.max():.3f} s, ring wait max {waits.max():.3f} s; "
        f"{flops / rings.max() / 1e12:.4f} TFLOP/s in the ring" if rings.max() > 0 else "  ring: no time",
        f"  HDF5 (max over ranks): read {reads.max():.3f} s, write {writes.max():.3f} s "
        f"= {io_s / wall * 100:.1f}% of wall",
        f"  output: {path}",
    ]
    click.echo("\n".join(lines))
