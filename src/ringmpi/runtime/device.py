"""GPU availability, binding per node-local rank, CUDA-aware MPI detection, NVTX ranges.

Nothing here initialises MPI or CUDA at import time; every function imports
mpi4py / CuPy lazily and the ones used by ``ringmpi info`` never raise when
no GPU (or no CuPy) is present.  :func:`gpu_unavailable_reason` is the one
check of whether this process can use a GPU: ``ringmpi info``, the backend
choice (``auto``) and every ``--backend cupy`` ask it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from typing import Optional, Tuple

# The oldest GPU ringmpi runs on, as major * 10 + minor: sm_70 (Volta), where the CUDA kernels'
# SIMT code path starts (ringmpi.kernels); a visible device below it makes the GPU unusable.
MIN_CC = 70


def _cuda_version(code: Optional[int]) -> str:
    """CUDA's integer version (``12090``) as ``12.9``."""
    if not code:
        return "unknown"
    return f"{code // 1000}.{code % 1000 // 10}"


def cuda_error_reason(error: str, driver_version: Optional[int], runtime_version: Optional[int],
                      visible_devices: Optional[str] = None) -> str:
    """The cause of a failed CUDA device query, as one sentence that quotes CUDA's error.

    ``error`` is the text of CuPy's ``CUDARuntimeError`` (``cudaErrorXxx: ...``);
    ``driver_version``/``runtime_version`` are CUDA's integers
    (``cudaDriverGetVersion``: 0 when no driver is loaded; ``cudaRuntimeGetVersion``);
    ``visible_devices`` is ``CUDA_VISIBLE_DEVICES`` when set.
    """
    if "InsufficientDriver" in error:
        if not driver_version:
            return f"no NVIDIA driver is loaded on this node, so CUDA sees no GPU ({error})"
        return (f"the NVIDIA driver is too old: it supports CUDA {_cuda_version(driver_version)}, CuPy's CUDA "
                f"runtime is {_cuda_version(runtime_version)} ({error}); update the driver or install the "
                f"CuPy build for CUDA {driver_version // 1000} (cupy-cuda{driver_version // 1000}x)")
    if "NoDevice" in error or "InvalidDevice" in error:
        return f"{_no_device(visible_devices)} ({error})"
    return f"CUDA cannot use a device ({error})"


def _no_device(visible_devices: Optional[str]) -> str:
    where = "" if visible_devices is None else f" with CUDA_VISIBLE_DEVICES={visible_devices!r}"
    return f"no CUDA device is visible to this process{where}"


def capability_reason(devices) -> Optional[str]:
    """The cause, as a sentence, when a visible device is too old for the kernels; else None.

    ``devices``: ``(id, name, major, minor)`` of every visible device.  The
    kernels need compute capability 7.0 (Volta) or newer
    (:data:`MIN_CC`); a rank may be bound to any visible device
    (:func:`select_device`), so one older device makes the GPU unusable.
    """
    old = [(i, name, major, minor) for i, name, major, minor in devices if major * 10 + minor < MIN_CC]
    if not old:
        return None
    listed = ", ".join(f"device {i} ({name}) has compute capability {major}.{minor}" for i, name, major, minor in old)
    return (f"{listed}; ringmpi's CUDA kernels need compute capability {MIN_CC // 10}.{MIN_CC % 10} (Volta) "
            f"or newer (use backend numpy, or CUDA_VISIBLE_DEVICES to hide that device)")


def _devices(runtime, count: int):
    """``(id, name, major, minor)`` of the ``count`` visible devices."""
    out = []
    for i in range(count):
        props = runtime.getDeviceProperties(i)
        name = props["name"]
        out.append((i, name.decode() if isinstance(name, bytes) else str(name), props["major"], props["minor"]))
    return out


