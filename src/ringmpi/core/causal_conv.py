"""The short causal depthwise convolution in front of linear-attention layers, on one shard.

``y_t = act(bias + sum_j w[:, j] * x_{t - (W-1) + j})`` per channel (kernel width ``W``), with
every tap before the token's document start (or before position 0) reading zero.  A shard
computes on its tokens preceded by a *halo*, the ``W - 1`` tokens before its first one
(``parallel/halo.py`` brings them from the ranks that own them); the taps' mask comes from
global positions, so documents need nothing else.  ``activation``: None or ``"silu"``
(``"swish"``), as the causal-conv1d package.

Arrays: ``x_ext (B, W - 1 + T, D)`` (halo first), ``weight (D, W)``, ``bias (D,)`` or None,
``y (B, T, D)``.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

ACTIVATIONS = (None, "silu", "swish")


def tap_mask(start: int, t: int, width: int, bounds: Sequence[int]) -> np.ndarray:
    """``(T, W)``: whether tap ``j`` of the token at global position ``start + i`` reads a token
    of its own document (``bounds``: document boundaries ``[0, ..., N]``)."""
    pos = start + np.arange(t)
    doc_start = np.asarray(bounds)[np.searchsorted(bounds, pos, side="right") - 1]
    read = pos[:, None] - (width - 1) + np.arange(width)[None, :]
    return read >= doc_start[:, None]


def _taps(x_ext, mask, t):
    """``(B, T, W, D)`` view-free stack of what each tap reads, masked."""
    width = mask.shape[1]
    return np.stack([x_ext[:, j:j + t] * mask[None, :, j, None] for j in range(width)], axis=2)


def forward(x_ext, weight, bias, mask, activation: Optional[str]):
    """``(y, z)``: the outputs and their pre-activation (kept for the backward)."""
    t = mask.shape[0]
    z = np.einsum("btwd,dw->btd", _taps(x_ext, mask, t), weight)
    if bias is not None:
        z = z + bias
    return (z if activation is None else z / (1 + np.exp(-z))), z


def backward(dy, x_ext, weight, mask, z, activation: Optional[str]):
    """``(dx_ext, dweight, dbias)``; ``dx_ext``'s first ``W - 1`` rows are the halo's gradient."""
    t, width = mask.shape
    if activation is None:
        dz = dy
    else:
        s = 1 / (1 + np.exp(-z))
        dz = dy * (s + z * s * (1 - s))
    dweight = np.einsum("btwd,btd->dw", _taps(x_ext, mask, t), dz)
    dx_ext = np.zeros_like(x_ext)
    for j in range(width):
        dx_ext[:, j:j + t] += dz * weight[:, j] * mask[None, :, j, None]
    return dx_ext, dweight, dz.sum(axis=(0, 1))
