"""PyTorch autograd for the sharded linear-attention layers: ``gated_delta_rule`` (and KDA),
``simple_gla`` (and GLA),
their ``causal_conv1d``, and ``relayout`` between the layouts of a hybrid model's layer kinds.

Each takes this rank's contiguous shard as torch tensors (flash-linear-attention's shapes, as
:mod:`ringmpi.linear_attention`) and returns ``(o, final_state)`` on the inputs' device and
dtype (float32 or float64; CPU tensors compute in NumPy, CUDA tensors in CuPy on their device
through DLPack, on torch's current stream: only the ranks' state maps cross to the host).  Both the forward and the
backward are collective over ``comm``: every rank calls the forward and every rank
backpropagates through it.  The backward recomputes the forward (its scan included).

Replicated tensors follow the bridges' rule (docs/design.md): ``initial_state``'s gradient (and
the convolution's weight's and bias') is this rank's own contribution (the framework's usual sum
over ranks gives the whole), and the final state, returned on every rank, takes the sum over
ranks of the gradients its copies received (one Allreduce in the backward).

Importing this module imports torch; ``import ringmpi`` does not.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

try:
    import torch
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("ringmpi.torch_linear needs PyTorch: pip install 'ringmpi[torch]'") from exc

from . import causal_conv as _conv
from . import linear_attention as _linear
from .relayout import relayout as _relayout_call
from .context import RingContext, comm_of
from .core.host import array_module
from .parallel.comm import resolve_comm
from .runtime.watchdog import phase
from .torch import on_torch_stream, to_array, to_tensor

__all__ = ["gated_delta_rule", "simple_gla", "causal_conv1d", "relayout"]


def _numpy(t):
    return None if t is None else t.detach().cpu().contiguous().numpy()


def _array(t):
    """What the linear layers compute on: CuPy over a CUDA tensor's memory (DLPack), else NumPy."""
    if t is not None and t.device.type == "cuda":
        return to_array(t.contiguous())
    return _numpy(t)


def _tensor(a, like: torch.Tensor):
    if a is None:
        return None
    if isinstance(a, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(a)).to(device=like.device)
    return to_tensor(array_module(a).ascontiguousarray(a), like.device)  # a CuPy array: DLPack


def _summed_over_ranks(comm, dfinal, shape, dtype):
    """The final state's whole gradient: the sum of every rank's copy's (zeros where unused)."""
    from mpi4py import MPI

    total = np.zeros(shape, dtype) if dfinal is None else np.array(_numpy(dfinal), dtype=dtype)
    with phase("the linear-attention final state's gradient (Allreduce)"):
        comm.Allreduce(MPI.IN_PLACE, total, op=MPI.SUM)
    return total


