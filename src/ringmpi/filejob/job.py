"""The file job of ``ringmpi run``: attention over an HDF5 file, pass by pass, resumable.

Every rank reads its own shard of ``q``, ``k``, ``v`` (and ``do``), runs the
ring, and writes its shard of ``o``, ``lse`` (and ``dq``, ``dk``, ``dv``) into
one output file, written atomically (:class:`ringmpi.filejob.hdf5.AtomicOutput`).
Batch entries and head groups are processed in passes
(:func:`ringmpi.filejob.pass_plan.plan_passes`) so a rank holds one pass's shard at a
time; after each pass its outputs are flushed and the pass is marked done
(:mod:`ringmpi.filejob.resume`), so an interrupted job continues with ``resume``.
The root attributes of the output say how it was computed
(:class:`OutputAttributes`, written here and read back by ``ringmpi verify``).

:func:`run_job` is the whole job (collective over ``COMM_WORLD``); the
command line only parses its options into a :class:`JobOptions` and reports.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field, replace
from typing import List, Optional, Tuple, Union

import numpy as np

from .. import __version__
from ..core.masks import window_of
from ..runtime import env
from ..runtime.errors import ConfigError, agree
from ..options import AttentionOptions
from .attributes import OutputAttributes
from .pass_plan import DEFAULT_PASS_BYTES, Pass, pass_boxes, plan_passes


def _flag_message(option: str, message: str, attention: AttentionOptions) -> str:
    """``message`` of :meth:`AttentionOptions.field_problem` in the command line's words."""
    if option == "window":
        sides = " ".join(str(w) for w in window_of(attention.window))
        return f"--window sides must be >= 0 (or -1 for unbounded), got {sides}"
    if option == "softmax_scale":
        return f"--scale must be a positive finite number, got {attention.softmax_scale}"
    if option == "timeout":
        return f"--timeout must be positive, got {attention.timeout}"
    if option == "dropout":
        return message.replace("dropout_p", "--dropout").replace("a dropout_seed", "--seed") \
            .replace("dropout_seed", "--seed")
    return f"--{option.replace('_', '-')}: {message}"


@dataclass(frozen=True)
class JobOptions:
    """What a file job is asked to do: the attention options (one
    :class:`~ringmpi.options.AttentionOptions`, which checks them) and the job's own;
    :meth:`check` raises the ConfigError (exit 2) of a bad value.

    ``attention.window`` has None for an unbounded side (``--window`` gives -1:
    :func:`ringmpi.core.masks.window_sides`);
    ``attention.softmax_scale`` None means ``1/sqrt(D)``;
    ``attention.head_parallel`` is ``U``, ``"auto"`` or None
    (``RINGMPI_HEAD_PARALLEL``, else 1); ``attention.check_finite`` checks the
    input file pass by pass before any compute (the ring calls then skip it);
    ``attention.alibi_slopes`` is the ``(H,)`` float32 host array.  ``layout``
    None means zigzag when causal, else contiguous; ``"balanced"`` places the
    documents of the segment-id dataset (:func:`ringmpi.filejob.hdf5.document_lengths`)
    with balanced work, K/V moving by the routed schedule unless ``attention.schedule``
    says otherwise.
    """

    attention: AttentionOptions = AttentionOptions(check_finite=True, timeout=600.0)
    layout: Optional[str] = None
    backward: bool = False
    backend: str = "auto"
    heads_per_pass: Optional[int] = None
    sinks_dataset: Optional[str] = None

    @classmethod
    def of_flags(cls, *, layout=None, backward=False, backend="auto", heads_per_pass=None, sinks_dataset=None,
                 timeout=600.0, check_finite=True, **attention) -> "JobOptions":
        """The options of ``ringmpi run``'s flags: the job's own and ``attention``, fields of the
        options object under their names, as the flags give them (``ringmpi.cli.flags``: a new
        option needs no line here); the file job's defaults: ``timeout`` 600 s, ``check_finite``."""
        options = AttentionOptions(timeout=timeout, check_finite=check_finite, **attention)
        return cls(attention=options, layout=layout, backward=backward, backend=backend,
                   heads_per_pass=heads_per_pass, sinks_dataset=sinks_dataset)

    def check(self, heads: Optional[int] = None) -> None:
        """Raise the ConfigError of the first bad option (the same on every rank: no collective);
        ``heads`` None: before the input is read (the per-head options wait for its head count)."""
        a = self.attention
        if a.softmax_scale is not None and not a.softmax_scale > 0:  # the command line's own rule
            raise ConfigError(_flag_message("softmax_scale", "", a))
        found = a.field_problem(heads)
        if found is not None:
            raise ConfigError(_flag_message(*found, a))

    @property
    def layout_name(self) -> str:
        return self.layout or ("zigzag" if self.attention.causal else "contiguous")

    def record_options(self, backend: str) -> dict:
        """The options of the job record (what changes the numbers); sinks, softcap, max logit,
        dropout, the score modifiers and invariant only when used, so the record of a job without
        them is unchanged."""
        a = self.attention
        variants = dict(sinks_dataset=self.sinks_dataset, softcap=a.softcap,
                        max_logit=bool(a.return_max_logit) or None, invariant=bool(a.invariant) or None,
                        **{name: [float(x) for x in getattr(a, name)] for name in a.modifier_names()})
        key = a.dropout_key(1)
        dropout = {} if key is None else dict(dropout_p=key[0], dropout_seed=key[1])
        if a.schedule is not None:
            dropout["schedule"] = a.schedule
        return dict(layout=self.layout_name, causal=bool(a.causal),
                    window=None if a.window is None else list(a.window), backward=bool(self.backward),
                    softmax_scale=a.softmax_scale, backend=backend, heads_per_pass=self.heads_per_pass,
                    **{k: v for k, v in variants.items() if v is not None}, **dropout)

    def pass_options(self, spec, p: Pass, head_parallel: Union[int, str], sinks) -> AttentionOptions:
        """The ring calls' options for pass ``p``: the scale resolved, ``U``, this pass's
        heads of the per-head options, its slice of the dropout mask; no finiteness check
        (the job checked the file)."""
        a, heads = self.attention, slice(p.g0 * spec.group, p.g1 * spec.group)
        return replace(a.for_heads(heads.start, heads.stop - heads.start), softmax_scale=a.scale(spec.dim), head_parallel=head_parallel,
                       check_finite=False, sinks=sinks,
                       dropout_offsets=(p.b0, heads.start, spec.heads) if a.dropout_key(1) else None)


