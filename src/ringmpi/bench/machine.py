"""The machine a ``ringmpi bench`` report ran on: environment, GEMM rate, instrumentation costs."""

from __future__ import annotations

import os
import platform
import socket
import sys
import time

from ..runtime.mpi_library import mpi_library


def reset_rss_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where that is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def status_bytes(field: str):
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def gemm_rate(be, dtype):
    """This machine's single-process GEMM rate in TFLOP/s (the backend's compute dtype)."""
    xp = be.xp
    n = 4096 if be.name == "cupy" else 1024
    a = xp.ones((n, n), dtype=be.compute_dtype(dtype))
    xp.matmul(a, a)
    be.synchronize()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        xp.matmul(a, a)
        be.synchronize()
        best = min(best, time.perf_counter() - start)
    return {"tflops": 2 * n ** 3 / best / 1e12, "n": n, "dtype": str(be.compute_dtype(dtype))}


def instrumentation_unit_costs(be):
    """Measured seconds per instrumentation operation, for the overhead account.

    The ring's instrumentation is always on, so its cost is accounted rather than
    switched off: per ring step ``timed_compute`` (measured here around a kernel that does
    nothing), the wait timer (two clock reads and a record update) and the byte
    counters of ``post``; per tile one counter increment.
    """
    from mpi4py import MPI

    from ..parallel.ring import Ring
    from ..parallel.ring_schedule import timed_compute

    ring = Ring(MPI.COMM_SELF)
    reps = 20000

    def per_call(fn):
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(reps):
                fn()
            best = min(best, (time.perf_counter() - start) / reps)
        return best

    def kernel(tick=None):
        return 1, 0

    def wait_timer():
        start = time.perf_counter()
        ring.record(0).wait_s += time.perf_counter() - start

    def byte_counters():
        rec = ring.record(0)
        rec.bytes_recv += 1
        rec.bytes_sent += 1

    class Counter:
        computed = 0

    counter = Counter()

    def tile():
        counter.computed += 1

    bare = per_call(lambda: kernel(tick=ring.tick))
    return {"timed_s": max(per_call(lambda: timed_compute(be, ring, kernel)) - bare, 0.0),
            "wait_timer_s": per_call(wait_timer), "byte_counters_s": per_call(byte_counters),
            "tile_counter_s": max(per_call(tile) - per_call(lambda: None), 0.0)}


def rank_environment() -> dict:
    """This rank's part of the environment (gathered to rank 0 for :func:`environment`); resets
    the RSS high-water mark."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "cpus": cpus(), "rss_peak_reset": reset_rss_peak()}


def environment(be, ranks, gemm, load_before) -> dict:
    """The report's environment: versions, hosts, threads, tiles, GEMM rate (``gemm_rate``) and the
    load average before (``os.getloadavg()`` of the start) and now, from every rank's
    :func:`rank_environment`."""
    import mpi4py
    import numpy as np
    from mpi4py import MPI

    from .. import __version__
    from ..backends import numpy_backend

    env = {
        "ringmpi_version": __version__, "python": sys.version.split()[0], "platform": platform.platform(),
        "mpi_library": mpi_library(),
        "mpi_standard": "%d.%d" % MPI.Get_version(), "mpi4py": mpi4py.__version__, "numpy": np.__version__,
        "backend": be.name, "hostnames": [r["host"] for r in ranks], "cpus_per_rank": [r["cpus"] for r in ranks],
        "cores": os.cpu_count(), "ranks_per_host": {h: sum(r["host"] == h for r in ranks)
                                                    for h in sorted({r["host"] for r in ranks})},
        "threads": {v: os.environ.get(v) for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")},
        "tile": {"q": numpy_backend.TILE_Q, "kv": numpy_backend.TILE_KV},
        "rss_peak_reset": all(r["rss_peak_reset"] for r in ranks), "gemm": gemm,
        "argv": sys.argv,
    }
    if be.name == "cupy":
        import cupy
        env["cupy"] = cupy.__version__
        env["gpu"] = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
    # other work on the same cores distorts every figure: record it next to them
    env["load_average_1min"] = {"before": load_before[0], "after": os.getloadavg()[0]}
    return env
