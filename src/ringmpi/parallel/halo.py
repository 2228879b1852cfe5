"""The halo of a contiguous shard: the ``width`` tokens before its first one, from their owners.

Shards are contiguous in rank order with the lengths every rank agreed on; the tokens
``[start - width, start)`` may live on several earlier ranks (short or empty shards), so the
plan pairs every rank with each later rank whose halo overlaps its shard, from the lengths
alone.  :func:`exchange` brings the halo (zeros before position 0); :func:`send_back` returns
a halo's gradient to the owners, who add it to theirs.  Point to point, every wait under the
ring's deadline.
"""

from __future__ import annotations

import time
from typing import List, Optional, Sequence, Tuple

import numpy as np

from ..runtime.watchdog import deadline
from .ring import poll_until

_TAGS = {"halo": 7301, "halo_grad": 7302}


def plan(lengths: Sequence[int], rank: int, width: int) -> Tuple[List[tuple], List[tuple]]:
    """``(receives, sends)``: ``(peer, local lo, local hi in the peer's shard, halo lo)`` for each
    piece of this rank's halo, and ``(peer, local lo, local hi, peer's halo lo)`` for each piece
    of this shard in a later rank's halo."""
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(int)

    def pieces(r):
        lo, out = starts[r] - width, []
        for i in range(r):
            a, b = max(starts[i], lo), min(starts[i + 1], starts[r])
            if a < b:
                out.append((i, a - starts[i], b - starts[i], a - lo))
        return out

    receives = pieces(rank)
    sends = [(j, a, b, h) for j in range(rank + 1, len(lengths)) for (i, a, b, h) in pieces(j) if i == rank]
    return receives, sends


def _run(comm, posted, what, timeout):
    from mpi4py import MPI

    limit = deadline(timeout)
    requests = [r for r, _ in posted]
    if requests:
        poll_until(lambda: MPI.Request.Testall(requests), time.perf_counter(), limit,
                   lambda: f"rank {comm.Get_rank()}: the {what} exchange ({', '.join(p for _, p in posted)}) "
                           f"did not finish within {limit} s")


def exchange(comm, x, lengths: Sequence[int], width: int, timeout: Optional[float] = None) -> np.ndarray:
    """This rank's halo ``(B, width, D)`` of the shard ``x (B, T, D)``."""
    from mpi4py import MPI

    receives, sends = plan(lengths, comm.Get_rank(), width)
    halo = np.zeros((x.shape[0], width) + x.shape[2:], x.dtype)
    buffers, posted = [], []
    for peer, lo, hi, h in receives:
        buf = np.empty((x.shape[0], hi - lo) + x.shape[2:], x.dtype)
        buffers.append((buf, h))
        posted.append((comm.Irecv([buf, MPI.BYTE], source=peer, tag=_TAGS["halo"]), f"receive from {peer}"))
    outgoing = [np.ascontiguousarray(x[:, lo:hi]) for _, lo, hi, _ in sends]
    for (peer, _, _, _), buf in zip(sends, outgoing):
        posted.append((comm.Isend([buf, MPI.BYTE], dest=peer, tag=_TAGS["halo"]), f"send to {peer}"))
    _run(comm, posted, "halo", timeout)
    for buf, h in buffers:
        halo[:, h:h + buf.shape[1]] = buf
    return halo


def send_back(comm, dhalo, lengths: Sequence[int], width: int, timeout: Optional[float] = None) -> np.ndarray:
    """The gradient of this rank's shard from the later ranks' halos, ``(B, T, D)``, given this
    rank's own halo gradient ``dhalo (B, width, D)`` (sent to its owners)."""
    from mpi4py import MPI

    rank = comm.Get_rank()
    receives, sends = plan(lengths, rank, width)
    dx = np.zeros((dhalo.shape[0], lengths[rank]) + dhalo.shape[2:], dhalo.dtype)
    buffers, posted = [], []
    for peer, lo, hi, _ in sends:  # the reverse of exchange: back from where the tokens went
        buf = np.empty((dhalo.shape[0], hi - lo) + dhalo.shape[2:], dhalo.dtype)
        buffers.append((buf, lo))
        posted.append((comm.Irecv([buf, MPI.BYTE], source=peer, tag=_TAGS["halo_grad"]), f"receive from {peer}"))
    outgoing = [np.ascontiguousarray(dhalo[:, h:h + hi - lo]) for _, lo, hi, h in receives]
    for (peer, _, _, _), buf in zip(receives, outgoing):
        posted.append((comm.Isend([buf, MPI.BYTE], dest=peer, tag=_TAGS["halo_grad"]), f"send to {peer}"))
    _run(comm, posted, "halo gradient", timeout)
    for buf, lo in buffers:
        dx[:, lo:lo + buf.shape[1]] += buf
    return dx