@dataclass
class JobResult:
    """What the command line reports: the problem, the plan and, on rank 0, every rank's
    ``(wall, ring, compute, wait, read, write)`` seconds (None on the other ranks).
    ``head_parallel`` is the ``U`` the passes ran with (under ``"auto"``: the one the ring calls
    chose most); ``head_parallel_auto``: ``"auto"`` (the option or ``RINGMPI_HEAD_PARALLEL``)
    chose it.  ``traffic`` (rank 0): every rank's ``(bytes received by its ring calls, the
    schedules they ran)``.  ``choice``: where ``schedule="auto"`` or ``head_parallel="auto"``
    chose, ``(the choice, its predicted seconds summed over the ring calls, the runner-up, its
    predicted seconds summed)``, choice and runner-up the most frequent."""

    spec: object
    options: JobOptions
    world_size: int
    backend: str
    passes: List[Pass]
    head_parallel: int
    path: str
    every: Optional[list]
    head_parallel_auto: bool = False
    traffic: Optional[list] = None
    choice: Optional[tuple] = None  # auto (issue 53): (chosen, predicted s, runner-up, its s), summed


@dataclass
class _Timers:
    ring_s: float = 0.0
    compute_s: float = 0.0
    wait_s: float = 0.0
    bytes_recv: int = 0
    schedules: set = field(default_factory=set)
    choices: list = field(default_factory=list)  # (chosen, predicted s, runner-up, its s) of each auto choice
    head_parallels: list = field(default_factory=list)  # the U of each ring call

    def choice(self) -> Optional[tuple]:
        if not self.choices:
            return None
        return (_most([c[0] for c in self.choices if c[0]]), sum(c[1] for c in self.choices),
                _most([c[2] for c in self.choices if c[2]]), sum(c[3] or 0.0 for c in self.choices))

    @property
    def head_parallel(self) -> int:
        return _most(self.head_parallels) or 1


def _most(values):
    """The most frequent of ``values`` (the first seen on a tie), or None."""
    return max(values, key=values.count) if values else None


