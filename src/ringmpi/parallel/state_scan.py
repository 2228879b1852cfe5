"""The ranks' exclusive scan of state maps: what state enters each rank's shard.

Rank ``r`` holds the map of its shard, ``S -> M_r S + U_r`` (``core/state_maps.py``); the state
entering it is the composition of the maps of the ranks before it applied to zero, an
exclusive prefix scan under a composition that does not commute.  It runs as a log-step scan
over point to point (Hillis-Steele): in round ``d = 1, 2, 4, ...`` a rank sends what it has
composed so far to the rank ``d`` after it and folds in what arrives from the rank ``d``
before, so ``ceil(log2 P)`` rounds, each one map (``K (K + V)`` numbers per row and head for a
dense map: independent of the sequence length).  ``reverse=True`` scans from the last rank
down, the backward's ``dS_in = M^T dS_out + c``.  Every wait has the ring's deadline
(``ring.poll_until``), so a lost peer is a :class:`RingTimeout`, never a hang.
"""

from __future__ import annotations

import time
from typing import Optional, Tuple

import numpy as np

from ..core.state_maps import StateMap, pack, then, unpack
from ..runtime.watchdog import deadline
from .ring import poll_until

_TAGS = {False: 7201, True: 7202}  # the forward's scan, the backward's reverse scan


def exclusive_scan(comm, smap: StateMap, reverse: bool = False,
                   timeout: Optional[float] = None) -> Tuple[np.ndarray, int]:
    """``(u_in, bytes_received)``: the state entering this rank, ``(R, H, K, V)`` like
    ``smap.u``, zero on the first rank (the last one with ``reverse``).  Collective."""
    from mpi4py import MPI

    size, rank = comm.Get_size(), comm.Get_rank()
    order = (lambda r: size - 1 - r) if reverse else (lambda r: r)  # virtual rank <-> rank, both ways
    me = order(rank)
    limit = deadline(timeout)
    inclusive, before, received = smap, None, 0
    step = 1
    while step < size:
        outgoing = pack(inclusive)
        incoming = np.empty_like(outgoing)
        requests, peers = [], []
        if me + step < size:
            requests.append(comm.Isend([outgoing, MPI.BYTE], dest=order(me + step), tag=_TAGS[reverse]))
            peers.append(f"send to {order(me + step)}")
        if me - step >= 0:
            requests.append(comm.Irecv([incoming, MPI.BYTE], source=order(me - step), tag=_TAGS[reverse]))
            peers.append(f"receive from {order(me - step)}")
        start = time.perf_counter()
        poll_until(lambda: MPI.Request.Testall(requests), start, limit,
                   lambda: f"rank {rank}: the state scan's round {step} ({', '.join(peers)}) did not finish "
                           f"within {limit} s")
        if me - step >= 0:
            arrived = unpack(smap.kind, incoming, smap.u.shape)
            received += incoming.nbytes
            before = arrived if before is None else then(arrived, before)
            inclusive = then(arrived, inclusive)
        step *= 2
    return (np.zeros_like(smap.u) if before is None else before.u), received
