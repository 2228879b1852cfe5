"""Parallel HDF5: validate an input file, read shards, write outputs atomically.

Every rank opens the file with h5py's ``mpio`` driver and transfers only its
own tokens: the rows its :class:`~ringmpi.core.layout.Layout` gives it, selected as
one hyperslab per contiguous run (a single strided hyperslab for ``striped``),
in one collective call per piece of at most ``RINGMPI_IO_PIECE_BYTES`` bytes
(default 1 GiB).  Ranks agree on the number of pieces with an allreduce, so a
rank with fewer (or zero) rows still joins every collective call with an empty
selection: ``N < P`` never hangs.

Outputs are written to a temporary file next to the output path, closed
collectively, and renamed by rank 0: a failed run leaves no file at the
output path and never touches an existing one.  The file format is described
in ``docs/file-format.md``.
"""

from __future__ import annotations

import math
import os
import secrets
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..core.dtypes import NAMES, BFLOAT16, isfinite, from_hdf5_storage, hdf5_logical_dtype, hdf5_storage, to_hdf5_storage
from ..core.shapes import qkv_problem
from ..runtime.errors import agree
from ..runtime import env, watchdog
from ..runtime.watchdog import phase, sync


def memory_dtype(stored) -> Optional[np.dtype]:
    """The native-endian NumPy dtype that a stored floating-point dataset reads into.

    Any byte order of IEEE float16/32/64 (``>f4``, ``<f8`` ...) maps to the
    native dtype of that precision (HDF5 converts while reading); None when
    ``stored`` is not one of the supported floating-point types.  The one
    place that decides which stored types ringmpi reads.
    """
    stored = np.dtype(stored)
    if stored == BFLOAT16:
        return stored
    if stored.kind == "f" and stored.itemsize in (2, 4, 8):
        return stored.newbyteorder("=")
    return None


def memory_dtype_name(stored) -> Optional[str]:
    """``str(memory_dtype(stored))`` (e.g. ``"float32"``), or None when unsupported."""
    native = memory_dtype(stored)
    return None if native is None else str(native)
DEFAULT_PIECE_BYTES = 1 << 30


def create_float_dataset(f, name: str, shape, dtype, **kwargs):
    """Create dataset ``name`` holding ``dtype`` (collective under mpio).

    bfloat16 is stored as its 16-bit patterns with the attribute
    ``dtype = "bfloat16"`` (HDF5 has no bfloat16 type); :class:`ShardIO`
    reads such a dataset back as ``ml_dtypes.bfloat16``.
    """
    storage, attrs = hdf5_storage(dtype)
    dset = f.create_dataset(name, shape=shape, dtype=storage, **kwargs)
    for key, value in attrs.items():
        dset.attrs[key] = value
    return dset


def read_float_dataset(dset) -> np.ndarray:
    """A whole dataset in the dtype it holds (bfloat16 for the marked uint16 patterns)."""
    return read_selection(dset, ())


def read_selection(dset, selection) -> np.ndarray:
    """``dset[selection]`` (h5py's indexing: integers, slices, one ascending list of indices) in
    the dtype it holds (bfloat16 for the marked uint16 patterns).  Under the ``mpio`` driver an
    independent read: each rank reads only what it alone needs (``ringmpi verify --sample``)."""
    return from_hdf5_storage(dset[selection], hdf5_logical_dtype(dset))


def piece_bytes() -> int:
    """Largest transfer of one collective call (``RINGMPI_IO_PIECE_BYTES``, default 1 GiB)."""
    return env.io_piece_bytes(DEFAULT_PIECE_BYTES)


