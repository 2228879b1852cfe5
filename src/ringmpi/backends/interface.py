"""The block-op interface every backend provides, as ``typing.Protocol`` s, and the host message.

A backend computes one (resident Q shard, visiting K/V block) pair; the ring
schedule (:mod:`ringmpi.parallel.ring_schedule`) is the same for every backend.
:class:`Backend` is what every backend object provides, :class:`Message` what
each of its ring buffers provides; :class:`HostMessage` is the message of
host memory (the NumPy backend's, and the schedule's own metadata buffers).
``tests/unit/test_backend_interface.py`` checks every backend that can run against
both protocols (names and call signatures) and against a float64 reference.
"""

from __future__ import annotations

from typing import Any, ContextManager, Protocol, Tuple, runtime_checkable

import numpy as np


@runtime_checkable
class Message(Protocol):
    """A ring message buffer that MPI and the compute share."""

    def mpi_buffer(self) -> Any:
        """The buffer to hand to ``Isend``/``Irecv``; a device backend first waits for queued
        GPU work on that memory, so call it right before posting."""

    def view(self, offset: int, shape, dtype) -> Any:
        """A compute-side array over ``nbytes(shape, dtype)`` bytes at ``offset``."""

    def arrived(self) -> None:
        """Called once the ``Irecv`` into the MPI buffer completed; makes the compute side
        current (a staging backend copies host -> device here)."""

    def ready_to_send(self, dirty: bool) -> None:
        """Called before ``Isend`` of the MPI buffer; ``dirty`` says the compute side was written
        since the last :meth:`arrived` (a staging backend copies device -> host; a CUDA-aware
        one synchronises the producing stream)."""


