"""PyTorch interop: ring attention as a differentiable function on torch tensors.

``ring_attention(q, k, v, comm=..., layout=..., causal=...)`` takes this
rank's shards as torch tensors in the flash-attention layout
``(B, S_local, H, D)`` and returns ``o`` on the same device and dtype; it is
a ``torch.autograd.Function``: the forward calls :func:`ringmpi.ring_attention`,
the backward :func:`ringmpi.ring_attention_backward` with the saved ``o`` and
``lse``.  Both are collective over ``comm``: every rank calls the forward and
every rank backpropagates through it.

Zero copy both ways: CPU tensors are handed over as NumPy views (bfloat16 as
``ml_dtypes.bfloat16`` over the same bytes), CUDA tensors through DLPack as
CuPy arrays (bfloat16 as ``ml_dtypes.bfloat16`` CuPy arrays, CuPy >= 14), and the
results come back the same way.  On CUDA the work is queued on torch's
current stream, so results need no extra synchronisation.

Importing this module imports torch; ``import ringmpi`` does not.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Optional, Union

import ml_dtypes
import numpy as np

try:
    import torch
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("ringmpi.torch needs PyTorch: pip install 'ringmpi[torch]'") from exc

import ringmpi
from .errors import agree
from .layout import Layout
from .options import AttentionOptions
from .ring import resolve_comm

__all__ = ["ring_attention", "scaled_dot_product_attention", "RingSelfAttention"]


# ------------------------------------------------------------ conversions
def to_array(t: torch.Tensor):
    """The backend array over ``t``'s memory: NumPy for CPU, CuPy for CUDA.

    ``t`` must be contiguous.  bfloat16 becomes ``ml_dtypes.bfloat16`` on
    both (viewed through int16, the DLPack type every version exchanges).
    """
    t = t.detach()
    bf16 = t.dtype == torch.bfloat16
    if bf16:
        t = t.view(torch.int16)
    if t.device.type == "cuda":
        import cupy
        a = cupy.from_dlpack(t)
        return a.view(ml_dtypes.bfloat16) if bf16 else a
    a = t.numpy()
    return a.view(ml_dtypes.bfloat16) if bf16 else a


def to_tensor(a, device: torch.device) -> torch.Tensor:
    """A torch tensor over the memory of backend array ``a`` (the inverse of
    :func:`to_array`), moved to ``device`` only if it lives elsewhere."""
    bf16 = a.dtype == ml_dtypes.bfloat16
    if isinstance(a, np.ndarray):
        t = torch.from_numpy(a.view(np.int16) if bf16 else a)
    else:
        t = torch.from_dlpack(a.view(np.int16) if bf16 else a)
    if bf16:
        t = t.view(torch.bfloat16)
    return t if t.device == device else t.to(device)


@contextlib.contextmanager
def _on_torch_stream(device: torch.device):
    """On CUDA: make ``device`` and torch's current stream CuPy's current ones."""
    if device.type != "cuda":
        yield
        return
    import cupy
    stream = torch.cuda.current_stream(device)
    if hasattr(cupy.cuda.Stream, "from_external"):  # CuPy >= 14
        external = cupy.cuda.Stream.from_external(stream)
    else:
        external = cupy.cuda.ExternalStream(stream.cuda_stream, device.index)
    with cupy.cuda.Device(device.index), external:
        yield


def _host_ids(ids):
    """Segment ids as a host array (a torch tensor of any device is copied to the host)."""
    if isinstance(ids, torch.Tensor):
        return ids.detach().cpu().numpy()
    return ids


def _backend_problem(backend: str, q, k, v) -> tuple:
    """(backend name, this rank's problem or None) for tensors ``q, k, v``."""
    tensors = (("q", q), ("k", k), ("v", v))
    for name, t in tensors:
        if not isinstance(t, torch.Tensor):
            return backend, f"{name} must be a torch.Tensor, got {type(t).__name__}"
    devices = {t.device for _, t in tensors}
    if len(devices) > 1:
        return backend, "q, k, v must be on one device, got " + ", ".join(f"{n} on {t.device}" for n, t in tensors)
    kind = q.device.type
    if kind not in ("cpu", "cuda"):
        return backend, f"tensors on {q.device} are not supported: use CPU or CUDA tensors"
    want = "cupy" if kind == "cuda" else "numpy"
    if backend not in ("auto", want):
        return backend, f"backend {backend!r} cannot run on {kind} tensors: use backend='auto' or {want!r}"
    return want, None


# ------------------------------------------------------------ autograd
@dataclass(frozen=True)
class _Call:
    """What one call's forward hands its backward: the options and where the shards live."""

    options: AttentionOptions
    comm: object
    layout: object
    segment_ids_q: object
    segment_ids_kv: object
    backend: str
    stats: Optional[list]

    def options_with(self, sinks) -> AttentionOptions:
        """The options with ``sinks`` (a tensor or None) as this backend's array."""
        return self.options if sinks is None else replace(self.options, sinks=to_array(sinks))

    def where(self) -> dict:
        return dict(comm=self.comm, layout=self.layout, segment_ids_q=self.segment_ids_q,
                    segment_ids_kv=self.segment_ids_kv, backend=self.backend, stats=self.stats)


def _forward(q, k, v, call: _Call, sinks=None):
    with _on_torch_stream(q.device):
        o, lse = ringmpi.ring_attention(to_array(q), to_array(k), to_array(v),
                                        options=call.options_with(sinks), **call.where())
        return to_tensor(o, q.device), to_tensor(lse, q.device)


class _RingAttention(torch.autograd.Function):
    """o, lse = f(q, k, v, sinks); lse is not differentiable; sinks may be None."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, call):
        o, lse = _forward(q, k, v, call, sinks)
        ctx.save_for_backward(q, k, v, o, lse, *(() if sinks is None else (sinks,)))
        ctx.call = call
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse, *sinks = ctx.saved_tensors
        sinks = sinks[0] if sinks else None
        with torch.no_grad(), _on_torch_stream(q.device):
            grads = ringmpi.ring_attention_backward(*(to_array(x) for x in (do.contiguous(), q, k, v, o, lse)),
                                                    options=ctx.call.options_with(sinks), **ctx.call.where())
            devices = (q.device,) * 3 + (None if sinks is None else sinks.device,)
            grads = [to_tensor(np.ascontiguousarray(g) if i == 3 else g, devices[i]) if want else None
                     for i, (g, want) in enumerate(zip(tuple(grads) + (None,) * (4 - len(grads)),
                                                        ctx.needs_input_grad))]
        if torch.is_grad_enabled():  # create_graph=True: these gradients must not be differentiated
            wanted = [g for g in grads if g is not None]
            refused = iter(_NotDifferentiable.apply(*(g.detach().requires_grad_(True) for g in wanted)))
            grads = [None if g is None else next(refused) for g in grads]
        return tuple(grads) + (None,)


class _NotDifferentiable(torch.autograd.Function):
    """Identity whose backward raises: the gradients of :class:`_RingAttention`
    under ``create_graph=True``, so that a double backward fails loudly instead
    of treating them as constants."""

    @staticmethod
    def forward(ctx, *grads):
        return tuple(g.view_as(g) for g in grads)

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError("ringmpi.torch.ring_attention cannot be differentiated twice: its backward "
                           "(ringmpi.ring_attention_backward) has no derivative of its own")


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, comm=None,
                   layout: Union[str, Layout] = "contiguous", causal: bool = False, window=None,
                   segment_ids_q=None, segment_ids_kv=None, softmax_scale: Optional[float] = None,
                   return_lse: bool = False, backend: str = "auto", timeout: Optional[float] = None,
                   check_finite: bool = False, stats: Optional[list] = None,
                   head_parallel: Union[int, str, None] = None, sinks: Optional[torch.Tensor] = None,
                   softcap: Optional[float] = None, dropout_p: float = 0.0, dropout_seed: Optional[int] = None,
                   alibi_slopes=None):
    """Exact softmax attention over a sequence sharded across ranks, differentiable.

    Collective over ``comm``, in the forward and in the backward: every rank
    calls it with its own shard, and every rank backpropagates through it.

    Parameters
    ----------
    q : (B, S_q_local, H, D) tensor, float16/bfloat16/float32/float64, CPU or CUDA
        This rank's queries: the global tokens ``Layout(layout, N_q, P).indices(rank)``.
    k, v : (B, S_kv_local, H_kv, D), (B, S_kv_local, H_kv, D_v) tensors, same dtype and
        device; ``H % H_kv == 0``; ``D_v`` may differ from ``D`` (as in torch's SDPA).
    comm, layout, causal, window, softmax_scale, timeout, check_finite, head_parallel, dropout_p, dropout_seed
        As in :func:`ringmpi.ring_attention` (``comm=None``: a library-owned
        duplicate of ``COMM_WORLD``); the backward regenerates the dropout mask
        from the seed.
    segment_ids_q, segment_ids_kv : (B, S_q_local), (B, S_kv_local) integer tensors or arrays, optional
        Packed documents: a query sees only keys with the same id.
    return_lse : bool
        Also return ``lse``.  It is not differentiable: no gradient flows back through it.
    backend : "auto" | "numpy" | "cupy"
        "auto" follows the device (NumPy for CPU tensors, CuPy for CUDA); a
        name that does not fit the device is an error.
    stats : list, optional
        Ring step records of the forward are appended to it, and those of the
        backward when it runs.
    sinks : (H,) float32/float64 tensor, optional, the same on every rank
        Attention sinks (see :func:`ringmpi.ring_attention`); when it requires a
        gradient it receives ``dsinks`` summed over all ranks (every rank gets the
        same value: do not sum it again across ranks).
    softcap : float > 0, optional
        Logit softcap, as in :func:`ringmpi.ring_attention`.
    alibi_slopes : (H,) float32 tensor or array, optional
        ALiBi, as in :func:`ringmpi.ring_attention` (no gradient flows to it).

    Returns
    -------
    o : (B, S_q_local, H, D_v) tensor, the input dtype and device.
    lse : (B, H, S_q_local) float32 tensor (float64 for float64 inputs), with ``return_lse``.

    Notes
    -----
    No copies: tensors reach the backend as NumPy views (CPU) or through
    DLPack as CuPy arrays (CUDA), and ``o``, ``lse`` and the gradients are
    the backend's own arrays.  Non-contiguous inputs are made contiguous once
    (and saved that way for the backward).  On CUDA the work runs on
    ``torch.cuda.current_stream()``.  Gradients are returned only for inputs
    that require them; with ``torch.no_grad()`` (or no input requiring a
    gradient) nothing is kept for a backward.  Double backward
    (``create_graph=True`` through this call) is not supported and raises.
    """
    comm = resolve_comm(comm)
    backend, problem = _backend_problem(backend, q, k, v)
    agree(comm, problem)
    options = AttentionOptions(causal=causal, window=window, softmax_scale=softmax_scale, softcap=softcap,
                               alibi_slopes=_host_ids(alibi_slopes),
                               dropout_p=dropout_p, dropout_seed=dropout_seed, head_parallel=head_parallel,
                               timeout=timeout, check_finite=check_finite)
    call = _Call(options, comm=comm, layout=layout, segment_ids_q=_host_ids(segment_ids_q),
                 segment_ids_kv=_host_ids(segment_ids_kv), backend=backend, stats=stats)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    sinks = None if sinks is None else sinks.contiguous()
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, sinks)):
        o, lse = _RingAttention.apply(q, k, v, sinks, call)
    else:
        o, lse = _forward(q, k, v, call, sinks)
    return (o, lse) if return_lse else o


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                                 is_causal: bool = False, scale: Optional[float] = None, **options):
    """:func:`ring_attention` shaped like ``torch.nn.functional.scaled_dot_product_attention``.

    ``query (B, H, S_q_local, D)``, ``key (B, H_kv, S_kv_local, D)``, ``value (B, H_kv,
    S_kv_local, D_v)`` -> ``(B, H, S_q_local, D_v)``: this rank's shards, head-major.  Equivalent to
    ``ring_attention(query.transpose(1, 2), key.transpose(1, 2),
    value.transpose(1, 2), causal=is_causal, softmax_scale=scale,
    **options).transpose(1, 2)``: one copy of each input (the transpose made
    contiguous), none of the output (a transposed view).  ``options`` are
    :func:`ring_attention`'s keywords (``comm``, ``layout``, ``window``,
    segment ids, ``dropout_p`` with ``dropout_seed``, ...) except ``return_lse``.
    GQA needs no flag.  There is no ``attn_mask``; ``is_causal`` is bottom-right aligned (the same as
    torch's when ``N_q == N_kv``) and uses global positions.
    """
    o = ring_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                       causal=is_causal, softmax_scale=scale, return_lse=False, **options)
    return o.transpose(1, 2)


class RingSelfAttention(torch.nn.Module):
    """Multi-head self-attention (GQA) over a sequence sharded across ranks.

    ``forward(x (B, S_local, E), segment_ids=None) -> (B, S_local, E)`` on this
    rank's tokens.  Projections ``q: E -> H*D``, ``k, v: E -> H_kv*D``,
    ``out: H*D -> E`` with ``D = E // H``.  The parameters are replicated:
    initialise them identically on every rank and sum their gradients over the
    ranks after the backward (``comm.Allreduce``), as
    ``jobs/train_context_parallel.py`` does.  Keywords after ``bias`` go to
    :func:`ring_attention` (``comm``, ``layout``, ``causal``, ``window``, ...).
    """

    def __init__(self, embed_dim: int, num_heads: int, num_kv_heads: Optional[int] = None, *,
                 bias: bool = False, **options):
        super().__init__()
        num_kv_heads = num_kv_heads or num_heads
        if embed_dim % num_heads or num_heads % num_kv_heads:
            raise ValueError(f"need embed_dim % num_heads == 0 and num_heads % num_kv_heads == 0, "
                             f"got {embed_dim}, {num_heads}, {num_kv_heads}")
        self.heads, self.kv_heads, self.head_dim = num_heads, num_kv_heads, embed_dim // num_heads
        self.q_proj = torch.nn.Linear(embed_dim, num_heads * self.head_dim, bias=bias)
        self.kv_proj = torch.nn.Linear(embed_dim, 2 * num_kv_heads * self.head_dim, bias=bias)
        self.out_proj = torch.nn.Linear(num_heads * self.head_dim, embed_dim, bias=bias)
        self.options = options

    def forward(self, x: torch.Tensor, segment_ids=None) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim)
        k, v = self.kv_proj(x).view(b, s, 2, self.kv_heads, self.head_dim).unbind(2)
        o = ring_attention(q, k, v, segment_ids_q=segment_ids, segment_ids_kv=segment_ids, **self.options)
        return self.out_proj(o.reshape(b, s, self.heads * self.head_dim))
