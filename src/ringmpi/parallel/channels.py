"""The ring's message channels: the double-buffered K/V messages and the dK/dV partial sums.

:class:`KVChannel` owns the two K/V slots of a call (each carries the block's keys and values and
its global positions and segment ids); :class:`GradChannel` the whole-message ``dK, dV`` partial
sums of device memory (three buffers); :class:`HostGradChannel` those of host memory (two buffers,
the sums arriving, added to and sent on in ``GRAD_PIECES`` pieces of rows, each one MPI datatype).
:class:`~ringmpi.parallel.ring_schedule.RingSchedule` drives them step by step.
"""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np

from ..backends import HostMessage
from .ring import Ring, TypedPart

GRAD_PIECES = 8  # host memory: dK/dV partial sums move in this many pieces of rows


class KVChannel:
    """The double-buffered K/V messages of one call (allocated once).

    Each of the two slots is a backend message with ``K`` ``(B, H_kv, rows, D)``
    then ``V`` ``(B, H_kv, rows, D_v)`` (transfer dtype) and a host message of int64
    with the block's global positions ``(rows,)`` then, with segment ids,
    ``(B, rows)`` segment ids.  Both parts travel as one ring message on
    channel ``"kv"``.
    """

    def __init__(self, ring: Ring, backend, counts: np.ndarray, kh, vh, pos: np.ndarray,
                 seg: Optional[np.ndarray]):
        self.ring, self.backend = ring, backend
        self.counts = counts
        self.batch, self.kv_heads, _, self.dim = kh.shape
        self.dim_v = vh.shape[3]
        self.dtype = kh.dtype
        self.itemsize = np.dtype(kh.dtype).itemsize
        self.has_seg = seg is not None
        rows = int(counts.max())
        slots = 2 if ring.size > 1 else 1  # a lone rank keeps its own block: nothing to receive
        self.msgs = [backend.message(self.nbytes(rows)) for _ in range(slots)]
        self.meta = [HostMessage(self.meta_nbytes(rows)) for _ in range(slots)]
        k0, v0 = self.views(0, ring.rank)
        k0[...] = kh
        v0[...] = vh
        pos0, seg0 = self.meta_views(0, ring.rank)
        pos0[...] = pos
        if self.has_seg:
            seg0[...] = seg

    def nbytes(self, rows: int) -> int:
        return self.k_nbytes(rows) + self.batch * self.kv_heads * rows * self.dim_v * self.itemsize

    def k_nbytes(self, rows: int) -> int:
        """Bytes of the K part of a ``rows``-row message (V starts there)."""
        return self.batch * self.kv_heads * rows * self.dim * self.itemsize

    def meta_nbytes(self, rows: int) -> int:
        return 8 * rows * (1 + (self.batch if self.has_seg else 0))

    def views(self, slot: int, src: int):
        """``(k, v)`` of ring rank ``src``'s block in ``slot``."""
        shape = (self.batch, self.kv_heads, int(self.counts[src]), self.dim)
        shape_v = shape[:3] + (self.dim_v,)
        msg = self.msgs[slot]
        return msg.view(0, shape, self.dtype), msg.view(self.k_nbytes(shape[2]), shape_v, self.dtype)

    def meta_views(self, slot: int, src: int):
        """``(positions (rows,), segment ids (B, rows) or None)`` of ``src``'s block in ``slot``."""
        rows = int(self.counts[src])
        meta = self.meta[slot]
        pos = meta.view(0, (rows,), np.int64)
        seg = meta.view(8 * rows, (self.batch, rows), np.int64) if self.has_seg else None
        return pos, seg

    def begin_step(self, step: int) -> Tuple[int, int]:
        """Make step ``step``'s block current and start moving the next; return ``(slot, src)``."""
        ring, slot = self.ring, step % 2
        src = ring.source(step)
        cur = self.msgs[slot]
        if step > 0:
            cur.arrived()
        if step < ring.size - 1:
            cur.ready_to_send(dirty=(step == 0))
            nxt = ring.source(step + 1)
            rows_cur, rows_nxt = int(self.counts[src]), int(self.counts[nxt])
            send = [cur.mpi_buffer()[: self.nbytes(rows_cur)],
                    self.meta[slot].mpi_buffer()[: self.meta_nbytes(rows_cur)]]
            recv = [self.msgs[1 - slot].mpi_buffer()[: self.nbytes(rows_nxt)],
                    self.meta[1 - slot].mpi_buffer()[: self.meta_nbytes(rows_nxt)]]
            ring.post("kv", send=send, recv=recv)
        return slot, src


