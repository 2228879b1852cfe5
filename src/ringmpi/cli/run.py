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

import click
import numpy as np

from .. import __version__
from ..flops import attention_flops
from ..layout import KINDS
from ..passes import DEFAULT_PASS_BYTES, Pass, pass_boxes, plan_passes

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

    def skip(self, what: str, steps: int) -> None:
        """Count ``steps`` units that need no work (finished before a ``--resume``)."""
        self.done += steps
        if self.bar is not None:
            self.bar.update(steps)
        elif self.rank == 0:
            click.echo(f"[ringmpi] {self.done}/{self.total} {what}", err=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)
            self.bar = None


def _resolve_backend(name: str, comm):
    from ..backends import gpu_available
    from ..errors import agree

    if name == "auto":
        name = "cupy" if gpu_available() else "numpy"
        names = comm.allgather(name)
        agree(comm, None if len(set(names)) == 1 else
              "backend auto: some ranks see a GPU and some do not; pass --backend numpy or cupy")
    if name == "cupy":
        from ..device import require_gpu, select_device
        require_gpu(comm)  # the same ConfigError (exit 2) on every rank before any data moves
        select_device(comm)
    return name


def _read_segments(fin, name, shard_io, p: Pass):
    dset = fin[name]
    if dset.ndim == 2:
        ids = shard_io.read(dset, 1, [(p.b0, p.b1), (0, 0)])
    else:
        ids = np.broadcast_to(shard_io.read(dset, 0, [(0, 0)]), (p.b1 - p.b0, len(shard_io.indices)))
    return np.ascontiguousarray(ids, dtype=np.int64)


def _window_attr(window):
    return np.array([-1 if w is None else int(w) for w in window], dtype=np.int64)


def _create_outputs(fout, spec, backward: bool, attrs: dict):
    from ..io import create_float_dataset

    lse_dtype = np.float64 if spec.dtype == "float64" else np.float32
    q_shape, kv_shape = spec.shapes["q"], spec.shapes["k"]
    o_shape, v_shape = q_shape[:-1] + (spec.dim_v,), spec.shapes["v"]
    lse_shape = (spec.batch, spec.heads, spec.n_q) if spec.rank4 else (spec.heads, spec.n_q)
    names = [("o", o_shape, spec.dtype), ("lse", lse_shape, lse_dtype)]
    if backward:
        names += [("dq", q_shape, spec.dtype), ("dk", kv_shape, spec.dtype), ("dv", v_shape, spec.dtype)]
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
@click.option("--check-finite/--no-check-finite", default=True, show_default=True,
              help="Reject NaN/Inf inputs (exit 2), naming dataset and global index; "
                   "without the check they propagate as documented.")
@click.option("--resume", is_flag=True,
              help="Continue an interrupted job from its partial output (same input and options).")
@click.option("--timeout", type=float, default=600.0, show_default=True,
              help="Deadline in seconds for each ring wait; a peer that never answers ends the job.")
@click.option("--heads-per-pass", type=int, default=None, metavar="K",
              help="Query heads per pass (a multiple of H/H_kv) to bound memory [default: all].")
@click.option("--head-parallel", "head_parallel", default=None, metavar="U|auto",
              help="Two-level head x ring schedule: all-to-all over heads in groups of U ranks, ring "
                   "across groups; auto = the ranks of a node [default: RINGMPI_HEAD_PARALLEL, else 1].")
@click.option("--sinks-dataset", default=None, metavar="NAME",
              help="Attention sinks: the (H,) float32/float64 dataset NAME of the input (one logit per "
                   "query head); writes sinks and, with --backward, dsinks.")
@click.option("--softcap", type=float, default=None, metavar="C",
              help="Logit softcap: scores become C * tanh(score / C) (C > 0).")
@click.option("--max-logit", "max_logit", is_flag=True,
              help="Also write max_logit (H,): each head's largest score over the whole input.")
@click.option("--dropout", "dropout_p", type=float, default=0.0, show_default=True, metavar="P",
              help="Dropout on the attention weights, 0 <= P < 1: the same mask for any number of "
                   "ranks, layout, pass plan or backend (needs --seed).")
@click.option("--seed", "dropout_seed", type=click.IntRange(0, 2 ** 64 - 1), default=None, metavar="S",
              help="Dropout seed (0 <= S < 2^64).")