# --------------------------------------------------------------------- files
def open_file(path: str, mode: str, comm):
    """``h5py.File(path, mode)`` with the ``mpio`` driver over ``comm`` (collective).

    File locking follows ``HDF5_USE_FILE_LOCKING`` when it is set; otherwise
    locking is tried first and, where the file system refuses locks (Lustre,
    some NFS), the open is retried without.  Ranks agree on the outcome.
    """
    import h5py

    kwargs = dict(driver="mpio", comm=comm)
    verb = "open" if mode in ("r", "r+") else "create"
    with phase(f"HDF5 {verb} {path}"):
        sync(comm)
        if "HDF5_USE_FILE_LOCKING" in os.environ:
            return h5py.File(path, mode, **kwargs)
        try:
            handle, failure = h5py.File(path, mode, **kwargs), None
        except OSError as exc:
            handle, failure = None, str(exc)
        failures = comm.allgather(failure)
        if not any(failures):
            return handle
        if handle is not None:
            handle.close()
        if any("lock" in f.lower() for f in failures if f):
            sync(comm)
            return h5py.File(path, mode, locking=False, **kwargs)
        raise OSError(next(f for f in failures if f))


def close_file(handle, comm) -> None:
    """Close a file opened with :func:`open_file` (collective), under the deadline."""
    with phase(f"HDF5 close {handle.filename}"):
        sync(comm)
        handle.close()


def flush_file(handle, comm) -> None:
    """Flush a file opened with :func:`open_file` (collective), under the deadline."""
    with phase(f"HDF5 flush {handle.filename}"):
        sync(comm)
        handle.flush()


def open_serial(path: str):
    """A serial (one process, no MPI) read-only handle: rank 0's metadata checks, ``ringmpi verify``."""
    import h5py

    try:
        return h5py.File(path, "r", locking=False)
    except (TypeError, ValueError):  # HDF5 without the locking property
        return h5py.File(path, "r")


# ------------------------------------------------------------------ the input
@dataclass(frozen=True)
class InputSpec:
    """What an input file holds, agreed on every rank.

    ``batch`` is 1 for 3-D datasets ``(N, H, D)``; ``seg_q``/``seg_kv`` name
    the segment-id datasets (or None); ``shapes`` holds every dataset's shape
    as stored.
    """

    path: str
    batch: int
    n_q: int
    n_kv: int
    heads: int
    kv_heads: int
    dim: int
    dtype: str
    seg_q: Optional[str]
    seg_kv: Optional[str]
    shapes: Dict[str, Tuple[int, ...]] = field(default_factory=dict)

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    @property
    def rank4(self) -> bool:
        """True for ``(B, N, H, D)`` datasets, False for ``(N, H, D)``."""
        return len(self.shapes["q"]) == 4

    @property
    def has_do(self) -> bool:
        """True when the file holds ``do`` (the gradient of ``o``)."""
        return "do" in self.shapes

    @property
    def dim_v(self) -> int:
        """The value head dim ``D_v`` (the last dim of v, o, do, dv); may differ from ``dim``."""
        return self.shapes["v"][-1] if "v" in self.shapes else self.dim

    @property
    def itemsize(self) -> int:
        """Bytes per element of q, k, v (and do)."""
        return np.dtype(self.dtype).itemsize


