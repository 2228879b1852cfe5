"""``ringmpi verify``: compare a result file with a float64 dense reference.

The reference is recomputed on one process, per batch entry, per head and per
block of query rows (memory ``O(rows_block * N_kv)``), once in float64 and once
naively in the input dtype (:mod:`ringmpi.core.dense_reference`); the tolerance rule of
docs/design.md then bounds every output:
``max err <= 2 x naive err + 1e-6`` for ``o``/``lse`` and ``3 x naive err +
1e-5`` for ``dq``/``dk``/``dv``.
"""

from __future__ import annotations

import math
import sys
from typing import Dict

import click
import numpy as np

from ..filejob.job import OutputAttributes
from ..core.dense_reference import GRADIENTS, DenseReference, max_err, tolerance


PER_HEAD = ("max_logit", "dsinks")  # (H,) datasets of --max-logit and --sinks-dataset


def _check(in_path: str, out_path: str, max_n: int):
    """Rank 0's work: ``(exit status, report text)``; raises ConfigError for unusable files."""
    spec, attrs, sinks, inputs, ours, segs = _read(in_path, out_path, max_n)
    mask, scale = attrs.score_spec(spec), attrs.attention.softmax_scale
    refs: Dict[str, list] = {name: [] for name in ours}
    naives: Dict[str, list] = {name: [] for name in ours}
    for b in range(spec.batch):
        args = [inputs["q"][b], inputs["k"][b], inputs["v"][b], inputs["do"][b] if "do" in inputs else None,
                None if segs[0] is None else segs[0][b], None if segs[1] is None else segs[1][b]]
        for dtype, into in ((np.float64, refs), (spec.dtype, naives)):
            result = DenseReference(mask, scale, dtype, sinks=sinks).compute(*args, batch_index=b)
            for name in ours:
                into[name].append(result[name])
    softcap, dropout, window = mask.softcap, mask.dropout, attrs.attention.window
    extras = (f", softcap {softcap:g}" if softcap else "") + (", sinks" if sinks is not None else "") \
        + "".join(f", {type(m).__name__.lower()}" for m in mask.modifiers)
    lines = [f"verify {out_path} against a float64 dense reference of {in_path} "
             f"({'causal' if mask.causal else 'full'}{f', window {window}' if window else ''}, "
             f"scale {scale:.6g}{extras}{f', dropout {dropout.p} seed {dropout.seed}' if dropout else ''})",
             f"  {'dataset':8s} {'max abs err':>12s} {'max rel err':>12s} {'bound':>12s} {'naive err':>12s}  ok"]
    status = 0
    for name, mine in ours.items():
        ok, line = _compare(name, mine, np.stack(refs[name]), np.stack(naives[name]), out_path)
        status = status if ok else 1
        lines.append(line)
    lines.append("PASS: every output within tolerance" if status == 0 else "FAIL: some output is outside tolerance")
    return status, "\n".join(lines)


