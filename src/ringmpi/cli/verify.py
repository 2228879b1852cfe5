"""``ringmpi verify``: compare a result file with a float64 reference of its input.

Two ways, one tolerance rule (docs/design.md): ``max err <= 2 x naive err + 1e-6``
for ``o``/``lse`` and ``3 x naive err + 1e-5`` for ``dq``/``dk``/``dv``, the naive
error being a plain computation's in the input dtype on the same rows.

* Whole (``N <= --max-n``): rank 0 recomputes everything densely, per batch entry,
  per head and per block of query rows (time ``O(N^2)``, memory ``O(rows_block *
  N_kv)``; :class:`ringmpi.core.dense_reference.DenseReference`).
* Sampled (``--sample R``, and above ``--max-n``): ``R`` query rows (``o``, ``lse``,
  ``dq``) and ``R`` key rows (``dk``, ``dv``) of every batch entry, drawn with
  ``--seed``, each against a reference over the whole sequence in ``O(R * N)``
  (:class:`~ringmpi.core.dense_reference.SampledReference`).  Under ``mpirun`` the
  rows are dealt to the ranks; each streams the datasets it needs in chunks of
  ``CHUNK_ROWS`` tokens with parallel HDF5 (independent reads), never more than a
  chunk at a time, and rank 0 gathers the rows and reports.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Dict, Optional

import click
import numpy as np

from ..filejob.job import OutputAttributes
from ..core.dense_reference import GRADIENTS, DenseReference, SampledReference, max_err, tolerance


PER_HEAD = ("max_logit", "dsinks")  # (H,) datasets of --max-logit and --sinks-dataset
ROW_DATASETS = ("o", "lse", "dq", "dk", "dv")
DEFAULT_SAMPLE = 256
CHUNK_ROWS = 8192  # tokens per read of a streamed dataset (sampled check)
_TITLES = f"  {'dataset':8s} {'max abs err':>12s} {'max rel err':>12s} {'bound':>12s} {'naive err':>12s}  ok"
_WIDTH = len(_TITLES) + 1  # "yes" is one wider than "ok"


@dataclass(frozen=True)
class _Files:
    """What rank 0 found in a result file and its input, before reading any data."""

    spec: object  # the input's InputSpec
    attrs: OutputAttributes
    names: tuple  # the output's datasets to check, of ROW_DATASETS + PER_HEAD
    sinks: Optional[np.ndarray]

    @property
    def n(self) -> int:
        return max(self.spec.n_q, self.spec.n_kv)


def _describe(in_path: str, out_path: str) -> _Files:
    """Rank 0's checks of the two files (metadata only); ConfigError for files that are
    unusable or do not belong together."""
    import h5py

    from ..runtime.errors import ConfigError
    from ..filejob.hdf5 import inspect_serial, open_serial

    spec, problem = inspect_serial(in_path, backward=False)
    if problem:
        raise ConfigError(problem)
    if not h5py.is_hdf5(out_path):
        raise ConfigError(f"{out_path}: missing or not an HDF5 file")
    with open_serial(out_path) as fo:
        attrs = OutputAttributes.read(fo, out_path)
        shapes = attrs.input_shapes
        if {k: tuple(v) for k, v in shapes.items()} != spec.shapes:
            raise ConfigError(f"{out_path}: was computed from inputs shaped {shapes}, but {in_path} holds {spec.shapes}")
        names = tuple(n for n in ROW_DATASETS + PER_HEAD if n in fo)
        sinks = fo["sinks"][()] if "sinks" in fo else None
        for name in ("o", "lse"):
            if name not in fo:
                raise ConfigError(f"{out_path}: missing dataset '{name}'")
        if "dq" in names and not spec.has_do:
            raise ConfigError(f"{in_path}: has no 'do', but {out_path} holds gradients")
        lse_shape = (spec.batch, spec.heads, spec.n_q) if spec.rank4 else (spec.heads, spec.n_q)
        expected = {"o": spec.shapes["q"][:-1] + (spec.dim_v,), "lse": lse_shape, "dq": spec.shapes["q"],
                    "dk": spec.shapes["k"], "dv": spec.shapes["v"], "max_logit": (spec.heads,), "dsinks": (spec.heads,)}
        for name in names:
            if name in expected and tuple(fo[name].shape) != expected[name]:
                raise ConfigError(f"{out_path}: dataset '{name}' has shape {tuple(fo[name].shape)}, "
                                  f"expected {expected[name]}")
    return _Files(spec, attrs, names, sinks)


def _header(files: _Files, in_path: str, out_path: str, what: str) -> list:
    mask, attrs = files.attrs.score_spec(files.spec), files.attrs
    scale, softcap, dropout, window = attrs.attention.softmax_scale, mask.softcap, mask.dropout, attrs.attention.window
    extras = (f", softcap {softcap:g}" if softcap else "") + (", sinks" if files.sinks is not None else "") \
        + "".join(f", {type(m).__name__.lower()}" for m in mask.modifiers)
    return [f"verify {out_path} against a float64 {what} of {in_path} "
            f"({'causal' if mask.causal else 'full'}{f', window {window}' if window else ''}, "
            f"scale {scale:.6g}{extras}{f', dropout {dropout.p} seed {dropout.seed}' if dropout else ''})"]


# ----------------------------------------------------------------- whole (rank 0)
def _check_whole(files: _Files, in_path: str, out_path: str):
    """Rank 0's dense check of every output: ``(exit status, report text)``."""
    spec, attrs = files.spec, files.attrs
    inputs, ours, segs = _read_whole(files, in_path, out_path)
    mask, scale = attrs.score_spec(spec), attrs.attention.softmax_scale
    refs: Dict[str, list] = {name: [] for name in ours}
    naives: Dict[str, list] = {name: [] for name in ours}
    for b in range(spec.batch):
        args = [inputs["q"][b], inputs["k"][b], inputs["v"][b], inputs["do"][b] if "do" in inputs else None,
                None if segs[0] is None else segs[0][b], None if segs[1] is None else segs[1][b]]
        for dtype, into in ((np.float64, refs), (spec.dtype, naives)):
            result = DenseReference(mask, scale, dtype, sinks=files.sinks).compute(*args, batch_index=b)
            for name in ours:
                into[name].append(result[name])
    lines = _header(files, in_path, out_path, "dense reference") + [_TITLES]
    status = 0
    for name, mine in ours.items():
        ok, line = _compare(name, mine, np.stack(refs[name]), np.stack(naives[name]))
        status = status if ok else 1
        lines.append(line)
    lines.append("PASS: every output within tolerance" if status == 0 else "FAIL: some output is outside tolerance")
    return status, "\n".join(lines)


