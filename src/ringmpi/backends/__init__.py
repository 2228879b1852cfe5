"""Block-kernel backends behind one small interface, and the choice among them.

A backend computes one (resident Q shard, visiting K/V block) pair; the ring
schedule (:mod:`ringmpi.parallel.ring_schedule`) is the same for every backend.
What every backend object provides is :class:`~ringmpi.backends.interface.Backend`
(a ``typing.Protocol``: ``name``, ``xp``, ``MODIFIERS``, ``compute_dtype``,
``asarray``, ``to_heads``, ``heads_view``, ``from_heads``, ``row_dot``,
``forward_block``, ``finalize``, ``backward_block``, ``message``,
``synchronize``, ``annotate``, each documented there; ``INTERFACE`` lists the
names), its ring buffers :class:`~ringmpi.backends.interface.Message`
(``MESSAGE_INTERFACE``; :class:`HostMessage` in host memory).  One test,
``tests/unit/test_backend_interface.py``, checks every backend that can run.
"""

from __future__ import annotations

from typing import Optional

from .interface import INTERFACE, MESSAGE_INTERFACE, Backend, HostMessage, Message

__all__ = ["Backend", "Message", "HostMessage", "INTERFACE", "MESSAGE_INTERFACE", "get_backend", "gpu_available",
           "is_cupy_array", "value_dim_problem", "device_problem", "modifier_problem"]


def is_cupy_array(x) -> bool:
    return type(x).__module__.startswith("cupy")


def get_backend(name: str = "auto", arrays=()) -> Backend:
    """Resolve a backend by name.

    ``"numpy"`` or ``"cupy"`` choose directly.  ``"auto"`` follows the arrays
    when any is a CuPy array, else picks cupy when CuPy imports and a GPU is
    visible, else numpy.
    """
    if name == "auto":
        if any(is_cupy_array(a) for a in arrays if a is not None):
            name = "cupy"
        elif arrays and any(a is not None for a in arrays):
            name = "numpy"
        else:
            name = "cupy" if gpu_available() else "numpy"
    if name == "numpy":
        from .numpy_backend import NumpyBackend
        return NumpyBackend()
    if name == "cupy":
        from .cupy_backend import CupyBackend
        return CupyBackend.instance()
    raise ValueError(f"unknown backend {name!r}: expected 'auto', 'numpy' or 'cupy'")


def value_dim_problem(backend_name: str, d: int, d_v: int):
    """Why backend ``backend_name`` cannot run head dim ``d`` with value head dim ``d_v``, or None
    (NumPy runs any pair; the CUDA kernels a compiled set, :func:`ringmpi.kernels.value_dim_problem`)."""
    if d_v == d or backend_name != "cupy":
        return None
    from ..kernels import value_dim_problem as kernel_problem
    return kernel_problem(d, d_v)


def device_problem(backend, dtype, d: int, d_v: int) -> Optional[str]:
    """Why ``backend``'s device runs no block kernel for K/V ``dtype``, head dims ``d``, ``d_v``
    (its shared memory per block: float64 at D > 192 on sm_75; a GPU below sm_70), or None."""
    return backend.kernel_problem(dtype, d, d_v) if backend.name == "cupy" else None


def modifier_problem(backend, names) -> Optional[str]:
    """Why ``backend`` cannot apply the score modifiers ``names`` (e.g. ``("alibi",)``), or None:
    a backend lists those it applies in its ``MODIFIERS``."""
    missing = [n for n in names if n not in getattr(backend, "MODIFIERS", ())]
    if not missing:
        return None
    return f"the {backend.name} backend does not apply {', '.join(missing)} yet: use RingContext(backend='numpy')"


def gpu_available() -> bool:
    """True when CuPy imports and at least one CUDA device is visible
    (:func:`ringmpi.runtime.device.gpu_unavailable_reason` says why not)."""
    from ..runtime.device import gpu_unavailable_reason

    return gpu_unavailable_reason() is None
