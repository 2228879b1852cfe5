"""Score modifiers with per-head data: one object each, from validation to the kernels' arguments.

A modifier changes visible scores, never visibility; every backend applies it
after the scale and the logit softcap and before the mask, in global positions
(so it is exact for every P, layout and schedule).  It travels in the mask spec
(``MaskSpec.alibi``), is sliced with the heads of a call that covers only some
(:meth:`Alibi.for_heads`: the head x ring schedule, the file job's passes) and
states its own formula once for the NumPy tiles and the dense references
(:meth:`Alibi.bias`).  Its slope (d modified / d score) is 1: the backward's
``dS`` needs nothing more.

* **ALiBi** (Press et al.; FlashAttention 2's convention): the score of query
  ``i`` and key ``j`` of head ``h`` gains ``-slopes[h] * |i + N_kv - N_q - j|``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

from .host import to_host

ALIBI_DTYPES = ("float32",)


def alibi_problem(slopes, heads: int) -> Optional[str]:
    """The problem with ``alibi_slopes`` (None when fine): shape ``(H,)``, float32, finite."""
    if slopes is None:
        return None
    shape = getattr(slopes, "shape", None)
    if shape is None or tuple(shape) != (heads,):
        return f"alibi_slopes must have shape (H,) = ({heads},), got {None if shape is None else tuple(shape)}"
    if str(slopes.dtype) not in ALIBI_DTYPES:
        return f"alibi_slopes must be float32, got dtype {slopes.dtype}"
    host = to_host(slopes)
    if not np.isfinite(host).all():
        return f"alibi_slopes must be finite, got {host[~np.isfinite(host)][0]}"
    return None


@dataclass(frozen=True)
class Alibi:
    """ALiBi slopes of a call's query heads (host floats, the float32 values the caller gave)."""

    slopes: Tuple[float, ...]

    @classmethod
    def of(cls, slopes) -> Optional["Alibi"]:
        """The modifier of checked ``alibi_slopes`` (an (H,) array of any backend), or None."""
        if slopes is None:
            return None
        host = to_host(slopes)
        return cls(tuple(float(x) for x in host.astype(np.float32)))

    def for_heads(self, part: slice) -> "Alibi":
        """The slopes of the query heads ``part`` of this call (a call over some heads)."""
        return Alibi(self.slopes[part])

    def distances(self, q_pos, kv_pos, offset: int, dtype) -> np.ndarray:
        """``(len(q_pos), len(kv_pos))`` ``|i + offset - j|`` in ``dtype`` (computed in int64)."""
        q_pos = np.asarray(q_pos, dtype=np.int64)
        kv_pos = np.asarray(kv_pos, dtype=np.int64)
        return np.abs(q_pos[:, None] + int(offset) - kv_pos[None, :]).astype(dtype)

    def bias(self, h: int, dist: np.ndarray) -> np.ndarray:
        """Head ``h``'s additive term ``-slope_h * dist`` for :meth:`distances` ``dist``."""
        return dist * dist.dtype.type(-self.slopes[h])

    def kernel_slopes(self, dtype=np.float32) -> np.ndarray:
        """``(H,)`` the slopes as the CUDA kernels read them (one per query head)."""
        return np.asarray(self.slopes, dtype=dtype)
