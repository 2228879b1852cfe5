"""A slow inter-node link for ``ringmpi bench --inter-node-gbps X`` (bench only).

One machine has no slow links, so the benchmark can model one: every
transfer between ranks on different (pretend, ``RINGMPI_NODE_SIZE``) nodes
completes no earlier than ``bytes * 8 / (X * 1e9)`` seconds after it was
posted -- a link of ``X`` Gbit/s in each direction, each rank's remote sends
(and, separately, its remote receives) of one message sharing it.  The wait
that finds the transfer done too early sleeps the rest, and that time counts
as waiting, so the ring's overlap of transfer and compute is modelled as it
would happen: a transfer hides when the compute takes longer than the link.

:func:`install` wraps :meth:`ringmpi.ring.Ring.post`/``wait`` and
:meth:`ringmpi.head_parallel.GroupExchange.wait` for this process and returns
the function that restores them; the library's own code path has no trace of it.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence


class _Nodes:
    """Node of a peer, for sub-communicators of the benchmark's communicator."""

    def __init__(self, base_comm, nodes: Sequence[int]):
        self.base_group = base_comm.Get_group()
        self.nodes = list(nodes)
        self.mine = self.nodes[base_comm.Get_rank()]

    def remote(self, comm) -> Callable[[int], bool]:
        """``remote(peer)``: whether rank ``peer`` of ``comm`` sits on another node than this rank."""
        from mpi4py import MPI

        group = comm.Get_group()
        try:
            base = MPI.Group.Translate_ranks(group, list(range(comm.Get_size())), self.base_group)
        finally:
            group.Free()
        far = [self.nodes[b] != self.mine for b in base]
        return far.__getitem__


def _hold_until(ready: float) -> float:
    """Sleep until ``ready`` (perf_counter seconds); return the seconds slept."""
    extra = ready - time.perf_counter()
    if extra > 0:
        time.sleep(extra)
        return extra
    return 0.0


def install(base_comm, gbps: float, nodes: Sequence[int]) -> Callable[[], None]:
    """Model links of ``gbps`` Gbit/s between the nodes ``nodes`` (node of each rank of
    ``base_comm``) for every ring and group all-to-all on sub-communicators of
    ``base_comm``; returns the function that removes the model."""
    from ..head_parallel import GroupExchange
    from ..ring import Ring

    where = _Nodes(base_comm, nodes)
    seconds_per_byte = 8.0 / (gbps * 1e9)
    real_post, real_wait, real_exchange_wait = Ring.post, Ring.wait, GroupExchange.wait

    def post(self, channel, send=None, recv=None, stream=None):
        real_post(self, channel, send=send, recv=recv, stream=stream)
        if not hasattr(self, "_link_remote"):
            self._link_remote, self._link_posted = where.remote(self.comm), {}
        self._link_posted[channel] = time.perf_counter()

    def wait(self, channel):
        transfers = self._pending.get(channel)
        posted = getattr(self, "_link_posted", {}).pop(channel, None)
        real_wait(self, channel)
        if not transfers or posted is None:
            return
        sent = sum(t.nbytes for t in transfers if t.direction == "send to" and self._link_remote(t.peer))
        recv = sum(t.nbytes for t in transfers if t.direction == "recv from" and self._link_remote(t.peer))
        self.record(self.step).wait_s += _hold_until(posted + max(sent, recv) * seconds_per_byte)

    def exchange_wait(self, request, stage, start, send_counts, recv_counts):
        real_exchange_wait(self, request, stage, start, send_counts, recv_counts)
        if not hasattr(self, "_link_remote"):
            self._link_remote = where.remote(self.comm)
        sent = sum(c for u, c in enumerate(send_counts) if self._link_remote(u))
        recv = sum(c for u, c in enumerate(recv_counts) if self._link_remote(u))
        _hold_until(start + max(sent, recv) * seconds_per_byte)  # the exchange's record counts it

    Ring.post, Ring.wait, GroupExchange.wait = post, wait, exchange_wait

    def uninstall():
        Ring.post, Ring.wait, GroupExchange.wait = real_post, real_wait, real_exchange_wait
    return uninstall