def _describe_input(f, path: str, backward: bool):
    """``(InputSpec, None)`` or ``(None, problem)`` for an open file."""
    where = f"{path}"
    shapes = {}
    for name in ("q", "k", "v"):
        if name not in f:
            return None, f"{where}: missing dataset '{name}' (need q, k, v shaped (B, N, H, D) or (N, H, D))"
    for name in ("q", "k", "v", "do", "segment_ids", "segment_ids_q", "segment_ids_kv"):
        if name in f:
            obj = f[name]
            if not hasattr(obj, "shape"):
                return None, f"{where}: '{name}' is not a dataset"
            shapes[name] = tuple(int(s) for s in obj.shape)
    if backward and "do" not in f:
        return None, f"{where}: --backward needs dataset 'do' (the gradient of o, shaped like q)"
    ndim = len(shapes["q"])
    for name in ("q", "k", "v", "do"):
        if name in shapes and len(shapes[name]) not in (3, 4):
            return None, (f"{where}: dataset '{name}' has rank {len(shapes[name])} (shape {shapes[name]}); "
                          f"expected (B, N, H, D) or (N, H, D)")
        if name in shapes and len(shapes[name]) != ndim:
            return None, (f"{where}: dataset '{name}' has rank {len(shapes[name])} but 'q' has rank {ndim}: "
                          f"q, k, v, do must all be 4-D (B, N, H, D) or all 3-D (N, H, D)")
    dtypes = {}
    for name in ("q", "k", "v", "do"):
        if name not in shapes:
            continue
        dtypes[name] = memory_dtype_name(hdf5_logical_dtype(f[name]))
        if dtypes[name] is None:
            return None, (f"{where}: dataset '{name}' has unsupported dtype {f[name].dtype}; "
                          f"expected floating point: one of {', '.join(NAMES)} (any byte order)")
    if len(set(dtypes.values())) > 1:
        return None, (f"{where}: datasets must share one dtype, got "
                      + ", ".join(f"{n} {d}" for n, d in dtypes.items()))
    full = {n: ((1,) + s if ndim == 3 else s) for n, s in shapes.items() if n in ("q", "k", "v", "do")}
    b, n_q, h, d = full["q"]
    bk, n_kv, h_kv, dk = full["k"]
    found = qkv_problem(full["q"], full["k"], full["v"])
    rule = None if found is None else found[0]
    if rule in ("kv", "value_dim"):
        return None, (f"{where}: datasets 'k' {shapes['k']} and 'v' {shapes['v']} must have the same shape "
                      f"but for the last dim (the value head dim D_v may differ from D)")
    d_v = full["v"][3]
    if rule == "batch":
        return None, f"{where}: batch sizes differ: 'q' has B={b}, 'k' has B={bk}"
    if rule == "head_dim":
        return None, f"{where}: head dims differ: 'q' has D={d}, 'k'/'v' have D={dk}"
    if min(n_q, n_kv, h, h_kv, d, b) < 1:
        return None, f"{where}: empty dataset: q {shapes['q']}, k {shapes['k']}"
    if rule == "heads":
        return None, (f"{where}: 'q' has H={h} heads, not a multiple of the H_kv={h_kv} heads of 'k'/'v' "
                      f"(H % H_kv must be 0)")
    if "do" in full and full["do"] != full["q"][:3] + (d_v,):
        want = shapes["q"][:-1] + (d_v,)
        return None, f"{where}: dataset 'do' has shape {shapes['do']}, expected o's shape {want} (q's, D_v wide)"
    seg_q = seg_kv = None
    if "segment_ids" in shapes:
        if "segment_ids_q" in shapes or "segment_ids_kv" in shapes:
            return None, f"{where}: give 'segment_ids' or 'segment_ids_q'/'segment_ids_kv', not both"
        if n_q != n_kv:
            return None, (f"{where}: 'segment_ids' needs equal q and k/v lengths (got {n_q} and {n_kv}); "
                          f"use 'segment_ids_q' and 'segment_ids_kv'")
        seg_q = seg_kv = "segment_ids"
    elif "segment_ids_q" in shapes or "segment_ids_kv" in shapes:
        if not ("segment_ids_q" in shapes and "segment_ids_kv" in shapes):
            return None, f"{where}: give both 'segment_ids_q' and 'segment_ids_kv', or neither"
        seg_q, seg_kv = "segment_ids_q", "segment_ids_kv"
    for name, n in ((seg_q, n_q), (seg_kv, n_kv)):
        if name is None:
            continue
        shape = shapes[name]
        if shape not in ((n,), (b, n)):
            return None, f"{where}: dataset '{name}' has shape {shape}; expected ({b}, {n}) or ({n},)"
        if f[name].dtype.kind not in "iu":
            return None, f"{where}: dataset '{name}' must hold integers, got dtype {f[name].dtype}"
    spec = InputSpec(path=path, batch=b, n_q=n_q, n_kv=n_kv, heads=h, kv_heads=h_kv,
                     dim=d, dtype=dtypes["q"], seg_q=seg_q, seg_kv=seg_kv, shapes=shapes)
    return spec, None