def run(input_path, output_path, causal, window, layout, backward, scale, backend, overwrite,
        check_finite, resume, timeout, heads_per_pass, head_parallel, sinks_dataset, softcap, max_logit,
        dropout_p, dropout_seed):
    """Attention over an HDF5 file: each rank reads its shard, runs the ring, writes its outputs.

    \b
    Input datasets: q (B,N,H,D) or (N,H,D); k, v (B,N_kv,H_kv,D); optional do,
    segment_ids / segment_ids_q + segment_ids_kv.  Outputs: o, lse (B,H,N) and,
    with --backward, dq, dk, dv.  See docs/file-format.md.
    \b
      mpirun -n 4 ringmpi run in.h5 -o out.h5 --causal --backward
      mpirun -n 4 ringmpi run in.h5 -o out.h5 --sinks-dataset sinks --softcap 30 --max-logit
    """
    from mpi4py import MPI

    from ..errors import ConfigError, agree
    from ..faults import fault_point
    from .. import head_outputs
    from ..options import softcap_problem
    from ..io import AtomicOutput, ShardIO, inspect_input, open_file
    from .. import resume as resume_log
    from ..layout import Layout
    from .. import ring_attention, ring_attention_backward

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
    if softcap_problem(softcap):
        raise ConfigError(f"--softcap: {softcap_problem(softcap)}")
    dropout_options = _dropout_options(dropout_p, dropout_seed)

    spec = inspect_input(input_path, comm, backward=backward)
    if heads_per_pass is not None and (heads_per_pass < 1 or heads_per_pass % spec.group != 0):
        raise ConfigError(f"--heads-per-pass {heads_per_pass}: must be a positive multiple of "
                          f"H/H_kv = {spec.heads}/{spec.kv_heads} = {spec.group} (GQA groups stay whole)")
    backend = _resolve_backend(backend, comm)
    out = AtomicOutput(output_path, comm, overwrite=overwrite, input_path=input_path, resumable=True)
    budget = int(os.environ.get("RINGMPI_PASS_BYTES", DEFAULT_PASS_BYTES))
    passes = plan_passes(spec, size, heads_per_pass, budget)
    job = _job_record(spec, input_path, size, passes, layout=layout, causal=bool(causal),
                      window=None if win is None else list(win), backward=bool(backward),
                      softmax_scale=scale, backend=backend, heads_per_pass=heads_per_pass,
                      **_variant_options(sinks_dataset, softcap, max_logit), **dropout_options)
    passes, done = _resume_state(out, comm, job, resume)
    head_parallel = _head_parallel(comm, head_parallel, spec, passes)
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
        "softcap": 0.0 if softcap is None else float(softcap), "sinks_dataset": sinks_dataset or "",
        "max_logit": bool(max_logit),
    }
    if dropout_options:
        attrs.update(dropout_p=float(dropout_p), dropout_seed=np.uint64(dropout_seed))
    to_device, to_host = _converters(backend)
    kw = dict(comm=comm, layout=layout, causal=causal, window=win, softmax_scale=softmax_scale,
              backend=backend, timeout=timeout, head_parallel=head_parallel)
    ring_s, compute_s, wait_s = 0.0, 0.0, 0.0
    progress = _Progress(rank, len(passes) * (2 if backward else 1), "ring passes")
    fin = open_file(input_path, "r", comm)
    try:
        if check_finite:  # every input of every pass, before any compute
            _check_finite(comm, input_path, fin, spec, passes, io_q, io_kv, backward)
        sinks = None if sinks_dataset is None else head_outputs.read_sinks(fin, sinks_dataset, spec.heads, comm)
        fout = out.open(resume=done is not None)
        if done is None:
            _create_outputs(fout, spec, backward, attrs)
            head_outputs.create(fout, spec, sinks, max_logit, backward and sinks is not None)
            resume_log.start(fout, job)
            done = np.zeros(len(passes), dtype=np.uint8)
        for index, p in enumerate(passes):
            if done[index]:
                progress.skip(f"batch {p.b0}:{p.b1} kv heads {p.g0}:{p.g1} done before (--resume)",
                              2 if backward else 1)
                continue
            fault_point("pass", rank, index)
            boxes = pass_boxes(spec, p)
            ax_q, box_q = boxes["q"]
            ax_kv, box_kv = boxes["kv"]
            ax_lse, box_lse = boxes["lse"]
            ax_o, box_o = boxes["o"]   # o, do: D_v wide
            ax_v, box_v = boxes["v"]   # v, dv: D_v wide
            lift = (lambda x: x) if spec.rank4 else (lambda x: x[None])
            drop = (lambda x: x) if spec.rank4 else (lambda x: x[0])
            q = lift(io_q.read(fin["q"], ax_q, box_q))
            k = lift(io_kv.read(fin["k"], ax_kv, box_kv))
            v = lift(io_kv.read(fin["v"], ax_v, box_v))
            seg = {}
            if spec.seg_q:
                seg = dict(segment_ids_q=_read_segments(fin, spec.seg_q, io_q, p),
                           segment_ids_kv=_read_segments(fin, spec.seg_kv, io_kv, p))
            if sinks is not None:
                seg["sinks"] = to_device(sinks[p.g0 * spec.group:p.g1 * spec.group])
            if softcap is not None:
                seg["softcap"] = softcap
            if dropout_options:  # this pass draws its slice of the whole tensor's mask
                seg.update(dropout_offsets=(p.b0, p.g0 * spec.group, spec.heads), **dropout_options)
            stats: list = []
            t0 = time.perf_counter()
            qd, kd, vd = to_device(q), to_device(k), to_device(v)
            o, lse, *pass_max = ring_attention(qd, kd, vd, stats=stats, return_max_logit=max_logit, **kw, **seg)
            head_outputs.write_pass(fout, p, spec.group, max_logit=pass_max[0] if max_logit else None)
            ring_s += time.perf_counter() - t0
            o_host, lse_host = to_host(o), to_host(lse)
            io_q.write(fout["o"], ax_o, drop(o_host), box_o)
            io_q.write(fout["lse"], ax_lse, drop(lse_host), box_lse)
            progress.advance(f"forward batch {p.b0}:{p.b1} kv heads {p.g0}:{p.g1} "
                             f"({time.perf_counter() - t0:.2f} s)")
            if backward:
                do = lift(io_q.read(fin["do"], ax_o, box_o))
                t0 = time.perf_counter()
                dq, dk, dv, *dsinks = ring_attention_backward(to_device(do), qd, kd, vd, o, lse, stats=stats,
                                                              **kw, **seg)
                head_outputs.write_pass(fout, p, spec.group, dsinks=dsinks[0] if dsinks else None)
                ring_s += time.perf_counter() - t0
                io_q.write(fout["dq"], ax_q, drop(to_host(dq)), box_q)
                io_kv.write(fout["dk"], ax_kv, drop(to_host(dk)), box_kv)
                io_kv.write(fout["dv"], ax_v, drop(to_host(dv)), box_v)
                progress.advance(f"backward batch {p.b0}:{p.b1} kv heads {p.g0}:{p.g1} "
                                 f"({time.perf_counter() - t0:.2f} s)")
            compute_s += sum(r.compute_s for r in stats)
            wait_s += sum(r.wait_s for r in stats)
            resume_log.mark_done(fout, index)
            out.keep_on_failure = True  # from now on a failure leaves a resumable partial file
        progress.close()
        head_outputs.finish(fout)
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
        if head_parallel > 1:
            click.echo(f"  schedule: head x ring, {head_parallel} ranks per group (all-to-all), "
                       f"ring of {size // head_parallel} groups")
    comm.Free()