def gpu_unavailable_reason() -> Optional[str]:
    """None when CuPy imports and this process sees a CUDA device the kernels run on;
    else the cause, as a sentence.

    The causes named: CuPy missing (or failing to import), no NVIDIA driver, a
    driver too old for CuPy's CUDA runtime (with both versions), no device
    visible (``CUDA_VISIBLE_DEVICES``), each with CUDA's own error text; a
    device below compute capability 7.0, with its name and capability
    (:func:`capability_reason`).  Never raises; initialises CUDA's runtime but
    allocates nothing.
    """
    try:
        import cupy
    except Exception as exc:  # ImportError, or a CuPy that fails while loading CUDA libraries
        return (f"CuPy is not importable ({type(exc).__name__}: {exc}); install the GPU extra "
                f"(RINGMPI_EXTRAS=gpu scripts/setup.sh, i.e. cupy-cuda12x)")
    runtime = cupy.cuda.runtime
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        count = runtime.getDeviceCount()
    except Exception as exc:  # CUDARuntimeError
        versions = []
        for query in (runtime.driverGetVersion, runtime.runtimeGetVersion):
            try:
                versions.append(int(query()))
            except Exception:
                versions.append(None)
        return cuda_error_reason(str(exc), versions[0], versions[1], visible)
    if count < 1:
        return f"{_no_device(visible)} (cudaGetDeviceCount returned 0)"
    try:
        devices = _devices(runtime, count)
    except Exception as exc:  # CUDARuntimeError
        return f"CUDA cannot describe its devices ({exc})"
    return capability_reason(devices)


def require_gpu(comm, what: str = "--backend cupy") -> None:
    """Raise the same :class:`~ringmpi.runtime.errors.ConfigError` on every rank of ``comm``
    unless every rank can use a GPU (:func:`gpu_unavailable_reason`).  Collective."""
    from .errors import agree

    reason = gpu_unavailable_reason()
    agree(comm, None if reason is None else f"{what} needs a usable CUDA GPU, but {reason}")


def select_device(comm) -> int:
    """Bind this rank to a GPU and return its device id.

    The node-local rank (``comm.Split_type(COMM_TYPE_SHARED).rank``) modulo
    the number of visible GPUs; device 0 when only one GPU is visible (the
    scheduler already gave each task its own, e.g. through
    ``CUDA_VISIBLE_DEVICES``).  Collective over ``comm``.
    """
    from mpi4py import MPI
    import cupy

    from .watchdog import phase

    with phase("binding GPUs: the node's ranks (COMM_TYPE_SHARED split)"):
        local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        local_rank = local.Get_rank()
    finally:
        local.Free()
    count = cupy.cuda.runtime.getDeviceCount()
    if count < 1:
        raise RuntimeError("no CUDA device visible to this rank")
    device_id = 0 if count == 1 else local_rank % count
    cupy.cuda.Device(device_id).use()
    return device_id


# environment settings that turn an MPI's CUDA support on, each read only under its own MPI
_ENV_HINTS = (
    ("MPICH_GPU_SUPPORT_ENABLED", ("1",), ("Cray MPICH",)),
    ("OMPI_MCA_opal_cuda_support", ("1", "true"), ("Open MPI",)),  # smcuda / ob1
    ("MV2_USE_CUDA", ("1",), ("MVAPICH",)),                          # MVAPICH2-GDR
    ("MPIR_CVAR_ENABLE_GPU", ("1",), ("MPICH", "Cray MPICH", "MVAPICH", "Intel MPI")),  # MPICH >= 4
    ("I_MPI_OFFLOAD", ("1", "2"), ("Intel MPI",)),
)


def _info_memory_kinds(comm) -> Optional[str]:
    """MPI 4.1 ``mpi_memory_alloc_kinds`` from the communicator or the
    environment info object, or None where mpi4py/MPI do not expose it."""
    from mpi4py import MPI

    sources = []
    if comm is not None:
        sources.append(lambda: comm.Get_info())
    if getattr(MPI, "INFO_ENV", None) is not None:
        sources.append(lambda: MPI.INFO_ENV)
    for get in sources:
        try:
            info = get()
            value = info.Get("mpi_memory_alloc_kinds")
        except Exception:
            continue
        if value:
            return value
    return None


