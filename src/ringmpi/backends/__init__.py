"""Block-kernel backends behind one small interface.

A backend computes one (resident Q shard, visiting K/V block) pair; the ring
schedule (:mod:`ringmpi.parallel.ring_schedule`) is the same for every backend.  Every
backend object provides (``INTERFACE`` lists the names; one test,
``tests/test_backend_interface.py``, checks every backend that can run):

``name``, ``xp``
    Its name (``"numpy"``/``"cupy"``) and array module.
``compute_dtype(dtype) -> numpy.dtype``
    float64 for float64 inputs, float32 otherwise (:func:`ringmpi.core.dtypes.compute_dtype`).
    bfloat16 is ``ml_dtypes.bfloat16`` on every backend (:mod:`ringmpi.core.dtypes`).
``asarray(x)``
    ``x`` as this backend's array (no copy when it already is).
``to_heads(x, dtype) -> (B, H, S, D)``
    A contiguous, head-major copy of a ``(B, S, H, D)`` array in ``dtype``.
``heads_view(x, dtype) -> (B, H, S, D)``
    ``x (B, S, H, D)`` head-major in ``dtype`` for the block ops to read (never written):
    a strided view where the backend's ops read one (NumPy), else ``to_heads``' copy.
``from_heads(xh, dtype) -> (B, S, H, D)``
    The inverse, as a new contiguous array.
``forward_block(qh, kh, vh, o_acc, m, l, scale, mask, tick, resident=None)``
    Fold one visiting K/V block into the online-softmax state, in place:
    scores are ``(qh kh^T) * scale`` (the scale applied to the product, not
    to q, so rounding matches a plain dense computation).
    ``qh (B, H, Sq, D)`` compute dtype; ``kh (B, Hkv, Skv, D)``, ``vh (B, Hkv, Skv, D_v)``
    (``D_v`` may differ from ``D``) any float dtype (the transfer dtype);
    when ``kh`` is 16-bit (float16, bfloat16) every backend multiplies ``qh``
    (and in the backward ``doh``) rounded to nearest even in ``kh``'s dtype,
    as the tensor-core (MMA) kernels load them: a caller gets the same
    answer from NumPy and CuPy.  Through :func:`ringmpi.ring_attention` this
    rounding changes nothing (``qh``/``doh`` are copies of 16-bit inputs);
    ``o_acc (B, H, Sq, D_v)``, ``m, l (B, H, Sq)`` compute dtype; ``mask`` a
    :class:`ringmpi.core.masks.BlockMask` (the one object carrying positions, segment
    ids and the mask rules -- and later score modifiers -- to the kernel); ``tick()`` is called between tiles so
    that MPI can progress the pending ring transfers.  Returns
    ``(tiles_computed, tiles_skipped)`` (``backward_block`` too).
    ``resident``: None, or one dict the caller passes to every block op of one
    call (the resident operands unchanged between them), where a backend keeps
    what it derives from the resident operands (conversions, NaN/Inf scans,
    scratch) so that it is made once per call, not once per ring step.
``row_dot(x, y) -> (B, H, S)``
    ``(x * y).sum(-1)`` of two ``(B, H, S, D_v)`` compute-dtype arrays: the
    backward's ``dvec = rowsum(do * o)``.
``finalize(o_acc, m, l, out_dtype) -> (o (B, Sq, H, D_v) out_dtype, lse (B, H, Sq))``
    ``o = o_acc / l``, ``lse = m + log(l)``; rows with ``l == 0`` give
    ``o = 0``, ``lse = -inf``.
``backward_block(qh, doh, lse, dvec, kh, vh, dq, dk, dv, scale, mask, tick, resident=None, kv_need=None, kv_done=None)``
    FlashAttention-2 backward for one block, accumulating in place:
    ``P = exp((qh kh^T) * scale - lse)``, ``dv += P^T doh``,
    ``dS = P * (doh vh^T - dvec)``, ``dq += dS kh``, ``dk += dS^T qh``
    (both unscaled: the caller multiplies the finished sums by the scale).  ``lse``/``dvec (B, H, Sq)``,
    ``doh (B, H, Sq, D_v)``, ``dq (B, H, Sq, D)``, ``dk (B, Hkv, Skv, D)``,
    ``dv (B, Hkv, Skv, D_v)`` in compute dtype.
    ``kv_need(n)``, ``kv_done(n)`` (host-memory backends; the schedule passes them only
    with host messages, where ``dk, dv`` hold the partial sums of the ranks before,
    still arriving): ``kv_need(n)`` is called before the op adds into a row below ``n``
    (it returns once those rows have arrived; the op sums a key tile's terms first, so
    the result is bitwise that of zeroed ``dk, dv`` with the partial sums added after),
    ``kv_done(n)`` each time rows ``[0, n)`` are final (``n`` non-decreasing in both, the last ``kv_done`` with
    ``n = Skv``), so that the schedule can send finished rows while the rest is computed.
``message(nbytes) -> Message``
    One ring buffer of ``nbytes``; see :class:`HostMessage` for its methods
    (``MESSAGE_INTERFACE``).
``synchronize(tick=None)``
    Wait for all queued work (timing and hand-off to the host), calling
    ``tick()`` while waiting so the ring's transfers keep moving.
``annotate(name)``
    A context manager marking host code for a profiler (NVTX on GPU).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

INTERFACE = ("name", "xp", "compute_dtype", "asarray", "to_heads", "heads_view", "from_heads", "row_dot",
             "forward_block", "finalize", "backward_block", "message", "synchronize", "annotate")
MESSAGE_INTERFACE = ("mpi_buffer", "view", "arrived", "ready_to_send")


class HostMessage:
    """A ring message buffer that MPI and the compute share (host memory).

    ``mpi_buffer()``
        The uint8 buffer to hand to ``Isend``/``Irecv``; a device backend
        first waits for queued GPU work on that memory, so call it right
        before posting.
    ``view(offset, shape, dtype)``
        A compute-side array over ``nbytes(shape, dtype)`` bytes at ``offset``.
    ``arrived()``
        Called once the ``Irecv`` into the MPI buffer completed; makes the compute
        side current (a staging backend copies host -> device here).
    ``ready_to_send(dirty)``
        Called before ``Isend`` of the MPI buffer; ``dirty`` says the compute side
        was written since the last ``arrived()`` (a staging backend copies
        device -> host; a CUDA-aware one synchronises the producing stream).
    """

    def __init__(self, nbytes: int):
        self._buffer = np.empty(max(int(nbytes), 1), dtype=np.uint8)

    def mpi_buffer(self):
        return self._buffer

    def view(self, offset: int, shape, dtype):
        dtype = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        return self._buffer[offset:offset + count * dtype.itemsize].view(dtype).reshape(shape)

    def arrived(self) -> None:
        pass

    def ready_to_send(self, dirty: bool) -> None:
        pass


def is_cupy_array(x) -> bool:
    return type(x).__module__.startswith("cupy")


def get_backend(name: str = "auto", arrays=()):
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
    return f"the {backend.name} backend does not apply {', '.join(missing)} yet: use backend='numpy'"


def gpu_available() -> bool:
    """True when CuPy imports and at least one CUDA device is visible
    (:func:`ringmpi.runtime.device.gpu_unavailable_reason` says why not)."""
    from ..runtime.device import gpu_unavailable_reason

    return gpu_unavailable_reason() is None
