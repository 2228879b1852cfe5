"""Score modifiers with per-head data: one object each, from its rule to the kernels' values.

A modifier changes visible scores, never visibility: every backend adds its
per-head term after the scale and the logit softcap and before the mask, in
global positions (so it is exact for every P, layout and schedule), and its
derivative with respect to the score is 1, so the backward's ``dS`` needs
nothing more.  Each modifier is one class here, listed in :data:`MODIFIERS`,
which states everything the rest of the package asks of it:

* ``field``: the :class:`~ringmpi.options.AttentionOptions` field that holds
  its ``(H,)`` values (a keyword of every public call, a flag of the file job);
* :meth:`problem`: the rule of those values (shape, dtype, finite);
* :meth:`of`: the modifier of checked values; :meth:`for_heads`: the modifier
  of a call over some of the heads (head x ring, the file job's passes);
* :meth:`terms`: its formula, head by head, for the NumPy tiles and the dense
  references;
* :meth:`kernel_values`: the ``(H,)`` float32 values the CUDA kernels fetch per
  head; its index in :data:`MODIFIERS` is its case in ``modifier_term``
  (``kernels/common.cuh``), which takes its formula from ``kernels/rules.h`` (ALiBi:
  ``alibi_score``, which the NumPy tiles run too, through ``tile_pass.modifier_terms``).

A new modifier is a class here, its case in ``modifier_term`` and its field
in ``options.py`` (with one keyword in each public call that lists options by
name); docs/design.md has the recipe.

* **ALiBi** (Press et al.; FlashAttention 2's convention): the score of query
  ``i`` and key ``j`` of head ``h`` gains ``-slopes[h] * |i + N_kv - N_q - j|``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, Optional, Tuple

import numpy as np

from .host import to_host

MAX_KERNEL_MODIFIERS = 4  # the kernels' per-head value slots: their MAX_HEAD_MODS (a -D define, KERNEL_DEFINES)


@dataclass(frozen=True)
class HeadModifier:
    """A score modifier with one float32 value per query head (``values``, host floats)."""

    values: Tuple[float, ...]

    field: ClassVar[str]          # the AttentionOptions field holding its (H,) values
    what: ClassVar[str]           # what one value is, for messages ("slopes")
    DTYPES: ClassVar[Tuple[str, ...]] = ("float32",)

    @classmethod
    def problem(cls, values, heads: int) -> Optional[str]:
        """The problem with the field's ``values`` (None when fine): shape ``(H,)``, float32, finite."""
        if values is None:
            return None
        shape = getattr(values, "shape", None)
        if shape is None or tuple(shape) != (heads,):
            return f"{cls.field} must have shape (H,) = ({heads},), got {None if shape is None else tuple(shape)}"
        if str(values.dtype) not in cls.DTYPES:
            return f"{cls.field} must be {' or '.join(cls.DTYPES)}, got dtype {values.dtype}"
        host = to_host(values)
        if not np.isfinite(host).all():
            return f"{cls.field} must be finite, got {host[~np.isfinite(host)][0]}"
        return None

    @classmethod
    def of(cls, values) -> Optional["HeadModifier"]:
        """The modifier of checked ``values`` (an (H,) array of any backend), or None."""
        if values is None:
            return None
        return cls(tuple(float(x) for x in to_host(values).astype(np.float32)))

    def for_heads(self, part: slice) -> "HeadModifier":
        """This modifier for the query heads ``part`` of this call (a call over some heads)."""
        return type(self)(self.values[part])

    def terms(self, q_pos, kv_pos, offset: int, dtype) -> Callable[[int], np.ndarray]:
        """``h -> (len(q_pos), len(kv_pos))`` head ``h``'s additive score term in ``dtype`` over
        global positions (``offset = N_kv - N_q``); shared work is done once, here."""
        raise NotImplementedError

    def kernel_values(self) -> np.ndarray:
        """``(H,)`` float32: the per-head values the CUDA kernels fetch (``head_values``)."""
        return np.asarray(self.values, dtype=np.float32)


@dataclass(frozen=True)
class Alibi(HeadModifier):
    """ALiBi: head ``h``'s score of query ``i``, key ``j`` gains ``-slopes[h] * |i + offset - j|``."""

    field: ClassVar[str] = "alibi_slopes"
    what: ClassVar[str] = "slopes"

    @property
    def slopes(self) -> Tuple[float, ...]:
        return self.values

    def terms(self, q_pos, kv_pos, offset: int, dtype) -> Callable[[int], np.ndarray]:
        q_pos = np.asarray(q_pos, dtype=np.int64)
        kv_pos = np.asarray(kv_pos, dtype=np.int64)
        dist = np.abs(q_pos[:, None] + int(offset) - kv_pos[None, :]).astype(dtype)  # in int64, then dtype
        return lambda h: dist * dist.dtype.type(-self.values[h])


MODIFIERS: Tuple[type, ...] = (Alibi,)  # index = the modifier's case in kernels/common.cuh (modifier_term)
FIELDS: Tuple[str, ...] = tuple(m.field for m in MODIFIERS)
assert len(MODIFIERS) <= MAX_KERNEL_MODIFIERS


def kernel_index(modifier: HeadModifier) -> int:
    """The modifier's case in ``modifier_term`` and slot in the kernels' per-head values."""
    return MODIFIERS.index(type(modifier))


def of_fields(values_by_field) -> Tuple[HeadModifier, ...]:
    """The modifiers of ``{field: values or None}`` (checked), in :data:`MODIFIERS`' order."""
    return tuple(m.of(values_by_field[m.field]) for m in MODIFIERS if values_by_field.get(m.field) is not None)