def _read_whole(files: _Files, in_path: str, out_path: str):
    """``(inputs, outputs, segment ids)``, whole and batch-first."""
    from ..filejob.hdf5 import open_serial, read_float_dataset

    spec = files.spec
    with open_serial(out_path) as fo, open_serial(in_path) as fi:
        lift = (lambda x: x) if spec.rank4 else (lambda x: x[None])
        wanted = ("q", "k", "v") + (("do",) if "dq" in files.names else ())
        inputs = {name: lift(read_float_dataset(fi[name])) for name in wanted}
        ours = {name: (fo[name][()] if name in PER_HEAD else lift(read_float_dataset(fo[name])))
                for name in files.names}
        segs = [None, None]
        if spec.seg_q:
            for i, (name, n_) in enumerate(((spec.seg_q, spec.n_q), (spec.seg_kv, spec.n_kv))):
                ids = fi[name][()].astype(np.int64)
                segs[i] = np.broadcast_to(ids, (spec.batch, n_))
    return inputs, ours, segs


def _compare(name: str, mine, ref, naive):
    """``(within tolerance, report line)`` of one output against its float64 and naive references
    (shapes checked by :func:`_describe`)."""
    if name in PER_HEAD:  # reduced over the batch, as ringmpi run writes them
        reduce = np.max if name == "max_logit" else np.sum
        ref, naive = reduce(ref, axis=0), reduce(naive, axis=0)
    err, base = max_err(mine, ref), max_err(naive, ref)
    base = base if math.isfinite(base) else 0.0
    bound = tolerance(base, gradient=name in GRADIENTS + ("dsinks",))
    finite = np.isfinite(ref)
    scale_ref = float(np.abs(ref[finite]).max()) if finite.any() else 0.0
    rel = err / scale_ref if scale_ref > 0 else err
    ok = err <= bound
    return ok, f"  {name:8s} {err:12.3e} {rel:12.3e} {bound:12.3e} {base:12.3e}  {'yes' if ok else 'NO'}"


# ------------------------------------------------------------- sampled (every rank)
def sample_rows(n: int, count: int, seed: int, batch: int, stream: int) -> list:
    """Per batch entry, ``min(count, n)`` distinct ascending token indices of ``range(n)``, drawn
    from ``default_rng([seed, stream, b])`` (stream 0: query rows, 1: key rows): the same on every
    rank and for any number of ranks."""
    return [np.sort(np.random.default_rng([seed, stream, b]).choice(n, size=min(count, n), replace=False))
            for b in range(batch)]