@runtime_checkable
class Backend(Protocol):
    """The block ops of one kind of device, and the array plumbing around them.

    ``name`` (``"numpy"``/``"cupy"``), ``xp`` its array module, ``MODIFIERS`` the score
    modifiers with per-head data it applies (:mod:`ringmpi.core.modifiers`; a call asking
    for another gets a ConfigError, :func:`ringmpi.backends.modifier_problem`).
    bfloat16 is ``ml_dtypes.bfloat16`` on every backend (:mod:`ringmpi.core.dtypes`).
    """

    name: str
    xp: Any
    MODIFIERS: Tuple[str, ...]

    def compute_dtype(self, dtype) -> np.dtype:
        """float64 for float64 inputs, float32 otherwise (:func:`ringmpi.core.dtypes.compute_dtype`)."""

    def asarray(self, x) -> Any:
        """``x`` as this backend's array (no copy when it already is)."""

    def to_heads(self, x, dtype) -> Any:
        """A contiguous, head-major ``(B, H, S, D)`` copy of a ``(B, S, H, D)`` array in ``dtype``."""

    def heads_view(self, x, dtype) -> Any:
        """``x (B, S, H, D)`` head-major in ``dtype`` for the block ops to read (never written):
        a strided view where the backend's ops read one (NumPy), else :meth:`to_heads`' copy."""

    def from_heads(self, xh, dtype) -> Any:
        """The inverse of :meth:`to_heads`, ``(B, S, H, D)``, as a new contiguous array."""

    def row_dot(self, x, y) -> Any:
        """``(x * y).sum(-1)`` of two ``(B, H, S, D_v)`` compute-dtype arrays: the backward's
        ``dvec = rowsum(do * o)``, ``(B, H, S)``."""

    def forward_block(self, qh, kh, vh, o_acc, m, l, scale, mask, tick=None, resident=None) -> Tuple[int, int]:
        """Fold one visiting K/V block into the online-softmax state, in place; return
        ``(tiles_computed, tiles_skipped)``.

        Scores are ``(qh kh^T) * scale`` (the scale applied to the product, not to q, so
        rounding matches a plain dense computation).  ``qh (B, H, Sq, D)`` compute dtype;
        ``kh (B, Hkv, Skv, D)``, ``vh (B, Hkv, Skv, D_v)`` (``D_v`` may differ from ``D``) any
        float dtype (the transfer dtype); when ``kh`` is 16-bit (float16, bfloat16) every
        backend multiplies ``qh`` (and in the backward ``doh``) rounded to nearest even in
        ``kh``'s dtype, as the tensor-core (MMA) kernels load them: a caller gets the same
        answer from NumPy and CuPy.  Through :func:`ringmpi.ring_attention` this rounding
        changes nothing (``qh``/``doh`` are copies of 16-bit inputs).  ``o_acc (B, H, Sq,
        D_v)``, ``m, l (B, H, Sq)`` compute dtype; ``mask`` a :class:`ringmpi.core.masks.BlockMask`
        (the one object carrying positions, segment ids, the mask rules and the score
        modifiers to the kernel); ``tick()`` is called between tiles so that MPI can progress
        the pending ring transfers.  ``resident``: None, or one dict the caller passes to
        every block op of one call (the resident operands unchanged between them), where a
        backend keeps what it derives from the resident operands (conversions, NaN/Inf
        scans, scratch) so that it is made once per call, not once per ring step."""

    def finalize(self, o_acc, m, l, out_dtype) -> Tuple[Any, Any]:
        """``(o (B, Sq, H, D_v) out_dtype, lse (B, H, Sq))``: ``o = o_acc / l``, ``lse = m + log(l)``;
        rows with ``l == 0`` give ``o = 0``, ``lse = -inf``."""

    def backward_block(self, qh, doh, lse, dvec, kh, vh, dq, dk, dv, scale, mask, tick=None,
                       resident=None) -> Tuple[int, int]:
        """FlashAttention-2 backward for one block, accumulating in place; return
        ``(tiles_computed, tiles_skipped)``.

        ``P = exp((qh kh^T) * scale - lse)``, ``dv += P^T doh``, ``dS = P * (doh vh^T - dvec)``,
        ``dq += dS kh``, ``dk += dS^T qh`` (both unscaled: the caller multiplies the finished
        sums by the scale).  ``lse``/``dvec (B, H, Sq)``, ``doh (B, H, Sq, D_v)``, ``dq (B, H,
        Sq, D)``, ``dk (B, Hkv, Skv, D)``, ``dv (B, Hkv, Skv, D_v)`` in compute dtype; the rest
        as :meth:`forward_block`.  A backend whose messages are :class:`HostMessage` s also
        takes ``kv_need=None, kv_done=None`` (the schedule passes them only with host
        messages, where ``dk, dv`` hold the partial sums of the ranks before, still
        arriving): ``kv_need(n)`` is called before the op adds into a row below ``n`` (it
        returns once those rows have arrived; the op sums a key tile's terms first, so the
        result is bitwise that of zeroed ``dk, dv`` with the partial sums added after),
        ``kv_done(n)`` each time rows ``[0, n)`` are final (``n`` non-decreasing in both, the
        last ``kv_done`` with ``n = Skv``), so that the schedule can send finished rows while
        the rest is computed."""

    def message(self, nbytes: int) -> Message:
        """One ring buffer of ``nbytes``."""

    def synchronize(self, tick=None) -> None:
        """Wait for all queued work (timing and hand-off to the host), calling ``tick()`` while
        waiting so the ring's transfers keep moving."""

    def annotate(self, name: str) -> ContextManager:
        """A context manager marking host code for a profiler (NVTX on GPU)."""


def _members(protocol) -> Tuple[str, ...]:
    """The attributes and methods a protocol declares, in their order of declaration."""
    methods = [name for name, value in vars(protocol).items() if callable(value) and not name.startswith("_")]
    return tuple(protocol.__annotations__) + tuple(methods)


INTERFACE = _members(Backend)
MESSAGE_INTERFACE = _members(Message)


class HostMessage:
    """The :class:`Message` of host memory: one uint8 buffer that MPI and the compute share."""

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

