"""The memory budget of one rank: what a schedule holding O(N) per rank may use.

``RINGMPI_MEMORY_BUDGET`` (bytes per rank, read by :func:`ringmpi.runtime.env.memory_budget`)
sets it; unset, it is the free memory of where the arrays live:
the device's free memory for device arrays, else the host's available memory
(``MemAvailable``) shared by the ranks on this host (the MPI launcher's local
size).  :func:`ringmpi.parallel.allgather_schedule.declared_bytes` is measured
against it; the ring never is (it holds a fixed number of shards whatever P).
"""

from __future__ import annotations

import os
from typing import Optional

from . import env

_LOCAL_SIZE = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "MV2_COMM_WORLD_LOCAL_SIZE",
               "SLURM_NTASKS_PER_NODE")


def host_available() -> Optional[int]:
    """The host's ``MemAvailable`` in bytes (Linux), else None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def local_ranks() -> int:
    """Ranks the launcher put on this host (1 when it does not say)."""
    for name in _LOCAL_SIZE:
        text = os.environ.get(name, "")
        if text.isdigit() and int(text) > 0:
            return int(text)
    return 1


def budget(on_device: bool = False) -> Optional[int]:
    """This rank's budget in bytes: the setting, else its share of the free memory; None when
    neither is known (then nothing is refused)."""
    given = env.memory_budget()
    if given is not None:
        return given
    if on_device:
        import cupy

        return int(cupy.cuda.runtime.memGetInfo()[0])
    free = host_available()
    return None if free is None else free // local_ranks()