def inspect_input(path: str, comm, backward: bool = False) -> InputSpec:
    """Validate the input file on rank 0 and share its description (collective).

    Raises the same :class:`ConfigError` on every rank for a missing file, a
    file that is not HDF5, missing datasets, wrong ranks, mismatched shapes,
    unsupported dtypes, or a missing ``do`` with ``backward``.
    """
    spec, problem = None, None
    if comm.Get_rank() == 0:
        spec, problem = inspect_serial(path, backward)
    with phase(f"sharing the description of {path} (bcast)"):
        spec, problem = comm.bcast((spec, problem), root=0)
    agree(comm, problem)
    return spec


def inspect_serial(path: str, backward: bool):
    """``(InputSpec, None)`` or ``(None, problem)`` for the input file at ``path``, read by this
    process alone (rank 0 of :func:`inspect_input`, ``ringmpi verify``)."""
    import h5py

    if not os.path.exists(path):
        return None, f"{path}: input file does not exist"
    if os.path.isdir(path):
        return None, f"{path}: input is a directory, not an HDF5 file"
    if not h5py.is_hdf5(path):
        return None, f"{path}: not an HDF5 file"
    try:
        with open_serial(path) as f:
            return _describe_input(f, path, backward)
    except OSError as exc:
        return None, f"{path}: cannot open as HDF5: {exc}"


def document_lengths(spec: InputSpec, comm) -> List[int]:
    """The documents of the input's segment ids for the balanced layout (collective): rank 0
    reads the query segment ids and cuts where any batch entry's id changes; one document
    without segment ids.  Shared with a bcast, O(documents)."""
    lengths = None
    if comm.Get_rank() == 0:
        lengths = [spec.n_q]
        if spec.seg_q:
            with open_serial(spec.path) as f:
                ids = np.asarray(f[spec.seg_q][()], dtype=np.int64).reshape(-1, spec.n_q)
            cut = np.flatnonzero((np.diff(ids, axis=1) != 0).any(axis=0)) + 1
            lengths = np.diff(np.concatenate([[0], cut, [spec.n_q]])).astype(int).tolist()
    with phase(f"sharing the documents of {spec.path} (bcast)"):
        return comm.bcast(lengths, root=0)


# ------------------------------------------------------------- shard transfer
def _slabs(idx: np.ndarray):
    """``[(start, count, stride), ...]`` hyperslabs covering sorted indices ``idx``."""
    if len(idx) == 0:
        return []
    if len(idx) == 1:
        return [(int(idx[0]), 1, 1)]
    steps = np.diff(idx)
    if (steps == steps[0]).all():  # one contiguous run, or striped
        return [(int(idx[0]), len(idx), int(steps[0]))]
    breaks = np.flatnonzero(steps != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [len(idx)]])
    return [(int(idx[s]), int(e - s), 1) for s, e in zip(starts, ends)]


def _collective_dxpl():
    from h5py import h5fd, h5p

    dxpl = h5p.create(h5p.DATASET_XFER)
    dxpl.set_dxpl_mpio(h5fd.MPIO_COLLECTIVE)
    return dxpl


def _independent_dxpl():
    from h5py import h5fd, h5p

    dxpl = h5p.create(h5p.DATASET_XFER)
    dxpl.set_dxpl_mpio(h5fd.MPIO_INDEPENDENT)
    return dxpl


def is_filtered(dset) -> bool:
    """True when ``dset`` has a filter pipeline (compression, shuffle, fletcher32)."""
    return dset.id.get_create_plist().get_nfilters() > 0