def run_job(input_path: str, output_path: str, options: JobOptions, progress, overwrite: bool = False,
            resume: bool = False) -> JobResult:
    """Run the file job (collective over ``COMM_WORLD``) and return its :class:`JobResult`.

    ``progress`` reports (:class:`ringmpi.cli.progress.Progress`): ``note(text)`` (rank 0's
    messages), ``start(flops, units)`` (the work of the passes to run, their forwards and
    backwards), ``begin(what, flops)`` (a ring call starts), ``advance(what, units=1)`` (a
    pass's forward or backward done, or skipped after ``resume``) and ``close()``.  Bad input or options raise the same
    ConfigError on every rank, leaving no file at ``output_path``.
    """
    from ..parallel.comm import dup_world
    from ..runtime import watchdog
    from .hdf5 import AtomicOutput, inspect_input

    t_start = time.perf_counter()
    comm = dup_world()
    options.check()
    watchdog.set_default(options.attention.timeout)  # every blocking phase of the job, not only the ring's waits
    spec = inspect_input(input_path, comm, backward=options.backward)
    options.check(spec.heads)
    if options.heads_per_pass is not None and (options.heads_per_pass < 1 or options.heads_per_pass % spec.group):
        raise ConfigError(f"--heads-per-pass {options.heads_per_pass}: must be a positive multiple of "
                          f"H/H_kv = {spec.heads}/{spec.kv_heads} = {spec.group} (GQA groups stay whole)")
    backend = _resolve_backend(options.backend, comm)
    budget = env.pass_bytes(DEFAULT_PASS_BYTES)
    plan = plan_passes(spec, comm.Get_size(), options.heads_per_pass, budget)
    _agree_memory(comm, spec, options, backend)
    out = AtomicOutput(output_path, comm, overwrite=overwrite, input_path=input_path, resumable=True)
    record = _job_record(spec, input_path, comm.Get_size(), plan, options.record_options(backend))
    passes, done = _resume_state(out, comm, record, resume, progress)
    requested = options.attention.head_parallel or env.head_parallel()
    head_parallel = _head_parallel(comm, requested, spec, passes)
    layouts = _layouts(comm, options, spec)
    job = _Job(comm, input_path, options, spec, passes, backend, head_parallel, layouts)
    phases = ("forward", "backward") if options.backward else ("forward",)
    progress.start(sum(pass_flops(spec, p, options.attention.causal, ph) for i, p in enumerate(passes)
                       for ph in phases if done is None or not done[i]), len(passes) * len(phases))
    job.run(out, done, record, OutputAttributes.of_job(options, spec, input_path, comm.Get_size(), backend),
            progress)
    mine = (time.perf_counter() - t_start, job.timers.ring_s, job.timers.compute_s, job.timers.wait_s,
            job.io_q.read_s + job.io_kv.read_s, job.io_q.write_s + job.io_kv.write_s)
    with watchdog.phase("gathering the ranks' timings and traffic (gather)"):
        every = comm.gather(mine, root=0)
        traffic = comm.gather((job.timers.bytes_recv, sorted(job.timers.schedules)), root=0)
    comm.Free()
    ran = job.timers.head_parallel if head_parallel == "auto" else head_parallel
    return JobResult(spec, options, job.size, backend, passes, ran, out.path, every,
                     head_parallel_auto=head_parallel == "auto", traffic=traffic, choice=job.timers.choice())


