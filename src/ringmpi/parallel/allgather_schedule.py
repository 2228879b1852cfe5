"""The all-gather schedule: every rank gathers the K/V of all ranks with nonblocking collectives.

:class:`AllGatherSchedule` is a drop-in for :class:`~ringmpi.parallel.ring_schedule.RingSchedule`
(the same :class:`~ringmpi.parallel.ring_schedule.Block` per step to the same
``forward_pass``/``backward_pass`` loop, the same records, deadlines and fault
points).  Every rank's K/V rows are cut into ``pieces`` (:func:`ringmpi.core.cost_model.piece_count`,
:func:`piece_bounds`: the same cut on every rank, from the row counts); piece ``c`` is one
``Iallgatherv`` of every rank's ``c``-th chunk.  All pieces are posted before
the rank's own block computes, so the transfer of the later pieces overlaps
the work on the earlier ones; a step is one (piece, source rank) block, folded
in a fixed order (own block, then per piece the sources in ring order), so the
result is bitwise repeatable at a fixed placement and P.  A dense mask needs
every row; under a mask the block ops skip the tiles nobody sees (the routed
schedule is the one that moves only visible rows).

Backward: the blocks of piece ``c`` get their ``dK, dV`` terms in one zeroed
message per piece (compute dtype, laid out as the piece's K/V), handed back to
the owners with one ``Ialltoallv`` as soon as the piece is done (overlapping the
next piece's compute); each owner adds its own block's terms first, then, once the
next piece is done, the partial sums of the other ranks in ring order: a fixed order
(the pieces' rows are disjoint), and at most two pieces' partial sums live at a time.

Memory (what :func:`declared_bytes` declares; :func:`ringmpi.core.cost_model.allgather_memory`
adds the accumulators, :func:`~ringmpi.core.cost_model.resident_memory` the tile
workspace): the whole K/V (``N_kv`` rows, transfer dtype; each rank writes its own chunk
into its slot and gathers in place, ``MPI_IN_PLACE``: no send copy) in the forward; the
backward adds the finished ``dK, dV`` of this rank's rows and, for two pieces, the partial
sums of every row and those of this rank's rows returned by the other ranks.
O(N_kv) per rank, against the ring's O(N_kv / P):
``schedule="auto"`` never takes it beyond the memory budget and an explicit
``schedule="allgather"`` beyond it is refused on every rank before compute.
"""

from __future__ import annotations

from typing import Iterator, List, Optional, Sequence

import numpy as np

from ..core.cost_model import piece_count
from ..core.masks import BlockMask, ScoreSpec
from ..runtime.faults import fault_point
from .ring import Ring
from .ring_schedule import Block, observed_compute, steps_done


