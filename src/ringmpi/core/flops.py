"""FlashAttention's FLOP count, the one formula behind every TFLOP/s ringmpi prints.

Forward ``4 * B * H * N_q * N_kv * D`` (two matmuls of ``2 * N_q * N_kv * D``
per head), halved when causal; backward 2.5x forward (five matmuls to the
forward's two); forward+backward 3.5x forward.  Masked tiles that are skipped
still count, as in FlashAttention's benchmarks, so figures compare across
masks and with other implementations.
"""

from __future__ import annotations

PHASE_FACTORS = {"forward": 1.0, "backward": 2.5, "forward+backward": 3.5}


def attention_flops(batch: int, heads: int, n_q: int, n_kv: int, dim: int, causal: bool = False,
                    phase: str = "forward", dim_v=None) -> float:
    """FLOPs of ``phase`` (``"forward"``, ``"backward"`` or ``"forward+backward"``).

    ``heads`` counts query heads (GQA shares K/V heads, not work).  With a value
    head dim ``dim_v`` (default ``dim``) ``D`` is their mean: ``Q K^T`` costs
    ``2 * N_q * N_kv * D`` and ``P V`` ``2 * N_q * N_kv * D_v``.
    """
    if dim_v is not None and dim_v != dim:
        dim = (dim + dim_v) / 2
    if phase not in PHASE_FACTORS:
        raise ValueError(f"phase must be one of {', '.join(PHASE_FACTORS)}, got {phase!r}")
    fwd = 4.0 * batch * heads * n_q * n_kv * dim
    if causal:
        fwd /= 2
    return fwd * PHASE_FACTORS[phase]
