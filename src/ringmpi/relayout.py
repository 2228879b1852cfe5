"""Move tokens between layouts in one collective: contiguous shards for the linear-attention
layers, zigzag or balanced ones for the attention layers, and back.

A hybrid model's softmax layers want a layout that balances causal work (zigzag, balanced),
its recurrent layers (gated delta rule, Mamba-2, their convolutions) contiguous shards in rank
order; ``relayout(x, source, target)`` hands each rank its tokens under ``target`` given
its tokens under ``source``, with one ``Alltoallv`` (each token crosses the network at most
once; local order is ascending global position, as every layout's).
"""

from __future__ import annotations

import numpy as np

from .core.host import to_host
from .core.layout import Layout
from .context import RingContext, comm_of
from .parallel.comm import resolve_comm
from .runtime.errors import agree_shards
from .runtime.watchdog import phase


def _owners(layout: Layout) -> np.ndarray:
    owner = np.empty(layout.n, dtype=np.int64)
    for r in range(layout.world_size):
        owner[layout.indices(r)] = r
    return owner


def relayout(x, source: Layout, target: Layout, *, context: Optional[RingContext] = None, axis: int = 1) -> np.ndarray:
    """This rank's tokens under ``target``, from its tokens ``x`` under ``source`` (along ``axis``,
    the token axis: 1 for ``(B, T, ...)``).  Collective; NumPy arrays (any dtype)."""
    from mpi4py import MPI

    comm = resolve_comm(comm_of(context))
    x = np.asarray(to_host(x))
    rank, size = comm.Get_rank(), comm.Get_size()
    problem = None
    if (source.n, source.world_size) != (target.n, target.world_size) or source.world_size != size:
        problem = (f"source and target layouts must have one n and the communicator's size {size}, got "
                   f"{source!r} and {target!r}")
    elif not -x.ndim <= axis < x.ndim or x.shape[axis] != len(source.indices(rank)):
        problem = f"x's axis {axis} must hold this rank's {len(source.indices(rank))} tokens, got shape {x.shape}"
    rows = None if problem else np.moveaxis(x, axis, 0)
    signature = None if problem else (repr(source), repr(target), rows.shape[1:], x.dtype.str, axis % x.ndim)
    agree_shards(comm, problem, signature, 0, "the layouts, the shape beyond the token axis or the dtype")
    row_bytes = int(np.prod(rows.shape[1:], dtype=np.int64)) * x.dtype.itemsize
    dest = _owners(target)[source.indices(rank)]
    order = np.argsort(dest, kind="stable")
    send = np.ascontiguousarray(rows[order])
    mine = target.indices(rank)
    origin = _owners(source)[mine]
    arrival = np.argsort(origin, kind="stable")
    send_counts = np.bincount(dest, minlength=size) * row_bytes
    recv_counts = np.bincount(origin, minlength=size) * row_bytes
    recv = np.empty((len(mine),) + rows.shape[1:], x.dtype)
    displ = lambda c: np.concatenate([[0], np.cumsum(c)[:-1]])  # noqa: E731
    with phase("relayout (Alltoallv)"):
        comm.Alltoallv([send, (send_counts, displ(send_counts)), MPI.BYTE],
                       [recv, (recv_counts, displ(recv_counts)), MPI.BYTE])
    out = np.empty_like(recv)
    out[arrival] = recv
    return np.moveaxis(out, 0, axis)