class _Entry:
    """Reads of one batch entry ``b`` of the files: rows along the token axis, ``lse``'s
    ``(H, tokens)``, segment ids (``(N,)`` or ``(B, N)`` datasets)."""

    def __init__(self, b: int, rank4: bool):
        self.b, self.rank4 = b, rank4

    def rows(self, dset, index):
        from ..filejob.hdf5 import read_selection

        return read_selection(dset, (self.b, index) if self.rank4 else (index,))

    def lse(self, dset, index):
        from ..filejob.hdf5 import read_selection

        return read_selection(dset, (self.b, slice(None), index) if self.rank4 else (slice(None), index))

    def segments(self, dset, index):
        from ..filejob.hdf5 import read_selection

        if dset is None:
            return None
        return read_selection(dset, (self.b, index) if dset.ndim == 2 else (index,)).astype(np.int64)


def _sampled_rows(comm, files: _Files, in_path: str, out_path: str, sample: int, seed: int) -> list:
    """This rank's share of the sampled rows: ``[(dataset, b, tokens, mine, ref, naive), ...]``,
    arrays row-first (``lse`` as ``(rows, H)``).  Collective (the files' open and close)."""
    from ..filejob.hdf5 import close_file, open_file

    spec = files.spec
    mask, scale = files.attrs.score_spec(spec), files.attrs.attention.softmax_scale
    rank, size = comm.Get_rank(), comm.Get_size()
    backward = "dq" in files.names
    query_rows = sample_rows(spec.n_q, sample, seed, spec.batch, 0)
    key_rows = sample_rows(spec.n_kv, sample, seed, spec.batch, 1)
    refs = [SampledReference(mask, scale, dtype, sinks=files.sinks) for dtype in (np.float64, spec.dtype)]
    found = []
    fi = open_file(in_path, "r", comm)
    fo = open_file(out_path, "r", comm)
    try:
        seg_q = fi[spec.seg_q] if spec.seg_q else None
        seg_kv = fi[spec.seg_kv] if spec.seg_kv else None
        for b in range(spec.batch):
            e = _Entry(b, spec.rank4)

            def key_chunks():
                for c in range(0, spec.n_kv, CHUNK_ROWS):
                    part = slice(c, min(c + CHUNK_ROWS, spec.n_kv))
                    yield (np.arange(part.start, part.stop), e.rows(fi["k"], part), e.rows(fi["v"], part),
                           e.segments(seg_kv, part))

            def query_chunks():
                for c in range(0, spec.n_q, CHUNK_ROWS):
                    part = slice(c, min(c + CHUNK_ROWS, spec.n_q))
                    yield (np.arange(part.start, part.stop), e.rows(fi["q"], part), e.rows(fi["do"], part),
                           e.rows(fo["o"], part), e.lse(fo["lse"], part), e.segments(seg_q, part))

            rows = query_rows[b][rank::size]
            if len(rows):
                q, do = e.rows(fi["q"], rows), e.rows(fi["do"], rows) if backward else None
                ref, naive = (r.query_rows(rows, q, key_chunks, do=do, seg_q=e.segments(seg_q, rows),
                                           batch_index=b) for r in refs)
                mine = {"o": e.rows(fo["o"], rows), "lse": e.lse(fo["lse"], rows).T}
                if backward:
                    mine["dq"] = e.rows(fo["dq"], rows)
                for name in mine:
                    flip = (lambda x: x.T) if name == "lse" else (lambda x: x)
                    found.append((name, b, rows, mine[name], flip(ref[name]), flip(naive[name])))
            cols = key_rows[b][rank::size]
            if backward and len(cols):
                k, v = e.rows(fi["k"], cols), e.rows(fi["v"], cols)
                ref, naive = (r.key_rows(cols, k, v, query_chunks, seg_kv=e.segments(seg_kv, cols), batch_index=b)
                              for r in refs)
                for name in ("dk", "dv"):
                    found.append((name, b, cols, e.rows(fo[name], cols), ref[name], naive[name]))
    finally:
        close_file(fo, comm)
        close_file(fi, comm)
    return found