def _read(in_path: str, out_path: str, max_n: int):
    """``(input spec, output attributes, sinks, inputs, outputs, segment ids)`` of a result file
    and its input, batch-first; ConfigError for files that do not belong together."""
    import h5py

    from ..runtime.errors import ConfigError
    from ..filejob.hdf5 import inspect_serial, open_serial, read_float_dataset

    spec, problem = inspect_serial(in_path, backward=False)
    if problem:
        raise ConfigError(problem)
    if not h5py.is_hdf5(out_path):
        raise ConfigError(f"{out_path}: missing or not an HDF5 file")
    n = max(spec.n_q, spec.n_kv)
    if n > max_n:
        raise ConfigError(f"{in_path}: N={n} is above --max-n {max_n}; the dense reference needs "
                          f"O(N^2) time (raise --max-n if you mean it)")
    with open_serial(out_path) as fo, open_serial(in_path) as fi:
        attrs = OutputAttributes.read(fo, out_path)
        shapes = attrs.input_shapes
        if {k: tuple(v) for k, v in shapes.items()} != spec.shapes:
            raise ConfigError(f"{out_path}: was computed from inputs shaped {shapes}, but {in_path} holds {spec.shapes}")
        names = [n for n in ("o", "lse", "dq", "dk", "dv") + PER_HEAD if n in fo]
        sinks = fo["sinks"][()] if "sinks" in fo else None
        for name in ("o", "lse"):
            if name not in fo:
                raise ConfigError(f"{out_path}: missing dataset '{name}'")
        backward = "dq" in names
        if backward and not spec.has_do:
            raise ConfigError(f"{in_path}: has no 'do', but {out_path} holds gradients")
        lift = (lambda x: x) if spec.rank4 else (lambda x: x[None])
        wanted = ("q", "k", "v") + (("do",) if backward else ())
        inputs = {name: lift(read_float_dataset(fi[name])) for name in wanted}
        ours = {name: (fo[name][()] if name in PER_HEAD else lift(read_float_dataset(fo[name]))) for name in names}
        segs = [None, None]
        if spec.seg_q:
            for i, (name, n_) in enumerate(((spec.seg_q, spec.n_q), (spec.seg_kv, spec.n_kv))):
                ids = fi[name][()].astype(np.int64)
                segs[i] = np.broadcast_to(ids, (spec.batch, n_))
    return spec, attrs, sinks, inputs, ours, segs


def _compare(name: str, mine, ref, naive, out_path: str):
    """``(within tolerance, report line)`` of one output against its float64 and naive references."""
    from ..runtime.errors import ConfigError

    if name in PER_HEAD:  # reduced over the batch, as ringmpi run writes them
        reduce = np.max if name == "max_logit" else np.sum
        ref, naive = reduce(ref, axis=0), reduce(naive, axis=0)
    if mine.shape != ref.shape:
        raise ConfigError(f"{out_path}: dataset '{name}' has shape {mine.shape}, expected {ref.shape}")
    err, base = max_err(mine, ref), max_err(naive, ref)
    base = base if math.isfinite(base) else 0.0
    bound = tolerance(base, gradient=name in GRADIENTS + ("dsinks",))
    finite = np.isfinite(ref)
    scale_ref = float(np.abs(ref[finite]).max()) if finite.any() else 0.0
    rel = err / scale_ref if scale_ref > 0 else err
    ok = err <= bound
    return ok, f"  {name:8s} {err:12.3e} {rel:12.3e} {bound:12.3e} {base:12.3e}  {'yes' if ok else 'NO'}"


@click.command("verify")
@click.argument("input_path", metavar="IN.h5", type=click.Path(dir_okay=False))
@click.argument("output_path", metavar="OUT.h5", type=click.Path(dir_okay=False))
@click.option("--max-n", type=click.IntRange(min=1), default=8192, show_default=True,
              help="Refuse inputs longer than this (the reference is dense).")
def verify(input_path, output_path, max_n):
    """Compare OUT.h5 (from `ringmpi run`) with a float64 dense reference of IN.h5.

    Exit status 0 when every output is within the tolerance of docs/design.md, 1 when
    not, 2 for unusable files.  Mask settings come from OUT.h5's attributes.
    Under mpirun only rank 0 computes.
    """
    from mpi4py import MPI

    from ..runtime.errors import ConfigError, agree

    comm = MPI.COMM_WORLD
    status, text, problem = 0, "", None
    if comm.Get_rank() == 0:
        try:
            status, text = _check(input_path, output_path, max_n)
        except ConfigError as exc:
            problem = str(exc)
    # not under the watchdog: the other ranks wait here for as long as rank 0's dense reference takes
    problem, status = comm.bcast((problem, status), root=0)
    agree(comm, problem)
    if comm.Get_rank() == 0:
        click.echo(text)
    if status:
        sys.exit(status)
