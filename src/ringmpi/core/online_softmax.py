"""The online-softmax state of resident queries: fold blocks, fold sinks, max logit, finalize.

One :class:`SoftmaxState` per call holds ``o_acc (B, H, S, D_v)``, ``m, l
(B, H, S)`` in the compute dtype, as this backend's arrays.  Every schedule
(the flat ring, head x ring, decode's local part) makes one, folds each
visible K/V block into it with the backend's ``forward_block``, and finishes it
here:

* **sinks** ``(H,)``: every query row's softmax gains a virtual key with logit
  ``sinks[h]`` and a zero value.  :meth:`SoftmaxState.fold_sinks` adds it once,
  after the last block, so ``l`` gains ``exp(sink - m)`` and ``lse = m +
  log(l)`` includes it; a row that saw no key gets ``o = 0``, ``lse = sink``.
  (The backward needs no kernel change: ``P = exp(S - lse)`` already uses the
  sink's ``lse``, and ``dS = P * (dO V^T - D)`` holds because the sink's value
  is zero; the sink's own gradient is :func:`ringmpi.parallel.ring_passes.sink_grads`.)
* **max logit** ``(H,)``: the largest score (after scale and score modifiers,
  masked keys excluded, the sink not counted) any query of head ``h`` saw, over
  the whole sequence.  With ``ScoreSpec.exact_max`` the running maximum ``m`` is
  exact in every backend, so :meth:`SoftmaxState.local_max_logit` reads this
  rank's part before the sinks are folded in (the ranks' parts are reduced by
  :func:`ringmpi.parallel.ring_passes.reduce_max_logit`); a head no query sees any
  key of gives ``-inf``.  Non-finite scores count as ``np.maximum`` counts them,
  on every backend: a head with a visible NaN score gives NaN, and a row whose
  visible scores are all ``-inf`` contributes ``-inf``.
"""

from __future__ import annotations

import numpy as np

from .host import to_host


class SoftmaxState:
    """``(o_acc, m, l)`` of ``shape = (B, H, S)`` rows with values ``dim_v`` wide, in ``dtype``."""

    def __init__(self, backend, shape, dim_v: int, dtype):
        xp = backend.xp
        self.backend = backend
        self.o_acc = xp.zeros(tuple(shape) + (dim_v,), dtype=dtype)
        self.m = xp.full(tuple(shape), -np.inf, dtype=dtype)
        self.l = xp.zeros(tuple(shape), dtype=dtype)

    def arrays(self, rows=slice(None)):
        """``(o_acc, m, l)`` of the batch entries ``rows`` (views): the block op's in-place operands."""
        return self.o_acc[rows], self.m[rows], self.l[rows]

    def fold(self, qh, kh, vh, scale: float, mask, rows=slice(None), **kwargs):
        """Fold one K/V block into the rows ``rows``; returns the block op's tile counts."""
        return self.backend.forward_block(qh, kh, vh, *self.arrays(rows), scale, mask, **kwargs)

    def fold_sinks(self, sinks) -> None:
        """Add the sink (logit ``sinks[h]``, value 0) to every row, in place; ``sinks (H,)``
        this backend's array.  ``m`` becomes ``max(m, sink)`` and the state is rescaled to
        it, so no term overflows."""
        xp, m = self.backend.xp, self.m
        sink = sinks.astype(m.dtype)[None, :, None]
        m_new = xp.maximum(m, sink)
        alpha = xp.exp(m - m_new)
        self.l *= alpha
        self.l += xp.exp(sink - m_new)
        self.o_acc *= alpha[..., None]
        m[...] = m_new

    def local_max_logit(self, heads=None) -> np.ndarray:
        """``(H,)`` host array in the state's dtype: each head's largest visible score over the
        batch and these rows (:func:`local_max_logit` of ``m``)."""
        return local_max_logit(self.m, heads)

    def finalize(self, out_dtype):
        """``(o (B, S, H, D_v) out_dtype, lse (B, H, S))``: the backend's ``finalize``."""
        return self.backend.finalize(self.o_acc, self.m, self.l, out_dtype)


def local_max_logit(m, heads=None) -> np.ndarray:
    """``(H,)`` host array in ``m``'s dtype: each head's largest value of ``m (B, H, S)`` (this
    backend's array: row maxima) over the batch and these rows; ``-inf`` for a head with none
    here.  ``heads=(part, H)``: these rows hold only the heads ``part`` (a slice) of ``H`` (the
    head x ring schedule); the other heads' maxima come from other ranks."""
    part, total = (slice(None), m.shape[1]) if heads is None else heads
    local = np.full(total, -np.inf, dtype=m.dtype)
    if m.shape[0] and m.shape[2]:
        local[part] = to_host(m.max(axis=(0, 2)))
    return local