class _LinearFunction(torch.autograd.Function):
    """One sharded linear-attention call; ``delta`` picks the gated delta rule or scalar decay."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, delta, scale, output_final_state, cu_seqlens, comm):
        comm = resolve_comm(comm)
        per_key = g is not None and g.dim() == 4
        run = {(True, False): _linear.gated_delta_rule, (True, True): _linear.kda,
               (False, False): _linear.simple_gla, (False, True): _linear.gla}[delta, per_key]
        extra = (_array(beta),) if delta else ()
        with on_torch_stream(q.device):
            o, final = run(_array(q), _array(k), _array(v), _array(g), *extra, scale=scale,
                           initial_state=_array(initial_state), output_final_state=output_final_state,
                           cu_seqlens=cu_seqlens, context=RingContext(comm))
        ctx.save_for_backward(q, k, v, g, beta, initial_state)
        ctx.options = (delta, scale, output_final_state, cu_seqlens, comm)
        ctx.final_shape = None if final is None else final.shape
        with on_torch_stream(q.device):
            return _tensor(o, q), (None if final is None else _tensor(final, q))

    @staticmethod
    def backward(ctx, do, dfinal):
        q, k, v, g, beta, initial_state = ctx.saved_tensors
        delta, scale, output_final_state, cu_seqlens, comm = ctx.options
        with on_torch_stream(q.device):
            dt = _array(v).dtype
            do = np.zeros(v.shape, dt) if do is None else _array(do)  # host zeros move to q's device
            total = (_summed_over_ranks(comm, dfinal, ctx.final_shape, dt) if output_final_state else None)
            common = dict(dfinal_state=total, scale=scale, initial_state=_array(initial_state),
                          cu_seqlens=cu_seqlens, context=RingContext(comm), reduce_dinitial=False)
            per_key = g is not None and g.dim() == 4
            if delta:
                backward = _linear.kda_backward if per_key else _linear.gated_delta_rule_backward
                dq, dk, dv, dg, dbeta, dinit = backward(do, _array(q), _array(k), _array(v), _array(g),
                                                        _array(beta), **common)
            else:
                backward = _linear.gla_backward if per_key else _linear.simple_gla_backward
                dq, dk, dv, dg, dinit = backward(do, _array(q), _array(k), _array(v), _array(g), **common)
                dbeta = None
            return (_tensor(dq, q), _tensor(dk, q), _tensor(dv, q), _tensor(dg, q), _tensor(dbeta, q),
                    _tensor(dinit, q), None, None, None, None, None)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
                     scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None,
                     output_final_state: bool = False, cu_seqlens=None, context: Optional[RingContext] = None):
    """:func:`ringmpi.gated_delta_rule` on torch tensors, differentiable in q, k, v, g, beta and
    initial_state.  q, k: (B, T_local, H, K); v: (B, T_local, HV, V); g, beta: (B, T_local, HV);
    initial_state (B or N_docs, HV, K, V).  Returns ``(o, final_state or None)``.  A per-key
    ``g (B, T_local, HV, K)`` is :func:`ringmpi.kda`."""
    return _LinearFunction.apply(q, k, v, g, beta, initial_state, True, scale, output_final_state,
                                 None if cu_seqlens is None else np.asarray(_numpy(torch.as_tensor(cu_seqlens))),
                                 comm_of(context))


def simple_gla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: Optional[torch.Tensor] = None, *,
               scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None,
               output_final_state: bool = False, cu_seqlens=None, context: Optional[RingContext] = None):
    """:func:`ringmpi.simple_gla` (scalar decay; ``g=None``: plain linear attention) on torch
    tensors, differentiable in q, k, v, g and initial_state; shapes as :func:`gated_delta_rule`.
    A per-key ``g (B, T_local, HV, K)`` is :func:`ringmpi.gla`."""
    return _LinearFunction.apply(q, k, v, g, None, initial_state, False, scale, output_final_state,
                                 None if cu_seqlens is None else np.asarray(_numpy(torch.as_tensor(cu_seqlens))),
                                 comm_of(context))


class _CausalConv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, activation, cu_seqlens, comm):
        comm = resolve_comm(comm)
        y = _conv.causal_conv1d(_numpy(x), _numpy(weight), _numpy(bias), activation=activation,
                                cu_seqlens=cu_seqlens, context=RingContext(comm))
        ctx.save_for_backward(x, weight, bias)
        ctx.options = (activation, cu_seqlens, comm)
        return _tensor(y, x)

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias = ctx.saved_tensors
        activation, cu_seqlens, comm = ctx.options
        dx, dweight, dbias = _conv.causal_conv1d_backward(_numpy(dy), _numpy(x), _numpy(weight), _numpy(bias),
                                                          activation=activation, cu_seqlens=cu_seqlens,
                                                          context=RingContext(comm),
                                                          reduce_params=False)
        return _tensor(dx, x), _tensor(dweight, x), _tensor(dbias, x), None, None, None


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                  activation: Optional[str] = None, cu_seqlens=None,
                  context: Optional[RingContext] = None) -> torch.Tensor:
    """:func:`ringmpi.causal_conv1d` on torch tensors (x (B, T_local, D), weight (D, W), bias (D,)),
    differentiable in all three; the halo's gradient reaches the rank that owns those tokens."""
    return _CausalConv.apply(x, weight, bias, activation,
                             None if cu_seqlens is None else np.asarray(_numpy(torch.as_tensor(cu_seqlens))),
                             comm_of(context))


class _Relayout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, source, target, axis, comm):
        comm = resolve_comm(comm)
        ctx.options = (source, target, axis, comm)
        return _tensor(_relayout_call(_numpy(x), source, target, context=RingContext(comm), axis=axis), x)

    @staticmethod
    def backward(ctx, dy):
        source, target, axis, comm = ctx.options
        dx = _relayout_call(_numpy(dy), target, source, context=RingContext(comm), axis=axis)
        return _tensor(dx, dy), None, None, None, None


def relayout(x: torch.Tensor, source, target, *, context: Optional[RingContext] = None, axis: int = 1) -> torch.Tensor:
    """:func:`ringmpi.relayout` on a torch tensor; its gradient goes back the other way."""
    return _Relayout.apply(x, source, target, axis, comm_of(context))
