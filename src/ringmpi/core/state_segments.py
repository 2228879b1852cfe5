"""The runs of a rank's shard that the linear-attention recurrence treats as one: cut at documents.

Documents are given by their boundaries in global positions (``cu_seqlens``: ``[0, ..., N]``;
without documents ``[0, N]``).  A shard ``[start, stop)`` falls into segments, each inside one
document; the first may continue a document begun on an earlier rank (it does not start its
document: the *head*, the one segment whose entering state comes from the ranks' scan), every
other segment starts its document from the document's initial state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

import numpy as np


@dataclass(frozen=True)
class Segment:
    lo: int        # local token range [lo, hi)
    hi: int
    doc: int       # which document (index into the boundaries)
    starts: bool   # its first token is its document's first
    ends: bool     # its last token is its document's last


def segments(start: int, stop: int, bounds: Sequence[int]) -> List[Segment]:
    """The segments of the shard ``[start, stop)`` of a sequence with document ``bounds``."""
    bounds = np.asarray(bounds)
    cuts = sorted({start, stop} | {int(b) for b in bounds if start < b < stop})
    out = []
    for a, z in zip(cuts[:-1], cuts[1:]):
        d = int(np.searchsorted(bounds, a, side="right")) - 1  # the non-empty document at a
        out.append(Segment(a - start, z - start, d, a == bounds[d], z == bounds[d + 1]))
    return out


def empty_documents(bounds: Sequence[int]) -> List[int]:
    """Documents of no tokens: their final state is their initial state."""
    return [d for d in range(len(bounds) - 1) if bounds[d] == bounds[d + 1]]
