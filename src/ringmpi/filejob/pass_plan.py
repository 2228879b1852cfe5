"""Passes of a file job: which batch entries and heads one ring call covers.

``ringmpi run`` processes the input in passes so that a rank holds one pass's
shard at a time: :func:`plan_passes` splits (batch entries, kv-head groups)
under a per-rank byte budget, :func:`pass_boxes` gives each pass's HDF5
selection.  Pure functions of an :class:`~ringmpi.filejob.hdf5.InputSpec`; no MPI.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional

DEFAULT_PASS_BYTES = 4 << 30


@dataclass(frozen=True)
class Pass:
    """One slice of the work: batch entries ``[b0, b1)`` and kv heads ``[g0, g1)``."""

    b0: int
    b1: int
    g0: int
    g1: int


def bytes_per_batch_entry(spec, world_size: int, kv_heads: int) -> int:
    """Estimated per-rank bytes of one batch entry holding ``kv_heads`` kv heads (their whole GQA groups).

    q, o, do, dq in the input dtype plus head-major copies and accumulators in
    the compute dtype (ten arrays of q's shape); k, v, dk, dv plus two ring
    buffers of each and gradient messages (fourteen of k's shape); the softmax
    statistics (two per query row).  Elements are counted at the compute
    width: 4 bytes (float16/float32 inputs compute in float32), 8 for float64.
    """
    elem = max(4, spec.itemsize)
    rows_q = math.ceil(spec.n_q / world_size)
    rows_kv = math.ceil(spec.n_kv / world_size)
    q_elems = rows_q * kv_heads * spec.group
    dim = -(-(spec.dim + spec.dim_v) // 2)  # half the arrays are D_v wide
    return (q_elems * dim * elem * 10 + rows_kv * kv_heads * dim * elem * 14
            + q_elems * 2 * elem)


def plan_passes(spec, world_size: int, heads_per_pass: Optional[int], budget: int) -> List[Pass]:
    """Split (batch, kv-head groups) into passes whose per-rank shard fits ``budget`` bytes.

    ``heads_per_pass`` counts query heads and must be a multiple of the GQA group
    ``H // H_kv`` so each group stays whole; None keeps all heads together.  Batch
    entries are then grouped as many per pass as the budget allows (at least one).
    """
    kv_per = spec.kv_heads if heads_per_pass is None else max(1, heads_per_pass // spec.group)
    per_entry = bytes_per_batch_entry(spec, world_size, kv_per)
    b_per = max(1, min(spec.batch, budget // max(1, per_entry)))
    return [Pass(b0, min(b0 + b_per, spec.batch), g0, min(g0 + kv_per, spec.kv_heads))
            for b0 in range(0, spec.batch, b_per) for g0 in range(0, spec.kv_heads, kv_per)]


def pass_boxes(spec, p: Pass):
    """Per-dataset ``(row_axis, box)`` of one pass for q-like, k/v-like and lse datasets.

    ``box`` gives ``(start, stop)`` per axis of the dataset as stored; the row
    (token) axis entry is a placeholder, filled per rank by :class:`~ringmpi.filejob.hdf5.ShardIO`.
    ``"q"``/``"kv"`` are ``D`` wide (q, dq / k, dk), ``"o"``/``"v"`` ``D_v`` wide
    (o, do / v, dv).
    """
    h0, h1 = p.g0 * spec.group, p.g1 * spec.group
    d = (0, spec.dim)
    dv = (0, spec.dim_v)
    if spec.rank4:
        b = (p.b0, p.b1)
        return {"q": (1, [b, (0, 0), (h0, h1), d]), "kv": (1, [b, (0, 0), (p.g0, p.g1), d]),
                "lse": (2, [b, (h0, h1), (0, 0)]),
                "o": (1, [b, (0, 0), (h0, h1), dv]), "v": (1, [b, (0, 0), (p.g0, p.g1), dv])}
    return {"q": (0, [(0, 0), (h0, h1), d]), "kv": (0, [(0, 0), (p.g0, p.g1), d]),
            "lse": (1, [(h0, h1), (0, 0)]),
            "o": (0, [(0, 0), (h0, h1), dv]), "v": (0, [(0, 0), (p.g0, p.g1), dv])}