class ShardIO:
    """Collective transfer of each rank's rows of datasets, in bounded pieces.

    Parameters
    ----------
    comm : mpi4py communicator
    indices : (n_local,) int64, ascending
        The global rows (along the dataset's row axis) this rank owns.
    """

    def __init__(self, comm, indices: np.ndarray):
        self.comm = comm
        self.indices = np.asarray(indices, dtype=np.int64)
        self.dxpl = _collective_dxpl()
        self.filtered_read_dxpl = _independent_dxpl()
        self.read_s = 0.0
        self.write_s = 0.0

    def _pieces(self, row_bytes: int):
        """This rank's row ranges, one per collective call (same count on every rank)."""
        from mpi4py import MPI

        rows = max(1, piece_bytes() // max(1, row_bytes))
        mine = math.ceil(len(self.indices) / rows)
        count = self.comm.allreduce(mine, op=MPI.MAX)
        return [(min(i * rows, len(self.indices)), min((i + 1) * rows, len(self.indices)))
                for i in range(count)]

    def _call(self, dset, lo, hi, row_axis, box, buf, write):
        from h5py import h5s

        fspace = dset.id.get_space()
        idx = self.indices[lo:hi]
        if buf.size == 0:
            fspace.select_none()
            mspace = h5s.create_simple((1,))
            mspace.select_none()
            buf = np.empty(1, dtype=buf.dtype)
        else:
            for i, (start, count, stride) in enumerate(_slabs(idx)):
                starts = [b[0] for b in box]
                counts = [b[1] - b[0] for b in box]
                strides = [1] * len(box)
                starts[row_axis], counts[row_axis], strides[row_axis] = start, count, stride
                fspace.select_hyperslab(tuple(starts), tuple(counts), tuple(strides),
                                        op=h5s.SELECT_SET if i == 0 else h5s.SELECT_OR)
            mspace = h5s.create_simple(buf.shape)
        if write:
            dset.id.write(mspace, fspace, buf, dxpl=self.dxpl)
        elif is_filtered(dset):
            # HDF5 1.10's collective read of filtered chunks runs every filter on every chunk,
            # ignoring the chunk's filter mask: a chunk stored with an optional filter skipped
            # (LZF, deflate: when compressing would not shrink it) is "decompressed" anyway
            # ('Invalid data for LZF decompression'); independent reads honour the mask.  The
            # collective filtered path was rewritten later (HDFGroup/hdf5#1302, HDF5 1.14).
            dset.id.read(mspace, fspace, buf, dxpl=self.filtered_read_dxpl)
        else:
            dset.id.read(mspace, fspace, buf, dxpl=self.dxpl)

    def _box(self, dset, row_axis, box):
        box = list(box) if box is not None else [(0, s) for s in dset.shape]
        if len(box) != dset.ndim:
            raise ValueError(f"box {box} does not match dataset {dset.name} of rank {dset.ndim}")
        box[row_axis] = (0, 0)
        return box

    def read(self, dset, row_axis: int, box: Optional[Sequence[Tuple[int, int]]] = None) -> np.ndarray:
        """This rank's rows of ``dset`` restricted to ``box`` (collective).

        ``box`` gives ``(start, stop)`` per axis (the row axis entry is
        ignored); None means the whole extent.  The result has the dataset's
        dtype in native byte order (HDF5 converts; chunked and filtered
        datasets read the same way) and ``len(indices)`` along ``row_axis``, in ascending row order.
        Filtered datasets (gzip, lzf, shuffle, fletcher32) are read with independent
        transfers, every rank still making the same number of calls.
        """
        with phase(f"HDF5 read {dset.name}"):
            return self._read(dset, row_axis, box)

    def _read(self, dset, row_axis, box) -> np.ndarray:
        import time

        self.comm.Barrier()  # time the transfer, not the wait for ranks still computing
        start = time.perf_counter()
        box = self._box(dset, row_axis, box)
        shape = [b[1] - b[0] for b in box]
        shape[row_axis] = len(self.indices)
        out = np.empty(shape, dtype=memory_dtype(dset.dtype) or dset.dtype)  # native byte order
        row_bytes = int(np.prod([s for i, s in enumerate(shape) if i != row_axis], dtype=np.int64)) * out.itemsize
        moved = np.moveaxis(out, row_axis, 0)
        for lo, hi in self._pieces(row_bytes):
            piece = np.empty(tuple(shape[:row_axis]) + (hi - lo,) + tuple(shape[row_axis + 1:]), dtype=out.dtype)
            self._call(dset, lo, hi, row_axis, box, piece, write=False)
            moved[lo:hi] = np.moveaxis(piece, row_axis, 0)
        self.read_s += time.perf_counter() - start
        return from_hdf5_storage(out, hdf5_logical_dtype(dset))

    def write(self, dset, row_axis: int, data: np.ndarray,
              box: Optional[Sequence[Tuple[int, int]]] = None) -> None:
        """Write this rank's rows ``data`` into ``dset`` within ``box`` (collective)."""
        with phase(f"HDF5 write {dset.name}"):
            self._write(dset, row_axis, data, box)

    def _write(self, dset, row_axis, data, box) -> None:
        import time

        self.comm.Barrier()  # time the transfer, not the wait for ranks still computing
        start = time.perf_counter()
        box = self._box(dset, row_axis, box)
        data = to_hdf5_storage(np.asarray(data, dtype=hdf5_logical_dtype(dset)))
        expect = [b[1] - b[0] for b in box]
        expect[row_axis] = len(self.indices)
        if list(data.shape) != expect:
            raise ValueError(f"writing {dset.name}: data shape {data.shape}, selection {tuple(expect)}")
        row_bytes = int(np.prod([s for i, s in enumerate(expect) if i != row_axis], dtype=np.int64)) * data.itemsize
        for lo, hi in self._pieces(row_bytes):
            index = [slice(None)] * data.ndim
            index[row_axis] = slice(lo, hi)
            self._call(dset, lo, hi, row_axis, box, np.ascontiguousarray(data[tuple(index)]), write=True)
        self.write_s += time.perf_counter() - start


def first_nonfinite(data: np.ndarray, indices: np.ndarray, box):
    """The first NaN/Inf of this rank's rows, as ``(global index, value)``, or None.

    ``data (B, S_local, H, D)`` holds rows ``indices`` (ascending) of the
    dataset region ``box`` (``(start, stop)`` per axis; the row axis entry is
    ignored): the index returned is in the whole dataset's coordinates, and
    the first in C order over this rank's rows.  One pass over data in memory.
    """
    finite = isfinite(data)
    if finite.all():
        return None
    b, s, h, d = np.unravel_index(int(np.argmin(finite)), data.shape)
    index = (int(box[0][0] + b), int(indices[s]), int(box[2][0] + h), int(box[3][0] + d))
    return index, float(data[b, s, h, d])


# ---------------------------------------------------------------- the output
class AtomicOutput:
    """An output file written under a temporary name and renamed when complete.

    Collective.  ``prepare`` checks the output path on rank 0 (exists without
    ``overwrite``, directory missing or not writable, same as the input) and
    agrees on a temporary name ``.<name>.tmp-<hex>`` in the same directory
    (``.<name>.partial`` when ``resumable``: a later run can find it and
    continue; once ``keep_on_failure`` is set, a failing rank leaves it);
    ``open`` creates it with the ``mpio`` driver; ``commit`` closes it
    collectively and renames it over the output path; ``discard`` removes it.
    """

    def __init__(self, path: str, comm, overwrite: bool = False, input_path: Optional[str] = None,
                 resumable: bool = False):
        self.path = os.path.abspath(path)
        self.comm = comm
        self.file = None
        self.resumable = resumable
        self.keep_on_failure = False  # set once the partial file holds finished work
        problem, tmp = None, None
        if comm.Get_rank() == 0:
            problem, tmp = self._check(overwrite, input_path)
        with phase(f"checking the output path {self.path} (bcast)"):
            problem, tmp = comm.bcast((problem, tmp), root=0)
        agree(comm, problem)
        self.tmp = tmp

    @staticmethod
    def partial_path(path: str) -> str:
        """The fixed temporary name of a resumable output: ``.<name>.partial`` beside it."""
        path = os.path.abspath(path)
        return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.partial")

    def _check(self, overwrite, input_path):
        directory = os.path.dirname(self.path)
        if input_path is not None and os.path.exists(input_path) and os.path.exists(self.path) \
                and os.path.samefile(input_path, self.path):
            return f"{self.path}: the output path is the input file", None
        if os.path.isdir(self.path):
            return f"{self.path}: output path is a directory", None
        if os.path.exists(self.path) and not overwrite:
            return f"{self.path}: output file exists (pass --overwrite to replace it)", None
        if not os.path.isdir(directory):
            return f"{self.path}: output directory {directory} does not exist", None
        tmp = self.partial_path(self.path) if self.resumable else \
            os.path.join(directory, f".{os.path.basename(self.path)}.tmp-{secrets.token_hex(6)}")
        probe = os.path.join(directory, f".{os.path.basename(self.path)}.tmp-{secrets.token_hex(6)}")
        try:  # the real test of writability (os.access lies for root and ACLs)
            fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            return f"{self.path}: output directory {directory} is not writable ({exc.strerror})", None
        return None, tmp

    def open(self, resume: bool = False):
        """Create the temporary file (replacing any), or with ``resume`` reopen it for writing."""
        self.file = open_file(self.tmp, "r+" if resume else "w", self.comm)
        self._guard_termination()
        return self.file

    def _guard_termination(self) -> None:
        """Remove the temporary file if the launcher terminates us (a peer rank died).

        mpirun/srun send SIGTERM to the surviving ranks before SIGKILL; the handler
        runs as soon as this rank is back in Python (the ring waits poll there).
        """
        import signal

        def on_term(signum, frame):
            self._remove_unless_kept()
            os._exit(128 + signum)

        self._watchdog_key = watchdog.on_abort(self._remove_unless_kept)  # a phase past its deadline
        try:
            self._previous_handler = signal.signal(signal.SIGTERM, on_term)
        except ValueError:  # not the main thread: no handler, the temporary file may stay
            self._previous_handler = None

    def _remove_unless_kept(self) -> None:
        if not self.keep_on_failure:
            try:
                os.unlink(self.tmp)
            except OSError:
                pass

    def _release_termination(self) -> None:
        import signal

        watchdog.cancel_on_abort(getattr(self, "_watchdog_key", None))
        if getattr(self, "_previous_handler", None) is not None:
            signal.signal(signal.SIGTERM, self._previous_handler)
            self._previous_handler = None

    def commit(self) -> None:
        """Close collectively, then rank 0 renames the file over the output path."""
        self._release_termination()
        close_file(self.file, self.comm)
        self.file = None
        with phase(f"renaming the output into place {self.path}"):
            self.comm.Barrier()
            failure = None
            if self.comm.Get_rank() == 0:
                try:
                    os.replace(self.tmp, self.path)
                except OSError as exc:
                    failure = f"{self.path}: cannot rename {self.tmp} into place: {exc}"
            failure = self.comm.bcast(failure, root=0)
        if failure:
            raise OSError(failure)

    def discard(self, collective: bool = True) -> None:
        """Remove the temporary file.  ``collective=False`` from a failing rank alone,
        which keeps a resumable file that holds finished work (``keep_on_failure``)."""
        self._release_termination()
        if not collective and self.keep_on_failure:
            return
        if self.file is not None:
            try:
                if collective:
                    close_file(self.file, self.comm)
            except Exception:
                pass
            self.file = None
        if collective:
            with phase(f"discarding the output {self.tmp} (barrier)"):
                self.comm.Barrier()
            if self.comm.Get_rank() != 0:
                return
        try:
            os.unlink(self.tmp)
        except FileNotFoundError:
            pass
        except OSError:
            pass