def _head_parallel(comm, value, spec, passes) -> int:
    """``U`` of ``--head-parallel`` (or ``RINGMPI_HEAD_PARALLEL``), resolved once for every pass;
    exit 2 on every rank when it cannot run.  ``auto``: the largest divisor of the node's
    rank count and of every pass's head count.  Collective unless ``U = 1``."""
    from ..errors import agree
    from ..topology import (auto_head_parallel, head_parallel_problem, head_parallel_setting,
                            node_ids, node_size_override)

    try:
        setting = head_parallel_setting(value)
        if setting != 1:
            node_size_override()
    except ValueError as exc:
        setting, problem = 1, f"--head-parallel: {exc}"
    else:
        problem = None
    agree(comm, problem)
    if setting == 1:
        return 1
    pass_heads = sorted({(p.g1 - p.g0) * spec.group for p in passes})
    if setting == "auto":
        return auto_head_parallel(node_ids(comm), math.gcd(*pass_heads))
    problem = head_parallel_problem(setting, comm.Get_size(), spec.heads)
    if problem is None and any(h % setting for h in pass_heads):
        problem = (f"head_parallel={setting} must divide the query heads of every pass "
                   f"({', '.join(map(str, pass_heads))}); choose --heads-per-pass accordingly")
    agree(comm, None if problem is None else f"--head-parallel: {problem}")
    return setting


def _dropout_options(p: float, seed) -> dict:
    """``{dropout_p, dropout_seed}`` for the ring calls (empty without dropout);
    a bad pair is a ConfigError (exit 2)."""
    from ..dropout import validate
    from ..errors import ConfigError

    problem = validate(p, seed)
    if problem:
        raise ConfigError(problem.replace("dropout_p", "--dropout").replace("a dropout_seed", "--seed")
                          .replace("dropout_seed", "--seed"))
    return dict(dropout_p=float(p), dropout_seed=int(seed)) if p > 0 else {}