def _mpix_query_cuda_support() -> Optional[bool]:
    """``MPIX_Query_cuda_support()`` (Open MPI; MPICH >= 4.0 and its derivatives) through ctypes
    (mpi4py does not wrap it); None when the loaded MPI library lacks the symbol."""
    from mpi4py import MPI  # loads libmpi into the process

    fn = None
    # dlsym on mpi4py's extension module also searches its dependencies (libmpi)
    for handle in (getattr(MPI, "__file__", None), None):
        try:
            fn = ctypes.CDLL(handle).MPIX_Query_cuda_support
            break
        except (OSError, AttributeError, TypeError):
            continue
    if fn is None:
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = []
    try:
        return bool(fn())
    except Exception:
        return None


def cuda_aware_mpi(comm=None) -> Tuple[bool, str]:
    """Whether the MPI library accepts device pointers, and why we think so.

    Checked in order: the MPI 4.1 ``mpi_memory_alloc_kinds`` info key
    (contains ``cuda``), ``MPIX_Query_cuda_support()`` (Open MPI, MPICH >= 4.0), then
    the running MPI's own environment hints (``OMPI_MCA_opal_cuda_support=true`` under
    Open MPI, ``MPIR_CVAR_ENABLE_GPU=1`` under MPICH, ``MPICH_GPU_SUPPORT_ENABLED=1``
    under Cray MPICH, ...).  Needs MPI initialised.
    """
    try:
        kinds = _info_memory_kinds(comm)
    except ImportError:
        return False, "mpi4py is not importable"
    if kinds is not None and "cuda" in kinds.lower():
        return True, f"mpi_memory_alloc_kinds={kinds}"
    support = _mpix_query_cuda_support()
    if support is not None:
        return support, f"MPIX_Query_cuda_support() returned {int(support)}"
    from .mpi_library import implementation

    running = implementation()
    for var, yes, implementations in _ENV_HINTS:
        value = os.environ.get(var, "")
        if running in implementations and value.lower() in yes:
            return True, f"{var}={value}"
    if kinds is not None:
        return False, f"mpi_memory_alloc_kinds={kinds} (no cuda)"
    return False, "no CUDA-aware MPI detected (no memory-kinds info, no MPIX_Query_cuda_support, no env hint)"


def resolve_cuda_aware(comm=None) -> Tuple[bool, str]:
    """The mode the GPU backend uses: ``RINGMPI_CUDA_AWARE=on|off|auto``
    (default auto, i.e. :func:`cuda_aware_mpi`)."""
    mode = os.environ.get("RINGMPI_CUDA_AWARE", "auto").strip().lower()
    if mode in ("1", "on", "true", "yes"):
        return True, "RINGMPI_CUDA_AWARE=on"
    if mode in ("0", "off", "false", "no"):
        return False, "RINGMPI_CUDA_AWARE=off"
    if mode != "auto":
        raise ValueError(f"RINGMPI_CUDA_AWARE must be auto, on or off, got {mode!r}")
    return cuda_aware_mpi(comm)


def gpu_summary() -> dict:
    """GPUs this process sees, for ``ringmpi info``; never raises.

    ``{"cupy": version or None, "count": n, "devices": [{"id", "name",
    "compute_capability", "memory_gib"}], "error": str or None}``; ``error``
    is :func:`gpu_unavailable_reason`.
    """
    out = {"cupy": None, "count": 0, "devices": [], "error": gpu_unavailable_reason()}
    try:
        import cupy
    except Exception:
        return out
    out["cupy"] = cupy.__version__
    try:
        runtime = cupy.cuda.runtime
        count = runtime.getDeviceCount()
        out["count"] = count
        for i, name, major, minor in _devices(runtime, count):
            out["devices"].append({
                "id": i, "name": name, "compute_capability": f"{major}.{minor}",
                "memory_gib": round(runtime.getDeviceProperties(i)["totalGlobalMem"] / 2**30, 1),
            })
    except Exception as exc:
        if out["error"] is None:
            out["error"] = f"CUDA cannot describe its devices ({exc})"
    return out


@contextlib.contextmanager
def nvtx_range(name: str):
    """An NVTX range around a block of host code (visible in Nsight Systems);
    a no-op without CuPy."""
    nvtx = None
    try:
        from cupy.cuda import nvtx
        nvtx.RangePush(name)
    except Exception:
        nvtx = None
    try:
        yield
    finally:
        if nvtx is not None:
            nvtx.RangePop()