class GradChannel:
    """The ``dK, dV`` partial sums travelling one step behind the K/V as whole messages
    (compute dtype): the channel of device memory.

    Two outgoing buffers (one may still be on its way while the next is
    filled) and one incoming, each ``dK`` ``(B, H_kv, rows, D)`` then ``dV``
    ``(B, H_kv, rows, D_v)`` (``dim_v``, default ``dim``).  At each step the
    block op adds this rank's terms into the zeroed outgoing buffer, then the
    partial sums that arrived from ``prev`` are added and the total goes on.
    Channels ``"grad_out0"``, ``"grad_out1"`` and ``"grad_in"`` share the
    stream ``"grad"``.
    """

    def __init__(self, ring: Ring, backend, counts: np.ndarray, batch: int, kv_heads: int, dim: int,
                 dtype, dim_v: Optional[int] = None):
        rows = self._shapes(ring, counts, batch, kv_heads, dim, dtype, dim_v)
        lone = ring.size == 1  # a lone rank's sums are finished where they are computed
        self.out = [backend.message(self.nbytes(rows)) for _ in range(1 if lone else 2)]
        self.incoming = None if lone else backend.message(self.nbytes(rows))

    def _shapes(self, ring, counts, batch, kv_heads, dim, dtype, dim_v) -> int:
        """Keep the ring and the message shapes; return the largest block's rows."""
        self.ring, self.counts = ring, counts
        self.batch, self.kv_heads, self.dim, self.dtype = batch, kv_heads, dim, np.dtype(dtype)
        self.dim_v = dim if dim_v is None else int(dim_v)
        return int(counts.max())

    def nbytes(self, rows: int) -> int:
        return self.dk_nbytes(rows) + self.batch * self.kv_heads * rows * self.dim_v * self.dtype.itemsize

    def dk_nbytes(self, rows: int) -> int:
        """Bytes of the ``dK`` part of a ``rows``-row message (``dV`` starts there)."""
        return self.batch * self.kv_heads * rows * self.dim * self.dtype.itemsize

    def views(self, msg, src: int):
        shape = (self.batch, self.kv_heads, int(self.counts[src]), self.dim)
        shape_v = shape[:3] + (self.dim_v,)
        return msg.view(0, shape, self.dtype), msg.view(self.dk_nbytes(shape[2]), shape_v, self.dtype)

    def begin_step(self, step: int, src: int):
        """Post the receive of ``src``'s partial sums (after step 0) and return this
        step's zeroed outgoing ``(dk, dv)`` and no row callbacks (``{}``)."""
        ring = self.ring
        if step > 0:  # partial dK/dV of this block, from the ranks that saw it before
            ring.post("grad_in", recv=self.incoming.mpi_buffer()[: self.nbytes(int(self.counts[src]))],
                      stream="grad")
        ring.wait(f"grad_out{step % 2}")  # its buffer may still be on its way from two steps ago
        dk, dv = self.views(self.out[step % 2], src)
        dk[...] = 0
        dv[...] = 0
        return dk, dv, {}

    def end_step(self, step: int, src: int, dk, dv) -> None:
        """Add the partial sums that arrived for ``src``'s block and send the total on."""
        ring = self.ring
        if ring.size == 1:  # a lone rank's sums are finished where they are
            return
        if step > 0:
            ring.wait("grad_in")
            self.incoming.arrived()
            dk_in, dv_in = self.views(self.incoming, src)
            dk += dk_in
            dv += dv_in
        out = self.out[step % 2]
        out.ready_to_send(dirty=True)
        ring.post(f"grad_out{step % 2}", send=out.mpi_buffer()[: self.nbytes(int(self.counts[src]))],
                  stream="grad")

    def receive_home(self):
        """The finished ``(dk, dv)`` of this rank's own block, after one more hop."""
        ring = self.ring
        if ring.size == 1:  # already home: an empty record for the hop
            ring.record(ring.step)
            return self.views(self.out[0], ring.rank)
        ring.post("grad_in", recv=self.incoming.mpi_buffer()[: self.nbytes(int(self.counts[ring.rank]))],
                  stream="grad")
        ring.wait("grad_in")
        self.incoming.arrived()
        ring.wait_all()
        return self.views(self.incoming, ring.rank)