def _job_record(spec, input_path, world_size, passes, **options):
    """The :class:`ringmpi.resume.JobRecord` of this run (options: what changes the numbers)."""
    from ..resume import JobRecord, input_fingerprint

    return JobRecord(version=__version__, world_size=world_size, options=options,
                     input=input_fingerprint(input_path, spec),
                     passes=[[p.b0, p.b1, p.g0, p.g1] for p in passes])


def _variant_options(sinks_dataset, softcap, max_logit) -> dict:
    """The job-record options of sinks/softcap/max logit; none when unused, so the record of
    a job without them is unchanged."""
    options = dict(sinks_dataset=sinks_dataset, softcap=softcap, max_logit=bool(max_logit) or None)
    return {k: v for k, v in options.items() if v is not None}


def _resume_state(out, comm, job, resume: bool):
    """``(passes, done marks)`` to run: the stored plan and marks with ``--resume`` and a
    matching partial file, else this run's plan and None (start afresh).  Collective."""
    from ..errors import agree
    from ..resume import check_resume

    if not resume:
        return [Pass(*p) for p in job.passes], None
    stored = done = problem = None
    if comm.Get_rank() == 0:
        stored, done, problem = check_resume(out.tmp, job)
    stored, done, problem = comm.bcast((stored, done, problem), root=0)
    agree(comm, problem)
    if stored is None:
        if comm.Get_rank() == 0:
            click.echo(f"[ringmpi] --resume: no partial output at {out.tmp}; starting from the beginning",
                       err=True)
        return [Pass(*p) for p in job.passes], None
    if comm.Get_rank() == 0:
        click.echo(f"[ringmpi] --resume: {int(done.sum())} of {len(done)} pass(es) already complete "
                   f"(written with {stored.world_size} rank(s))", err=True)
    return [Pass(*p) for p in stored.passes], done


def _check_finite(comm, input_path, fin, spec, passes, io_q, io_kv, backward: bool) -> None:
    """Exit-2 error on every rank naming the first NaN/Inf (lowest global index) of q, k, v
    (and do), read pass by pass before any compute.  Collective: every rank reads every
    pass's shards, one pass at a time."""
    from ..errors import agree
    from ..io import first_nonfinite

    names = ("q", "k", "v") + (("do",) if backward else ())
    found = None
    for p in passes:
        for name in names:
            shard_io = io_kv if name in ("k", "v") else io_q
            axis, box = pass_boxes(spec, p)[{"k": "kv", "v": "v", "do": "o"}.get(name, "q")]
            data = shard_io.read(fin[name], axis, box)
            if found is not None:
                continue  # keep joining the collective reads
            data = data if spec.rank4 else data[None]
            hit = first_nonfinite(data, shard_io.indices, box if spec.rank4 else [(0, 1)] + list(box))
            if hit is not None:
                found = (name, hit)
    every = [f for f in comm.allgather(found) if f is not None]
    if not every:
        return
    order = {"q": 0, "k": 1, "v": 2, "do": 3}
    name, (index, value) = min(every, key=lambda f: (order[f[0]], f[1][0]))
    shown = list(index) if spec.rank4 else list(index[1:])
    agree(comm, f"{input_path}: dataset {name} has a non-finite value ({value}) at global index "
                f"{shown} ({'b, token, head, dim' if spec.rank4 else 'token, head, dim'}); "
                f"fix the input or pass --no-check-finite")


def _converters(backend: str):
    if backend == "cupy":
        import cupy
        return cupy.asarray, cupy.asnumpy
    return (lambda x: x), np.asarray


def _summary(spec, size, layout, causal, window, backward, backend, passes, every, path):
    walls, rings, computes, waits, reads, writes = (np.array(col) for col in zip(*every))
    wall = float(walls.max())
    flops = attention_flops(spec.batch, spec.heads, spec.n_q, spec.n_kv, spec.dim, causal,
                            "forward+backward" if backward else "forward", dim_v=spec.dim_v)
    mask = "causal" if causal else "full"
    if window is not None:
        mask += f" window {window}"
    io_s = float(reads.max() + writes.max())
    spread = (rings.max() - rings.min()) / rings.max() * 100 if rings.max() > 0 else 0.0
    lines = [
        f"ringmpi run: N={spec.n_q}" + (f" N_kv={spec.n_kv}" if spec.n_kv != spec.n_q else "")
        + f" B={spec.batch} H={spec.heads} H_kv={spec.kv_heads} D={spec.dim}"
        + (f" D_v={spec.dim_v}" if spec.dim_v != spec.dim else "") + f" {spec.dtype}, "
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
