"""The short causal convolution of linear-attention layers over a sequence sharded across ranks.

``causal_conv1d`` is the depthwise causal convolution (kernel width ``W``, usually 4) that
Gated DeltaNet, Mamba-2 and KDA layers apply to q, k, v before the recurrence; on contiguous
shards (rank order is token order, any lengths, empty shards included) a rank needs only the
``W - 1`` tokens before its first one, its halo (``parallel/halo.py``), masked at document
starts (``cu_seqlens`` in global positions); the backward sends the halo's gradient back to
its owners.  The result equals one process's convolution of the whole sequence.

Shapes: ``x (B, T_local, D)`` sequence-major (the layers' layout), ``weight (D, W)``,
``bias (D,)``; float32 or float64.  ``activation``: None or ``"silu"``.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from .core import causal_conv as _conv
from .core.host import to_host
from .parallel import halo as _halo
from .context import RingContext, comm_of
from .parallel.comm import resolve_comm
from .runtime.errors import ConfigError, agree_shards
from .runtime.watchdog import phase


def _problem(x, weight, bias, activation, cu) -> Optional[str]:
    if x.ndim != 3:
        return f"x must be (B, T, D), got {x.shape}"
    if weight.ndim != 2 or weight.shape[0] != x.shape[2] or weight.shape[1] < 1:
        return f"weight must be (D, W) with x's D = {x.shape[2]}, got {weight.shape}"
    if bias is not None and bias.shape != (x.shape[2],):
        return f"bias must be (D,) = ({x.shape[2]},), got {bias.shape}"
    dtypes = {a.dtype.name for a in (x, weight) + (() if bias is None else (bias,))}
    if len(dtypes) != 1 or x.dtype.name not in ("float32", "float64"):
        return f"x, weight and bias must share one dtype, float32 or float64, got {sorted(dtypes)}"
    if activation not in _conv.ACTIVATIONS:
        return f"activation must be one of {_conv.ACTIVATIONS}, got {activation!r}"
    if cu is not None and (cu.ndim != 1 or len(cu) < 2 or cu[0] != 0 or np.any(np.diff(cu) < 0)):
        return "cu_seqlens must be non-decreasing document boundaries [0, ..., N] in global positions"
    return None


def _prepare(x, weight, bias, activation, cu_seqlens, comm, extra=None):
    comm = resolve_comm(comm)
    x, weight, bias = (None if a is None else np.asarray(to_host(a)) for a in (x, weight, bias))
    cu = None if cu_seqlens is None else np.asarray(to_host(cu_seqlens)).astype(np.int64)
    problem = _problem(x, weight, bias, activation, cu) or extra
    signature = None if problem is not None else (
        x.shape[0], x.shape[2], weight.shape[1], x.dtype.name, bias is None, activation,
        None if cu is None else cu.tobytes().hex())
    lengths = agree_shards(comm, problem, signature, x.shape[1] if x.ndim == 3 else 0,
                           "B, D, W, dtype, bias, activation or cu_seqlens")
    n, rank = sum(lengths), comm.Get_rank()
    if cu is not None and cu[-1] != n:
        raise ConfigError(f"cu_seqlens ends at {cu[-1]}, but the ranks' shards hold N = {n} tokens")
    bounds = np.array([0, n]) if cu is None else cu
    width = weight.shape[1]
    start = sum(lengths[:rank])
    x_ext = np.concatenate([_halo.exchange(comm, x, lengths, width - 1), x], axis=1)
    mask = _conv.tap_mask(start, x.shape[1], width, bounds)
    return comm, lengths, x_ext, mask


def causal_conv1d(x, weight, bias=None, *, activation: Optional[str] = None, cu_seqlens=None,
                  context: Optional[RingContext] = None):
    """The causal depthwise convolution of this rank's contiguous shard ``x (B, T_local, D)``:
    ``y (B, T_local, D)``, as one process computes it on the whole sequence.  Collective."""
    comm, _, x_ext, mask = _prepare(x, weight, bias, activation, cu_seqlens, comm_of(context))
    y, _ = _conv.forward(x_ext, np.asarray(to_host(weight)), None if bias is None else np.asarray(to_host(bias)),
                         mask, activation)
    return y.astype(x_ext.dtype, copy=False)


def causal_conv1d_backward(dy, x, weight, bias=None, *, activation: Optional[str] = None, cu_seqlens=None,
                           context: Optional[RingContext] = None, reduce_params: bool = True):
    """``(dx, dweight, dbias)`` of :func:`causal_conv1d` (``dbias`` None without bias).  The halo's
    gradient goes back to the ranks that own those tokens, so ``dx`` is this shard's whole
    gradient.  ``dweight``/``dbias`` are summed over ranks, or with ``reduce_params=False`` this
    rank's share (what a framework bridge gives a replicated parameter).  Collective."""
    from mpi4py import MPI

    dy = np.asarray(to_host(dy))
    extra = None if dy.shape == np.shape(x) else f"dy must have x's shape {np.shape(x)}, got {dy.shape}"
    comm, lengths, x_ext, mask = _prepare(x, weight, bias, activation, cu_seqlens, comm_of(context),
                                          extra)
    weight = np.asarray(to_host(weight))
    bias = None if bias is None else np.asarray(to_host(bias))
    _, z = _conv.forward(x_ext, weight, bias, mask, activation)
    dx_ext, dweight, dbias = _conv.backward(dy.astype(x_ext.dtype, copy=False), x_ext, weight, mask, z, activation)
    width = weight.shape[1]
    dx = dx_ext[:, width - 1:] + _halo.send_back(comm, dx_ext[:, :width - 1], lengths, width - 1)
    dweight, dbias = np.ascontiguousarray(dweight), np.ascontiguousarray(dbias)  # one memory order on every rank
    if reduce_params:
        with phase("the convolution's parameter gradients (Allreduce)"):
            comm.Allreduce(MPI.IN_PLACE, dweight, op=MPI.SUM)
            comm.Allreduce(MPI.IN_PLACE, dbias, op=MPI.SUM)
    return dx, dweight, (None if bias is None else dbias)