def _agree_memory(comm, spec, options: JobOptions, backend: str) -> None:
    """A ConfigError on every rank, before any file is made, when one pass's shards (one batch
    entry, the pass's heads) exceed a rank's memory budget (:mod:`ringmpi.runtime.memory`):
    the job would otherwise end in a MemoryError mid-way."""
    from ..runtime.errors import agree
    from ..runtime.memory import budget
    from .pass_plan import bytes_per_batch_entry

    kv_per = spec.kv_heads if options.heads_per_pass is None else max(1, options.heads_per_pass // spec.group)
    need = bytes_per_batch_entry(spec, comm.Get_size(), kv_per)
    have = budget(on_device=backend == "cupy")
    agree(comm, None if have is None or need <= have else
          f"one pass needs about {need / 2**30:.3g} GiB per rank (one batch entry, {kv_per * spec.group} heads, "
          f"{comm.Get_size()} ranks), beyond this rank's memory budget of {have / 2**30:.3g} GiB "
          f"(RINGMPI_MEMORY_BUDGET, else its share of the free memory): run on more ranks"
          + (" or with a smaller --heads-per-pass" if kv_per > 1 else ""))


def _layouts(comm, options: JobOptions, spec):
    """The job's ``(layout of q, layout of k/v)``: ``Layout`` objects (the balanced one from the
    input's documents; a ConfigError on every rank when it cannot place the input)."""
    from ..core.layout import Layout
    from .hdf5 import document_lengths

    size, name = comm.Get_size(), options.layout_name
    if name != "balanced":
        return Layout(name, spec.n_q, size), Layout(name, spec.n_kv, size)
    agree(comm, None if spec.n_q == spec.n_kv else
          f"--layout balanced places one sequence: q and k/v must have the same length, got N={spec.n_q}, "
          f"N_kv={spec.n_kv}")
    a = options.attention
    layout = Layout("balanced", spec.n_q, size, documents=document_lengths(spec, comm), causal=bool(a.causal),
                    window=a.window)
    return layout, layout


class _Job:
    """One run's plan, shard readers, converters and timers; :meth:`run` does the passes."""

    def __init__(self, comm, input_path, options: JobOptions, spec, passes, backend: str, head_parallel: Union[int, str],
                 layouts):
        from .hdf5 import ShardIO

        self.comm, self.input_path, self.options, self.spec, self.passes = comm, input_path, options, spec, passes
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        layout_q, layout_kv = layouts
        self.io_q = ShardIO(comm, layout_q.indices(self.rank))
        self.io_kv = ShardIO(comm, layout_kv.indices(self.rank))
        self.to_device, self.to_host = _converters(backend)
        # a balanced layout goes to the calls as the object (its documents); the others by name
        self.ring_kw = dict(comm=comm, layout=layout_q if layout_q.kind == "balanced" else layout_q.kind,
                            backend=backend)
        self.head_parallel = head_parallel
        self.timers = _Timers()
        self.sinks = None

    def run(self, out, done, record, attributes: OutputAttributes, progress) -> None:
        """Every pass not ``done`` (None: a fresh output), then commit the output (collective)."""
        from . import head_datasets
        from . import resume as resume_log
        from ..runtime.faults import fault_point
        from .hdf5 import close_file, open_file

        o = self.options
        fin = open_file(self.input_path, "r", self.comm)
        try:
            if o.attention.check_finite:  # every input of every pass, before any compute
                _check_finite(self.comm, self.input_path, fin, self.spec, self.passes, self.io_q, self.io_kv,
                              o.backward)
            if o.sinks_dataset is not None:
                self.sinks = head_datasets.read_sinks(fin, o.sinks_dataset, self.spec.heads, self.comm)
            fault_point("create", self.rank)
            fout = out.open(resume=done is not None)
            if done is None:
                _create_outputs(fout, self.spec, o.backward)
                attributes.write(fout)
                head_datasets.create(fout, self.spec, self.sinks, o.attention.return_max_logit,
                                    o.backward and self.sinks is not None)
                resume_log.start(fout, record, self.comm)
                done = np.zeros(len(self.passes), dtype=np.uint8)
            for index, p in enumerate(self.passes):
                if done[index]:
                    progress.advance(f"batch {p.b0}:{p.b1} kv heads {p.g0}:{p.g1} done before (--resume)",
                                     2 if o.backward else 1)
                    continue
                fault_point("pass", self.rank, index)
                self.run_pass(fin, fout, p, progress)
                resume_log.mark_done(fout, index, self.comm)
                out.keep_on_failure = True  # from now on a failure leaves a resumable partial file
            progress.close()
            head_datasets.finish(fout, self.comm)
            fault_point("write", self.rank)
            close_file(fin, self.comm)
            out.commit()
        except ConfigError:
            progress.close()
            fin.close()
            out.discard(collective=True)
            raise
        except BaseException:
            out.discard(collective=False)  # this rank alone: the job is about to be aborted
            raise

    def run_pass(self, fin, fout, p: Pass, progress) -> None:
        """Read one pass's shards, run the forward (and backward) ring, write its outputs."""
        from . import head_datasets
        from ..attention import backward as ring_backward, forward as ring_forward

        spec, o, boxes = self.spec, self.options, pass_boxes(self.spec, p)
        lift = (lambda x: x) if spec.rank4 else (lambda x: x[None])
        drop = (lambda x: x) if spec.rank4 else (lambda x: x[0])

        def read(name, io, box):
            return lift(io.read(fin[name], *boxes[box]))

        def write(name, io, box, data):
            axis, where = boxes[box]
            io.write(fout[name], axis, drop(self.to_host(data)), where)

        # boxes "q"/"kv": D wide (q, dq / k, dk); "o"/"v": D_v wide (o, do / v, dv)
        q, k, v = read("q", self.io_q, "q"), read("k", self.io_kv, "kv"), read("v", self.io_kv, "v")
        segments = self.pass_segments(fin, p)
        sinks = None if self.sinks is None else self.to_device(self.sinks[p.g0 * spec.group:p.g1 * spec.group])
        options = o.pass_options(spec, p, self.head_parallel, sinks)
        max_logit = options.return_max_logit
        stats: list = []
        t0 = time.perf_counter()
        qd, kd, vd = self.to_device(q), self.to_device(k), self.to_device(v)
        progress.begin(f"forward batch {p.b0}:{p.b1} kv heads {p.g0}:{p.g1}",
                       pass_flops(spec, p, o.attention.causal, "forward"))
        out, lse, pass_max = ring_forward(qd, kd, vd, options, stats=stats, **self.ring_kw, **segments)
        head_datasets.write_pass(fout, p, spec.group, max_logit=pass_max if max_logit else None)
        self.timers.ring_s += time.perf_counter() - t0
        write("o", self.io_q, "o", out)
        write("lse", self.io_q, "lse", lse)
        progress.advance(f"forward batch {p.b0}:{p.b1} kv heads {p.g0}:{p.g1} ({time.perf_counter() - t0:.2f} s)")
        if o.backward:
            do = read("do", self.io_q, "o")
            t0 = time.perf_counter()
            progress.begin(f"backward batch {p.b0}:{p.b1} kv heads {p.g0}:{p.g1}",
                           pass_flops(spec, p, o.attention.causal, "backward"))
            dq, dk, dv, dsinks = ring_backward(self.to_device(do), qd, kd, vd, out, lse,
                                               replace(options, return_max_logit=False), stats=stats,
                                               **self.ring_kw, **segments)
            head_datasets.write_pass(fout, p, spec.group, dsinks=dsinks)
            self.timers.ring_s += time.perf_counter() - t0
            write("dq", self.io_q, "q", dq)
            write("dk", self.io_kv, "kv", dk)
            write("dv", self.io_kv, "v", dv)
            progress.advance(f"backward batch {p.b0}:{p.b1} kv heads {p.g0}:{p.g1} "
                             f"({time.perf_counter() - t0:.2f} s)")
        self.timers.compute_s += sum(r.compute_s for r in stats)
        self.timers.wait_s += sum(r.wait_s for r in stats)
        self.timers.bytes_recv += sum(r.bytes_recv for r in stats)
        self.timers.schedules.update(r.schedule for r in stats if not hasattr(r, "stage"))
        self.timers.choices += [(r.chosen, r.predicted_s, r.runner_up, r.runner_up_s) for r in stats
                                if getattr(r, "predicted_s", None) is not None]
        self.timers.head_parallels.append(next((r.head_parallel for r in stats if hasattr(r, "stage")), 1))

    def pass_segments(self, fin, p: Pass) -> dict:
        """The ring calls' segment-id keywords of pass ``p`` (none without segments)."""
        if not self.spec.seg_q:
            return {}
        return dict(segment_ids_q=_read_segments(fin, self.spec.seg_q, self.io_q, p),
                    segment_ids_kv=_read_segments(fin, self.spec.seg_kv, self.io_kv, p))


def pass_flops(spec, p: Pass, causal: bool, phase: str) -> float:
    """FlashAttention's FLOP count of pass ``p``'s ``phase`` (``"forward"``, ``"backward"``)."""
    from ..core.flops import attention_flops

    return attention_flops(p.b1 - p.b0, (p.g1 - p.g0) * spec.group, spec.n_q, spec.n_kv, spec.dim, causal, phase,
                           dim_v=spec.dim_v)


def _resolve_backend(name: str, comm) -> str:
    """``numpy`` or ``cupy`` (``auto``: cupy when every rank sees a GPU); binds the GPU.  Collective."""
    from ..backends import gpu_available
    from ..runtime.watchdog import phase

    if name == "auto":
        name = "cupy" if gpu_available() else "numpy"
        with phase("the ranks' choice of backend (allgather)"):
            names = comm.allgather(name)
        agree(comm, None if len(set(names)) == 1 else
              "backend auto: some ranks see a GPU and some do not; pass --backend numpy or cupy")
    if name == "cupy":
        from ..runtime.device import require_gpu, select_device
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


def _create_outputs(fout, spec, backward: bool) -> None:
    """Create ``o``, ``lse`` (and ``dq``, ``dk``, ``dv``), unfilled (collective)."""
    from .hdf5 import create_float_dataset

    lse_dtype = np.float64 if spec.dtype == "float64" else np.float32
    q_shape, kv_shape = spec.shapes["q"], spec.shapes["k"]
    o_shape, v_shape = q_shape[:-1] + (spec.dim_v,), spec.shapes["v"]
    lse_shape = (spec.batch, spec.heads, spec.n_q) if spec.rank4 else (spec.heads, spec.n_q)
    names = [("o", o_shape, spec.dtype), ("lse", lse_shape, lse_dtype)]
    if backward:
        names += [("dq", q_shape, spec.dtype), ("dk", kv_shape, spec.dtype), ("dv", v_shape, spec.dtype)]
    for name, shape, dtype in names:  # collective: identical arguments on every rank
        create_float_dataset(fout, name, shape, dtype, fill_time="never")


def _head_parallel(comm, value, spec, passes) -> Union[int, str]:
    """``U`` of ``head_parallel`` (the option, else ``RINGMPI_HEAD_PARALLEL``), checked once for
    every pass: exit 2 on every rank when it cannot run.  ``"auto"`` stays ``"auto"``: each ring
    call chooses ``U`` with its schedule by predicted cost
    (:meth:`ringmpi.parallel.ring_passes.AgreedCall.choose_head_parallel`).  Collective unless ``U = 1``."""
    from ..parallel.topology import head_parallel_problem, head_parallel_setting, node_size_override

    try:
        setting = head_parallel_setting(value)
        if setting != 1:
            node_size_override()
    except ValueError as exc:
        setting, problem = 1, f"--head-parallel: {exc}"
    else:
        problem = None
    agree(comm, problem)
    if setting in (1, "auto"):
        return setting
    pass_heads = sorted({(p.g1 - p.g0) * spec.group for p in passes})
    problem = head_parallel_problem(setting, comm.Get_size(), spec.heads)
    if problem is None and any(h % setting for h in pass_heads):
        problem = (f"head_parallel={setting} must divide the query heads of every pass "
                   f"({', '.join(map(str, pass_heads))}); choose --heads-per-pass accordingly")
    agree(comm, None if problem is None else f"--head-parallel: {problem}")
    return setting


def _job_record(spec, input_path, world_size, passes, options: dict):
    """The :class:`ringmpi.filejob.resume.JobRecord` of this run (options: what changes the numbers)."""
    from .resume import JobRecord, input_fingerprint

    return JobRecord(version=__version__, world_size=world_size, options=options,
                     input=input_fingerprint(input_path, spec),
                     passes=[[p.b0, p.b1, p.g0, p.g1] for p in passes])


def _resume_state(out, comm, job, resume: bool, progress):
    """``(passes, done marks)`` to run: the stored plan and marks with ``resume`` and a
    matching partial file, else this run's plan and None (start afresh).  Collective."""
    from ..runtime.watchdog import phase
    from .resume import check_resume

    if not resume:
        return [Pass(*p) for p in job.passes], None
    stored = done = problem = None
    if comm.Get_rank() == 0:
        stored, done, problem = check_resume(out.tmp, job)
    with phase(f"sharing the resume record of {out.tmp} (bcast)"):
        stored, done, problem = comm.bcast((stored, done, problem), root=0)
    agree(comm, problem)
    if stored is None:
        progress.note(f"--resume: no partial output at {out.tmp}; starting from the beginning")
        return [Pass(*p) for p in job.passes], None
    progress.note(f"--resume: {int(done.sum())} of {len(done)} pass(es) already complete "
                  f"(written with {stored.world_size} rank(s))")
    return [Pass(*p) for p in stored.passes], done


def _check_finite(comm, input_path, fin, spec, passes, io_q, io_kv, backward: bool) -> None:
    """Exit-2 error on every rank naming the first NaN/Inf (lowest global index) of q, k, v
    (and do), read pass by pass before any compute.  Collective: every rank reads every
    pass's shards, one pass at a time."""
    from ..runtime.faults import fault_point
    from ..runtime.watchdog import phase
    from .hdf5 import first_nonfinite

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
    fault_point("finite", comm.Get_rank())
    with phase(f"the ranks' finiteness check of {input_path} (allgather)"):
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
    """``(to the backend's device, to the host)`` for a pass's arrays."""
    from ..core.host import to_host

    if backend == "cupy":
        import cupy
        return cupy.asarray, to_host
    return (lambda x: x), to_host
