"""torch.distributed bootstrapped from an MPI communicator.

Under ``mpirun``/``srun`` the ranks already know each other through MPI;
:func:`init_process_group` starts ``torch.distributed`` (gloo by default) over
the same ranks, in the same order, without ``torchrun`` or environment
variables: rank 0 of ``comm`` opens a TCP rendezvous on a free port of its
host and broadcasts the address.  Then DDP/FSDP and ``torch.distributed``
collectives work as usual beside ringmpi (which keeps using MPI), for example
data parallelism across replicas that each run context parallelism with
ringmpi (``jobs/train_data_context_parallel.py``).

Importing this module imports torch; ``import ringmpi`` does not.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from .parallel.comm import resolve_comm
from .runtime.watchdog import phase

__all__ = ["init_process_group", "new_group"]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def init_process_group(comm=None, backend: str = "gloo", timeout: Optional[float] = None) -> None:
    """Collective over ``comm``: ``torch.distributed.init_process_group`` over the same ranks.

    ``comm`` (default: a library-owned duplicate of ``COMM_WORLD``) gives the
    world: torch's rank and world size are ``comm``'s.  ``backend`` as torch's
    (``"gloo"`` for CPU tensors, ``"nccl"`` for CUDA); ``timeout`` in seconds.
    """
    comm = resolve_comm(comm)
    address = None
    if comm.Get_rank() == 0:
        address = (socket.gethostbyname(socket.gethostname()), _free_port())
    with phase("torch.distributed: rank 0's rendezvous address (bcast)"):
        host, port = comm.bcast(address, root=0)
    kw = {} if timeout is None else {"timeout": timedelta(seconds=timeout)}
    with phase(f"torch.distributed: the {backend} rendezvous (init_process_group)", timeout):
        dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=comm.Get_rank(),
                                world_size=comm.Get_size(), **kw)


def new_group(comm, color: int):
    """Collective over ``comm`` (the world of :func:`init_process_group`): the torch process
    group of the ranks with the same ``color`` (like ``comm.Split(color)``), ranks in ``comm``
    order.  Every group is made on every rank, as torch requires; returns this rank's."""
    with phase("torch.distributed: the ranks' group colors (allgather)"):
        colors = comm.allgather(int(color))
    mine = None
    with phase("torch.distributed: making the process groups (new_group)"):
        for c in sorted(set(colors)):
            group = dist.new_group([r for r, x in enumerate(colors) if x == c])
            if c == color:
                mine = group
    return mine
