"""The shape rule of an attention call's ``q``, ``k``, ``v``, stated once.

``q (B, S_q, H, D)``, ``k (B, S_kv, H_kv, D)``, ``v (B, S_kv, H_kv, D_v)`` (flash-attention's
layout, sequence-major) fit together when ``k`` and ``v`` agree but for the last dim (the
value head dim ``D_v >= 1`` may differ from ``D``, as in MLA), ``q`` and ``k`` share ``B``
and ``D >= 1``, and ``H`` is a multiple of ``H_kv >= 1`` (GQA/MQA).  The ring calls, decode
(``k_cache``, ``v_cache``) and the file job's input check (global dataset shapes) all ask
:func:`qkv_problem`; the ones whose arguments have other names word its rule themselves.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

RULES = ("kv", "value_dim", "batch", "head_dim", "heads", "empty_head_dim")


def qkv_problem(q: Sequence[int], k: Sequence[int], v: Sequence[int]) -> Optional[Tuple[str, str]]:
    """``(rule, message)`` of the first rule (of :data:`RULES`, in order) that the 4-D shapes
    ``q``, ``k``, ``v`` break, the message in the ring calls' words; None when they fit."""
    q, k, v = tuple(q), tuple(k), tuple(v)
    if k[:3] != v[:3]:
        return "kv", (f"k and v must agree on (B, S_kv_local, H_kv), got k {k} and v {v}"
                      " (only the last dim, D_v, may differ)")
    if v[3] < 1:
        return "value_dim", "value head dim D_v must be >= 1"
    if q[0] != k[0]:
        return "batch", f"q and k/v batch sizes differ: {q[0]} vs {k[0]}"
    if q[3] != k[3]:
        return "head_dim", f"q and k/v head dims differ: {q[3]} vs {k[3]}"
    if k[2] < 1 or q[2] % k[2] != 0:
        return "heads", f"q heads ({q[2]}) must be a multiple of k/v heads ({k[2]})"
    if q[3] < 1:
        return "empty_head_dim", "head dim must be >= 1"
    return None