class HostGradChannel(GradChannel):
    """The ``dK, dV`` partial sums in host memory: two buffers, each received into, added to
    in place and sent on, in pieces of rows.

    At step ``s`` the partial sums of the block (from the ranks that saw it before) arrive
    from ``prev`` into buffer ``s % 2`` in up to ``GRAD_PIECES`` pieces of rows (each one
    message: an MPI datatype over its rows of every batch entry, head, ``dK``/``dV``); the
    block op sums this rank's terms of a key tile in scratch and adds them onto the partial
    sums in place once the tile is done, asking first for its rows (``kv_need(n)``: the
    pieces holding rows below ``n`` have arrived), and reports the rows that are final
    (``kv_done(n)``: the pieces below ``n`` go on to ``next`` at once, while the rest is
    computed).  Step 0's buffer starts at zero; after the last step this rank's own
    finished sums arrive the same way into buffer ``P % 2``.  A buffer is received into
    again once its sends of the step before have completed: the receives of step ``s + 1``
    are posted during step ``s`` when they can be, so the sums move while the rank
    computes.  Against :class:`GradChannel` a rank holds two ``dK, dV`` buffers, not
    three (and the block op one key tile of scratch), with bitwise the same sums.
    """

    def __init__(self, ring: Ring, backend, counts: np.ndarray, batch: int, kv_heads: int, dim: int,
                 dtype, dim_v: Optional[int] = None):
        rows = self._shapes(ring, counts, batch, kv_heads, dim, dtype, dim_v)
        self.bufs = [HostMessage(self.nbytes(rows)) for _ in range(1 if ring.size == 1 else 2)]
        self._types = {}            # (rows, lo, hi) -> the MPI datatype of that piece
        self._sends = [[], []]      # each buffer's pending send channels
        self._recv_step = [None, None]  # the step each buffer's posted receives are for
        self._pieces = []           # this step's pieces (row bounds)
        self._arrived = 0           # this step's pieces received so far
        self._sent = 0              # this step's pieces sent on so far
        self._step = None

    def pieces(self, rows: int):
        """Row bounds ``[(lo, hi), ...]`` of the pieces of a ``rows``-row block."""
        cuts = np.linspace(0, rows, min(rows, GRAD_PIECES) + 1).astype(np.int64)
        return [(int(lo), int(hi)) for lo, hi in zip(cuts[:-1], cuts[1:])]

    def _piece(self, msg, rows: int, lo: int, hi: int) -> TypedPart:
        """Rows ``[lo, hi)`` of ``dK`` then ``dV`` in ``msg`` (one part per batch entry, head and
        tensor) as one message: an MPI ``hindexed`` type, made once per row range of a call."""
        key = (rows, lo, hi)
        datatype = self._types.get(key)
        if datatype is None:
            from mpi4py import MPI

            item, lengths, offsets = self.dtype.itemsize, [], []
            for base, dim in ((0, self.dim), (self.dk_nbytes(rows), self.dim_v)):
                for bh in range(self.batch * self.kv_heads):
                    offsets.append(base + (bh * rows + lo) * dim * item)
                    lengths.append((hi - lo) * dim * item)
            datatype = self._types[key] = MPI.BYTE.Create_hindexed(lengths, offsets).Commit()
        return TypedPart(msg.mpi_buffer(), datatype)

    def free(self) -> None:
        """Free the pieces' MPI datatypes (once every transfer has completed)."""
        for datatype in self._types.values():
            datatype.Free()
        self._types.clear()

    def _rows(self, step: int) -> int:
        """Rows of the block a rank holds at ``step`` (``P``: its own block, home)."""
        return int(self.counts[self.ring.source(step)])

    def _post_receive(self, step: int, wait: bool) -> None:
        """Post the receives of ``step``'s partial sums into buffer ``step % 2`` once its sends
        have completed (``wait``: wait for them; else post only if they have)."""
        slot = step % 2
        if self._recv_step[slot] == step:
            return
        sends = self._sends[slot]
        if wait:
            for name in sends:
                self.ring.wait(name)
        elif not all(self.ring.test(name) for name in sends):
            return
        sends.clear()
        rows = self._rows(step)
        for i, (lo, hi) in enumerate(self.pieces(rows)):
            self.ring.post(f"grad_recv{slot}_{i}", recv=self._piece(self.bufs[slot], rows, lo, hi),
                           stream="grad")
        self._recv_step[slot] = step

    def begin_step(self, step: int, src: int):
        """This step's ``(dk, dv)`` (the partial sums as they arrive; zero at step 0) and the
        block op's row callbacks ``{"kv_need": ..., "kv_done": ...}``."""
        self._step, self._arrived, self._sent = step, 0, 0
        self._pieces = self.pieces(self._rows(step))
        dk, dv = self.views(self.bufs[step % 2], src)
        if step == 0 or self.ring.size == 1:
            dk[...] = 0
            dv[...] = 0
            self._arrived = len(self._pieces)
        else:
            self._post_receive(step, wait=True)
        if self.ring.size == 1:
            return dk, dv, {}
        return dk, dv, {"kv_need": self.kv_need, "kv_done": self.kv_done}

    def kv_need(self, n: int) -> None:
        """Return once the partial sums of rows ``[0, n)`` of this step's block have arrived."""
        step, pieces = self._step, self._pieces
        while self._arrived < len(pieces) and pieces[self._arrived][0] < n:
            self.ring.wait(f"grad_recv{step % 2}_{self._arrived}")
            self._arrived += 1
        if self._arrived == len(pieces):
            self._recv_step[step % 2] = None

    def kv_done(self, n: int) -> None:
        """Rows ``[0, n)`` of this step's ``dk, dv`` are final: send their pieces on."""
        step, ring, pieces = self._step, self.ring, self._pieces
        slot, rows = step % 2, self._rows(step)
        self.kv_need(n)
        while self._sent < len(pieces) and pieces[self._sent][1] <= n:
            lo, hi = pieces[self._sent]
            name = f"grad_send{slot}_{self._sent}"
            ring.post(name, send=self._piece(self.bufs[slot], rows, lo, hi), stream="grad")
            self._sends[slot].append(name)
            self._sent += 1
        self._post_receive(step + 1, wait=False)  # the next step's sums may come now

    def end_step(self, step: int, src: int, dk, dv) -> None:
        """Send on what the block op did not report final (all of it, when it reported nothing)."""
        if self.ring.size > 1:
            self.kv_done(self._rows(step))

    def receive_home(self):
        """The finished ``(dk, dv)`` of this rank's own block, after one more hop."""
        ring = self.ring
        if ring.size == 1:  # already home: an empty record for the hop
            ring.record(ring.step)
            return self.views(self.bufs[0], ring.rank)
        home = ring.size
        self._post_receive(home, wait=True)
        self._step, self._arrived = home, 0
        self._pieces = self.pieces(self._rows(home))
        self.kv_need(self._rows(home))
        ring.wait_all()
        self.free()
        return self.views(self.bufs[home % 2], ring.rank)