def piece_bounds(rows: int, pieces: int) -> List[int]:
    """``pieces + 1`` local row boundaries of a rank holding ``rows`` rows."""
    return [(c * int(rows)) // pieces for c in range(pieces + 1)]


def declared_bytes(counts: Sequence[int], rank: int, batch: int, kv_heads: int, dim: int, dim_v: int,
                   itemsize: int, grad_itemsize: int = 0) -> int:
    """Bytes one pass of this schedule allocates on ``rank`` beyond the call's own arrays and
    accumulators: every rank's K/V rows (``itemsize``: the transfer dtype's; this rank's own rows
    are gathered in place); with ``grad_itemsize`` (the backward's compute dtype) this rank's
    finished ``dK, dV`` and, of at most two pieces at a time, the partial sums of every gathered
    row and those of this rank's rows returned by every rank."""
    counts = np.asarray(counts, dtype=np.int64)
    width = batch * kv_heads * (dim + dim_v)
    total, mine, size = int(counts.sum()), int(counts[rank]), len(counts)
    held = total * width * itemsize
    if grad_itemsize:
        pieces = piece_count(counts)
        bounds = np.array([piece_bounds(c, pieces) for c in counts], dtype=np.int64)
        rows = bounds[:, 1:] - bounds[:, :-1]                          # (P, C) rows of each piece
        sums = rows.sum(axis=0) + (size - 1) * rows[rank]              # (C,) a piece's partial sums
        pair = max(int(sums[c:c + 2].sum()) for c in range(pieces))  # two pieces live at once
        held += (mine + pair) * width * grad_itemsize
    return held


class _Piece:
    """One piece's buffers: every rank's chunk (K then V, rank order) and, backward, its sums."""

    def __init__(self, backend, rows: np.ndarray, row_bytes: int, grad_row_bytes: int):
        self.rows = rows                                  # (P,) rows of each rank in this piece
        self.offsets = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
        self.msg = backend.message(int(self.offsets[-1]) * row_bytes)
        self.grads = self.grads_in = None
        self.row_bytes, self.grad_row_bytes = row_bytes, grad_row_bytes


class AllGatherSchedule:
    """One pass of the all-gather schedule over ``comm`` (the interface of ``RingSchedule``).

    Parameters
    ----------
    comm, backend : as for :class:`~ringmpi.parallel.ring_schedule.RingSchedule`.
    kh, vh : (B, H_kv, S_local, D), (B, H_kv, S_local, D_v) this rank's keys/values, head-major
        (views are fine: the block op and the packing read them in place).
    kv_counts : (P,) rows of every rank's K/V; kv_runs : every rank's key runs
        (:class:`~ringmpi.parallel.route_plan.Runs`: the positions and segment ids of gathered rows).
    q_pos, kv_pos, seg_q, seg_kv, spec, grad_dtype, timeout, phase, order : as for ``RingSchedule``.
    """

    def __init__(self, comm, backend, kh, vh, *, kv_counts: Sequence[int], kv_runs, q_pos: np.ndarray,
                 kv_pos: np.ndarray, spec: ScoreSpec, seg_q: Optional[np.ndarray] = None,
                 seg_kv: Optional[np.ndarray] = None, grad_dtype=None, timeout: Optional[float] = None,
                 phase: str = "fwd", order: Optional[Sequence[int]] = None):
        self.backend, self.spec, self.phase = backend, spec, phase
        self.q_pos, self.seg_q, self.kv_pos, self.seg_kv = q_pos, seg_q, kv_pos, seg_kv
        self.kh, self.vh, self.kv_runs = kh, vh, list(kv_runs)
        self.ring = Ring(comm, timeout=timeout, order=order, schedule="allgather")
        self.counts = np.asarray(kv_counts, dtype=np.int64)
        self.pieces = piece_count(self.counts)
        self.bounds = np.array([piece_bounds(c, self.pieces) for c in self.counts], dtype=np.int64)  # (P, C+1)
        self.batch, self.kv_heads, _, self.dim = kh.shape
        self.dim_v = vh.shape[3]
        self.dtype = np.dtype(kh.dtype)
        self._grad_dtype = None if grad_dtype is None else np.dtype(grad_dtype)
        self._finished = None

    @property
    def records(self):
        """One :class:`ringmpi.parallel.ring.StepRecord` per step (plus the gradients' return)."""
        return self.ring.records

    @property
    def steps(self) -> int:
        """Blocks of one pass (own block, then every other rank's pieces): what observers hear."""
        return 1 + self.pieces * (self.ring.size - 1)

    def compute(self, fn, *args, **kwargs):
        """Run the block op ``fn(*args, tick=..., **kwargs)`` as this step's timed compute."""
        return observed_compute(self.backend, self.ring, self.phase, fn, *args, **kwargs)

    # ------------------------------------------------------------------ messages
    def _views(self, msg, offsets, rank: int, rows: int, dtype):
        """``(k, v)`` of ``rank``'s chunk in a piece message (K chunk then V chunk per rank)."""
        itemsize = np.dtype(dtype).itemsize
        base = int(offsets[rank]) * self.batch * self.kv_heads * (self.dim + self.dim_v) * itemsize
        k = msg.view(base, (self.batch, self.kv_heads, rows, self.dim), dtype)
        v = msg.view(base + k.nbytes, (self.batch, self.kv_heads, rows, self.dim_v), dtype)
        return k, v

    def _row_bytes(self, dtype) -> int:
        return self.batch * self.kv_heads * (self.dim + self.dim_v) * np.dtype(dtype).itemsize

    def _post_gather(self, c: int) -> _Piece:
        from mpi4py import MPI

        ring, be = self.ring, self.backend
        rows = self.bounds[:, c + 1] - self.bounds[:, c]
        gb = 0 if self._grad_dtype is None else self._row_bytes(self._grad_dtype)
        piece = _Piece(be, rows, self._row_bytes(self.dtype), gb)
        lo, hi = int(self.bounds[ring.rank, c]), int(self.bounds[ring.rank, c + 1])
        mine = hi - lo
        # this rank's chunk written straight into its slot: gathered in place (no send copy)
        k_out, v_out = self._views(piece.msg, piece.offsets, ring.rank, mine, self.dtype)
        k_out[...] = self.kh[:, :, lo:hi]
        v_out[...] = self.vh[:, :, lo:hi]
        piece.msg.ready_to_send(dirty=True)
        counts = [int(r) * piece.row_bytes for r in rows]
        displs = [int(o) * piece.row_bytes for o in piece.offsets[:-1]]
        request = ring.comm.Iallgatherv(MPI.IN_PLACE, [piece.msg.mpi_buffer(), (counts, displs), MPI.BYTE])
        ring.post_collective(f"gather{c}", request, "Iallgatherv over", sent=mine * piece.row_bytes,
                             received=sum(counts) - counts[ring.rank])
        return piece

    def _slot(self, src: int) -> int:
        """Where rank ``src``'s returned sums lie among the other ranks' (rank order, this one left out)."""
        return src - (src > self.ring.rank)

    def _post_return(self, c: int, piece: _Piece) -> None:
        """Piece ``c``'s partial sums back to their owners (one ``Ialltoallv``)."""
        from mpi4py import MPI

        ring, be = self.ring, self.backend
        size, rank, gb = ring.size, ring.rank, piece.grad_row_bytes
        mine = int(piece.rows[rank])
        send_counts = [0 if r == rank else int(piece.rows[r]) * gb for r in range(size)]
        send_displs = [int(o) * gb for o in piece.offsets[:-1]]
        recv_counts = [0 if r == rank else mine * gb for r in range(size)]
        recv_displs = [self._slot(r) * mine * gb for r in range(size)]
        piece.grads_in = be.message((size - 1) * mine * gb)  # no slot for this rank's own
        piece.grads.ready_to_send(dirty=True)
        request = ring.comm.Ialltoallv([piece.grads.mpi_buffer(), (send_counts, send_displs), MPI.BYTE],
                                       [piece.grads_in.mpi_buffer(), (recv_counts, recv_displs), MPI.BYTE])
        ring.post_collective(f"return{c}", request, "Ialltoallv over", sent=sum(send_counts),
                             received=sum(recv_counts))

    def _add_returned(self, c: int, piece: _Piece, home) -> None:
        """Wait for piece ``c``'s returned sums and add them, sources in ring order."""
        ring = self.ring
        ring.wait(f"return{c}")
        piece.grads_in.arrived()
        mine = int(piece.rows[ring.rank])
        if not mine:
            piece.grads = piece.grads_in = None
            return
        lo, hi = int(self.bounds[ring.rank, c]), int(self.bounds[ring.rank, c + 1])
        offsets = np.arange(ring.size, dtype=np.int64) * mine
        for t in range(1, ring.size):
            dk, dv = self._views(piece.grads_in, offsets, self._slot(ring.source(t)), mine, self._grad_dtype)
            home[0][:, :, lo:hi] += dk
            home[1][:, :, lo:hi] += dv
        piece.grads = piece.grads_in = None

    # ------------------------------------------------------------------ the pass
    def __iter__(self) -> Iterator[Block]:
        ring, be = self.ring, self.backend
        backward = self._grad_dtype is not None
        home = None
        if backward:
            home = (be.xp.zeros(self.kh.shape, dtype=self._grad_dtype),
                    be.xp.zeros(self.vh.shape, dtype=self._grad_dtype))
        ring.record(0)
        fault_point(self.phase, ring.rank, 0)
        pieces = [self._post_gather(c) for c in range(self.pieces)]
        block = Block(0, ring.rank, self.kh, self.vh,
                      BlockMask(self.spec, self.q_pos, self.kv_pos, self.seg_q, self.seg_kv))
        if backward:
            block.dk, block.dv = home
        yield block
        steps_done(self.phase, 0, self.steps)
        for c, piece in enumerate(pieces):
            for t in range(1, ring.size):
                ring.next_step()
                if t == 1:
                    with be.annotate(f"allgather piece {c} wait"):
                        ring.wait(f"gather{c}")
                    piece.msg.arrived()
                    if backward:
                        piece.grads = be.message(int(piece.offsets[-1]) * piece.grad_row_bytes)
                fault_point(self.phase, ring.rank, ring.step)
                src = ring.source(t)
                rows = int(piece.rows[src])
                if rows:
                    k, v = self._views(piece.msg, piece.offsets, src, rows, self.dtype)
                    lo = int(self.bounds[src, c])
                    kv_pos, seg_kv = self.kv_runs[src].positions(np.arange(lo, lo + rows, dtype=np.int64))
                    block = Block(ring.step, src, k, v, BlockMask(self.spec, self.q_pos, kv_pos, self.seg_q, seg_kv))
                    if backward:
                        block.dk, block.dv = self._views(piece.grads, piece.offsets, src, rows, self._grad_dtype)
                        block.dk[...] = 0
                        block.dv[...] = 0
                    yield block
                steps_done(self.phase, ring.step, self.steps)
            piece.msg = block = None  # this piece's K/V are folded in
            if backward and ring.size > 1:
                self._post_return(c, piece)
                if c:  # the previous piece's sums had this piece's compute to arrive: at most two live
                    self._add_returned(c - 1, pieces[c - 1], home)
        if backward:
            ring.next_step()  # the last piece's partial sums come home
            if ring.size > 1:
                self._add_returned(self.pieces - 1, pieces[-1], home)
            self._finished = home
        ring.wait_all()

    def finished_grads(self):
        """``(dk (B, H_kv, S_local, D), dv (B, H_kv, S_local, D_v))`` compute dtype: this rank's finished,
        unscaled K/V gradients, once iteration has ended."""
        if self._finished is None:
            raise RuntimeError("finished_grads() needs a schedule with grad_dtype, iterated to its end")
        return self._finished
