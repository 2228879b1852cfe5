"""Attention sinks, the logit softcap and the max logit around the ring.

The softcap is a score modifier the block kernels apply (``MaskSpec.softcap``);
sinks and the max logit are per-head quantities handled here, outside the
block kernels, with the backend's array module ``xp`` (NumPy or CuPy):

* **sinks** ``(H,)``: every query row's softmax gains a virtual key with logit
  ``sinks[h]`` and a zero value.  :func:`fold_sinks` adds it to the finished
  online-softmax state ``(o_acc, m, l)`` once, after the last ring step, so
  ``l`` gains ``exp(sink - m)`` and ``lse = m + log(l)`` includes it; a row
  that saw no key gets ``o = 0``, ``lse = sink``.  The backward needs no
  kernel change (``P = exp(S - lse)`` already uses the sink's ``lse``, and
  ``dS = P * (dO V^T - D)`` holds because the sink's value is zero); the
  sink's own gradient is ``dsinks[h] = -sum_{b, i} exp(sinks[h] - lse[b, h, i]) * D[b, h, i]``
  with ``D = rowsum(dO * O)`` (:func:`sink_grads`), summed over all ranks (or
  this rank's rows only, ``reduce_dsinks=False``, as ``ringmpi.torch`` asks).
* **max logit** ``(H,)``: the largest score (after scale and softcap, masked
  keys excluded, the sink not counted) any query of head ``h`` saw, over the
  whole sequence.  With ``MaskSpec.exact_max`` the running maximum ``m`` is
  exact in every backend, so :func:`max_logits` reads it before the sinks are
  folded in and reduces it with ``MPI.MAX``; a head no query sees any key of
  gives ``-inf``.
"""

from __future__ import annotations

import math
import zlib
from typing import Optional

import numpy as np

SINK_DTYPES = ("float16", "bfloat16", "float32", "float64")


def _host(x):
    return x.get() if hasattr(x, "get") else np.asarray(x)


def sinks_problem(sinks, heads: int) -> Optional[str]:
    """This rank's problem with ``sinks`` (None when fine): shape ``(H,)``, a float dtype, finite.

    16-bit sinks are used in the compute dtype (float32 for 16-bit inputs)."""
    if sinks is None:
        return None
    shape = getattr(sinks, "shape", None)
    if shape is None or tuple(shape) != (heads,):
        return f"sinks must have shape (H,) = ({heads},), got {None if shape is None else tuple(shape)}"
    if str(sinks.dtype) not in SINK_DTYPES:
        return f"sinks must be one of {', '.join(SINK_DTYPES)}, got dtype {sinks.dtype}"
    host = _host(sinks).astype(np.float64)
    if not np.isfinite(host).all():
        return f"sinks must be finite, got {host[~np.isfinite(host)][0]} at head {int(np.argmin(np.isfinite(host)))}"
    return None


def softcap_problem(softcap) -> Optional[str]:
    """The problem with ``softcap`` (None when fine): a finite number > 0, or None."""
    if softcap is None:
        return None
    try:
        value = float(softcap)
    except (TypeError, ValueError):
        return f"softcap must be a number > 0, got {softcap!r}"
    if not (math.isfinite(value) and value > 0):
        return f"softcap must be finite and > 0, got {softcap!r}"
    return None


def digest(sinks, softcap) -> int:
    """A digest of the options every rank must agree on (compare with an allgather)."""
    crc = zlib.crc32(repr(None if softcap is None else float(softcap)).encode())
    if sinks is not None:
        crc = zlib.crc32(np.ascontiguousarray(_host(sinks), dtype=np.float64).view(np.uint8), crc)
    return crc


def fold_sinks(xp, o_acc, m, l, sinks) -> None:
    """Add the sink (logit ``sinks[h]``, value 0) to every row's state, in place.

    ``o_acc (B, H, S, D)``, ``m, l (B, H, S)`` compute dtype; ``sinks (H,)``
    this backend's array.  ``m`` becomes ``max(m, sink)`` and the state is
    rescaled to it, so no term overflows.
    """
    sink = sinks.astype(m.dtype)[None, :, None]
    m_new = xp.maximum(m, sink)
    alpha = xp.exp(m - m_new)
    l *= alpha
    l += xp.exp(sink - m_new)
    o_acc *= alpha[..., None]
    m[...] = m_new


def max_logits(m, comm, heads=None):
    """``(H,)`` host array: each head's largest visible score over the batch, the
    rows and all ranks of ``comm`` (``MPI.MAX``), from the exact running maxima
    ``m (B, H, S_local)``; ``-inf`` for a head with no visible score.
    ``heads=(part, H)``: ``m`` holds only the heads ``part`` (a slice) of ``H``
    (the head x ring schedule); the other heads' maxima come from other ranks."""
    from mpi4py import MPI

    part, total = (slice(None), m.shape[1]) if heads is None else heads
    local = np.full(total, -np.inf, dtype=m.dtype)
    if m.shape[0] and m.shape[2]:
        local[part] = _host(m.max(axis=(0, 2)))
    out = np.empty_like(local)
    comm.Allreduce(local, out, op=MPI.MAX)
    return out


def sink_grads(xp, lse, dvec, sinks, comm, reduce: bool = True):
    """``dsinks (H,)`` host array in the compute dtype: ``-sum exp(sink - lse) * dvec``
    over the batch, this rank's rows and (``MPI.SUM``, only with ``reduce``) all ranks of ``comm``.

    ``lse, dvec (B, H, S_local)`` compute dtype (this backend's arrays).  Without
    ``reduce`` the result is this rank's own rows' contribution: the framework
    bridges' convention, where the usual sum of replicated gradients over ranks
    makes the total.
    """
    from mpi4py import MPI

    ct = lse.dtype
    local = np.zeros(lse.shape[1], dtype=ct)
    if lse.shape[0] and lse.shape[2]:
        p_sink = xp.exp(sinks.astype(ct)[None, :, None] - lse)
        local = np.ascontiguousarray(_host(-(p_sink * dvec).sum(axis=(0, 2))), dtype=ct)
    if not reduce:
        return local
    out = np.empty_like(local)
    comm.Allreduce(local, out, op=MPI.SUM)
    return out