def _report_sampled(files: _Files, every: list, in_path: str, out_path: str, sample: int, seed: int,
                    why: str):
    """Rank 0's ``(exit status, report text)`` of the ranks' sampled rows."""
    spec = files.spec
    lines = _header(files, in_path, out_path, "reference over the whole sequence") + [
        f"  a sample of {min(sample, spec.n_q)} query rows"
        + (f" and {min(sample, spec.n_kv)} key rows" if "dq" in files.names else "")
        + f"{' of each batch entry' if spec.batch > 1 else ''}, seed {seed} "
          f"(--sample {sample} --seed {seed} draws them again){why}",
        f"{_TITLES:<{_WIDTH}}  worst row"]
    status = 0
    pieces = [piece for rank_pieces in every for piece in rank_pieces]
    for name in files.names:
        if name in PER_HEAD:
            lines.append(f"  {name:8s} not checked: a {'maximum' if name == 'max_logit' else 'sum'} over every "
                         f"row (verify without --sample checks it)")
            continue
        mine = [p for p in pieces if p[0] == name]
        if not mine:
            continue
        ok, line = _compare_rows(name, mine, spec.batch > 1)
        status = status if ok else 1
        lines.append(line)
    lines.append("PASS: every sampled row within tolerance" if status == 0
                 else "FAIL: some output is outside tolerance")
    return status, "\n".join(lines)


def _compare_rows(name: str, pieces: list, batched: bool):
    """``(within tolerance, report line)`` of one dataset's sampled rows (every rank's pieces),
    the line naming the row with the largest error."""
    mine, ref, naive = (np.concatenate([np.asarray(p[i], np.float64) for p in pieces]) for i in (3, 4, 5))
    where = [(p[1], int(t)) for p in pieces for t in p[2]]
    ok, line = _compare(name, mine, ref, naive)
    b, token = where[int(np.argmax([max_err(mine[i], ref[i]) for i in range(len(mine))]))]
    return ok, (f"{line:<{_WIDTH}}  {'batch ' + str(b) + ' ' if batched else ''}"
                f"{'key' if name in ('dk', 'dv') else 'token'} {token}")


@click.command("verify")
@click.argument("input_path", metavar="IN.h5", type=click.Path(dir_okay=False))
@click.argument("output_path", metavar="OUT.h5", type=click.Path(dir_okay=False))
@click.option("--max-n", type=click.IntRange(min=1), default=8192, show_default=True,
              help="Longest input checked whole (the dense reference is O(N^2)); longer ones are "
                   f"sampled (--sample, {DEFAULT_SAMPLE} rows unless given).")
@click.option("--sample", type=click.IntRange(min=1), default=None, metavar="R",
              help="Check R query rows (o, lse, dq) and R key rows (dk, dv) of each batch entry, each "
                   "against a float64 reference over the whole sequence: O(R*N), shared among the ranks.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the sampled rows.")
def verify(input_path, output_path, max_n, sample, seed):
    """Compare OUT.h5 (from `ringmpi run`) with a float64 reference of IN.h5.

    Exit status 0 when every output is within the tolerance of docs/design.md, 1 when
    not, 2 for unusable files.  Mask settings come from OUT.h5's attributes.
    Inputs up to --max-n tokens are checked whole (rank 0 computes); with --sample, or
    above --max-n, sampled rows are checked, dealt to the ranks under mpirun.

    \b
      ringmpi verify in.h5 out.h5
      mpirun -n 4 ringmpi verify in.h5 out.h5 --sample 256 --seed 1
    """
    from mpi4py import MPI

    from ..runtime.errors import ConfigError, agree
    from ..runtime.watchdog import phase

    comm = MPI.COMM_WORLD
    files, problem = None, None
    if comm.Get_rank() == 0:
        try:
            files = _describe(input_path, output_path)
        except ConfigError as exc:
            problem = str(exc)
    with phase(f"sharing the description of {output_path} (bcast)"):
        files, problem = comm.bcast((files, problem), root=0)
    agree(comm, problem)
    why = ""
    if sample is None and files.n > max_n:
        sample = DEFAULT_SAMPLE
        why = f"; N={files.n} is above --max-n {max_n}, too long to check whole"
    if sample is None:
        status, text = _check_whole_on_rank_0(comm, files, input_path, output_path)
    else:
        mine = _sampled_rows(comm, files, input_path, output_path, sample, seed)
        with phase("gathering the sampled rows (gather)"):
            every = comm.gather(mine, root=0)
        status, text = (_report_sampled(files, every, input_path, output_path, sample, seed, why)
                        if comm.Get_rank() == 0 else (0, ""))
        with phase("sharing the verdict (bcast)"):
            status = comm.bcast(status, root=0)
    if comm.Get_rank() == 0:
        click.echo(text)
    if status:
        sys.exit(status)


def _check_whole_on_rank_0(comm, files: _Files, input_path: str, output_path: str):
    """``(exit status, report text)``: rank 0 checks every output, the others wait for its verdict."""
    status, text = (_check_whole(files, input_path, output_path) if comm.Get_rank() == 0 else (0, ""))
    # not under the watchdog: the other ranks wait here for as long as rank 0's dense reference takes
    return comm.bcast(status, root=0), text
