"""Dropout on the attention weights as a pure function of global positions.

Whether weight ``(b, h, i, j)`` is kept depends only on the seed, the batch
entry ``b``, the query head ``h``, the global query position ``i`` and the
global key position ``j``; never on the number of ranks, the layout, the
tiling or the backend.  One Philox 4x32-10 evaluation (:mod:`ringmpi.core.philox`,
compiled twin ``dropout_keep`` in ``kernels/rules.h``) per weight:

* key: ``(seed mod 2^32, seed >> 32)`` for a seed in ``[0, 2^64)``;
* counter: ``(j mod 2^32, i mod 2^32, (i >> 32) | (j >> 32) << 16, row)``
  with ``row = (batch_offset + b) * heads + head_offset + h`` (``i, j < 2^48``,
  ``row < 2^32``);
* keep iff output word 0 ``>= threshold = ceil(p * 2^32)``, i.e.
  ``word0 / 2^32 >= p``: a keep rate of ``1 - p`` to within ``2^-32``.

Kept weights are multiplied by ``rescale = 1 / (1 - p)`` (rounded once to the
compute dtype).  ``batch_offset``, ``head_offset`` and ``heads`` place a call
that covers a slice of a larger tensor (the file job's passes) at its global
batch entry and head, so the slice draws the whole tensor's mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from .philox import philox4x32

MAX_POSITION = 1 << 48
_WORD = 0xFFFFFFFF


@dataclass(frozen=True)
class Dropout:
    """Dropout of one attention call: probability ``p`` in ``(0, 1)``, 64-bit ``seed``.

    ``heads``: the global number of query heads (the row stride of the
    counter); ``batch_offset``/``head_offset``: where this call's entry 0 and
    head 0 sit in the global tensor (0 for a whole-tensor call).
    """

    p: float
    seed: int
    heads: int
    batch_offset: int = 0
    head_offset: int = 0

    def __post_init__(self):
        problem = validate(self.p, self.seed)
        if problem is None and not self.p > 0:
            problem = f"a Dropout needs p > 0, got {self.p}"
        if problem:
            raise ValueError(problem)

    @property
    def threshold(self) -> int:
        """``ceil(p * 2^32)``: keep iff the uint32 draw is at least this (exact: p * 2^32 is)."""
        return math.ceil(self.p * 2.0 ** 32)

    def rescale(self, dtype) -> np.generic:
        """``1 / (1 - p)`` in ``dtype`` (the factor of a kept weight)."""
        return np.dtype(dtype).type(1.0 / (1.0 - self.p))

    def key(self):
        return self.seed & _WORD, (self.seed >> 32) & _WORD

    def row(self, b: int, h: int) -> int:
        return (self.batch_offset + int(b)) * self.heads + self.head_offset + int(h)

    def keep(self, b: int, h: int, q_pos, kv_pos) -> np.ndarray:
        """``(len(q_pos), len(kv_pos))`` bool: which weights of query head ``h`` of
        batch entry ``b`` survive, for global positions ``q_pos``, ``kv_pos``."""
        i = np.asarray(q_pos, dtype=np.uint64)[:, None]
        j = np.asarray(kv_pos, dtype=np.uint64)[None, :]
        low, shift = np.uint64(_WORD), np.uint64(32)
        mixed = (i >> shift) | ((j >> shift) << np.uint64(16))
        word0 = philox4x32(j & low, i & low, mixed, self.row(b, h), *self.key())[0]
        return word0.astype(np.uint64) >= np.uint64(self.threshold)

    def multiplier(self, b: int, h: int, q_pos, kv_pos, dtype) -> np.ndarray:
        """``keep * rescale`` in ``dtype``: the factor of each weight (0 when dropped)."""
        return np.where(self.keep(b, h, q_pos, kv_pos), self.rescale(dtype), 0).astype(dtype)

    def kernel_scalars(self, dtype):
        """``DROPOUT_PARAMS`` of common.cuh: ``(on int32, key0 uint32, key1 uint32,
        threshold uint64, rescale, heads int64, batch_offset int64, head_offset int64)``
        with ``rescale`` in the compute ``dtype``."""
        k0, k1 = self.key()
        return (np.int32(1), np.uint32(k0), np.uint32(k1), np.uint64(self.threshold),
                self.rescale(dtype), np.int64(self.heads), np.int64(self.batch_offset),
                np.int64(self.head_offset))


def no_dropout_scalars(dtype):
    """``DROPOUT_PARAMS`` values that switch dropout off."""
    return (np.int32(0), np.uint32(0), np.uint32(0), np.uint64(0), np.dtype(dtype).type(1),
            np.int64(1), np.int64(0), np.int64(0))


def kernel_values(dropout, dtype):
    """The CUDA kernels' ``DROPOUT_PARAMS`` values of a spec's ``dropout`` (None: off) in the
    compute ``dtype``."""
    return no_dropout_scalars(dtype) if dropout is None else dropout.kernel_scalars(dtype)


def validate(p, seed) -> Optional[str]:
    """The problem with ``dropout_p=p, dropout_seed=seed``, or None."""
    try:
        p = float(p)
    except (TypeError, ValueError):
        return f"dropout_p must be a number in [0, 1), got {p!r}"
    if not 0.0 <= p < 1.0:
        return f"dropout_p must be in [0, 1), got {p}"
    if p > 0 and seed is None:
        return "dropout_p > 0 needs a dropout_seed (an int in [0, 2^64)), the same on every rank"
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            return f"dropout_seed must be an int in [0, 2^64), got {seed!r}"
        if not 0 <= int(seed) < 1 << 64:
            return f"dropout_seed must be in [0, 2^64), got {seed}"
    return None
