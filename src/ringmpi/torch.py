"""PyTorch interop: ring attention as a differentiable function on torch tensors.

``ring_attention(q, k, v, causal=..., context=...)`` takes this
rank's shards as torch tensors in the flash-attention layout
``(B, S_local, H, D)`` and returns ``Attention(o, lse, None)`` on the same device and dtype; it is
one ``torch.library`` custom op with an autograd formula: the forward runs
:func:`ringmpi.attention.forward`, the backward :func:`ringmpi.attention.backward`
with the saved ``o`` and ``lse``, both with one
:class:`~ringmpi.options.AttentionOptions` rebuilt from the op's typed arguments
(its scalar fields; ``sinks`` and ``alibi_slopes`` are tensor arguments).  Both
are collective over ``comm``: every rank calls the forward and every rank
backpropagates through it.

Zero copy both ways: CPU tensors are handed over as NumPy views (bfloat16 as
``ml_dtypes.bfloat16`` over the same bytes), CUDA tensors through DLPack as
CuPy arrays (bfloat16 as ``ml_dtypes.bfloat16`` CuPy arrays, CuPy >= 14), and the
results come back the same way.  On CUDA the work is queued on torch's
current stream (``torch.cuda.current_stream()``), so results need no extra
synchronisation; ``o``, ``lse`` and the gradients are the backend's own arrays.
Non-contiguous inputs are made contiguous once (and saved that way for the
backward).

The op is ``torch.ops.ringmpi.ring_attention`` (with a fake implementation and
its backward op ``ringmpi::ring_attention_backward``), so ``torch.compile``
keeps the call whole, as one node, without a graph break.  Gradients are
returned only for inputs that require them; with ``torch.no_grad()`` (or no
input requiring a gradient) nothing is kept for a backward.  Double backward
(``create_graph=True`` through the call) is not supported and raises.

Importing this module imports torch; ``import ringmpi`` does not.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, fields, replace
from typing import NamedTuple, Optional, Union

import ml_dtypes
import numpy as np

try:
    import torch
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("ringmpi.torch needs PyTorch: pip install 'ringmpi[torch]'") from exc

from .attention import backward as ring_backward, forward as ring_forward
from .context import Attention, RingContext, call_options, pair
from .core import dtypes as _dtypes
from .core.host import to_host
from .core.layout import BALANCED, Layout
from .core.masks import WINDOW_OFF
from .core.modifiers import FIELDS as MODIFIER_FIELDS
from .options import AttentionOptions, option_edge, option_fields
from .parallel.comm import resolve_comm
from .runtime.errors import ConfigError, agree
from .parallel.topology import head_parallel_setting

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
def on_torch_stream(device: torch.device):
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


# ------------------------------------------------------------ the custom ops' arguments
@dataclass(frozen=True)
class _Where:
    """Where one call's shards live: the custom ops' non-tensor arguments besides the options.

    ``comm`` is a key of :data:`_COMMS` (the communicator's id); ``layout_n`` the
    global length of a ``Layout`` given as one (-1 for a layout name); ``stats`` a
    key of :data:`_STATS` (0: none).
    """

    comm: int
    layout: str
    layout_n: int
    backend: str
    stats: int

    def args(self) -> tuple:
        return tuple(getattr(self, f.name) for f in fields(self))

    def library_kwargs(self, q, k, v, seg_q, seg_kv, pos_q, pos_kv) -> dict:
        """Keywords for :func:`ringmpi.ring_attention` / :func:`ringmpi.ring_attention_backward`
        besides ``options``, with the backend resolved for the tensors ``q, k, v``."""
        comm = _COMMS[self.comm]
        layout = self.layout if self.layout_n < 0 else Layout(self.layout, self.layout_n, comm.Get_size())
        backend, problem = _backend_problem(self.backend, q, k, v)
        if problem:  # eager calls agreed on it in ring_attention already; compiled ones get it here
            raise ConfigError(problem)
        return dict(comm=comm, layout=layout, backend=backend, stats=_STATS.get(self.stats),
                    segment_ids_q=_host_numpy(seg_q), segment_ids_kv=_host_numpy(seg_kv),
                    positions_q=_host_numpy(pos_q), positions_kv=_host_numpy(pos_kv))


_WHERE_SCHEMA = "int comm, str layout, int layout_n, str backend, int stats"
_WHERE_COUNT = len(fields(_Where))
_STATS: dict = {}  # stats lists of calls whose backward may still run, by id (the ops take an int)
_COMMS: dict = {}  # the communicators calls were given, by id (the ops take an int)


@torch.compiler.assume_constant_result
def _comm_key(comm) -> int:
    """The key of ``comm`` in :data:`_COMMS` (registering it); run, not traced, by torch.compile."""
    _COMMS[id(comm)] = comm
    return id(comm)


def _where(comm, layout, backend, stats) -> _Where:
    if stats is not None:
        _STATS[id(stats)] = stats
    return _Where(comm=_comm_key(comm), layout=layout.kind if isinstance(layout, Layout) else str(layout),
                  layout_n=layout.n if isinstance(layout, Layout) else -1, backend=backend,
                  stats=0 if stats is None else id(stats))


# ------------------------------------------------------------ options as the ops' typed arguments
# Built from AttentionOptions' fields (options.py states each field's kind, `op`): a new option
# needs no line here.  Each kind is carried as typed schema entries (names from the field's), a
# packing into those values (ValueError/TypeError when they cannot hold it exactly: the caller then
# asks the options what is wrong) and the unpacking; per-head arrays are one tensor list.
def _window_args(w) -> tuple:
    return (None, None, False) if w is None else (_exact_int(w[0]), _exact_int(w[1]), True)


_KINDS = {  # kind -> (schema types, pack value -> tuple, unpack tuple -> value)
    "bool": (("bool",), lambda x: (bool(x),), lambda a: a[0]),
    "float": (("float",), lambda x: (float(x),), lambda a: a[0]),
    "float?": (("float?",), lambda x: (_float(x),), lambda a: a[0]),
    "uint64?": (("int?",), lambda x: (_signed64(x),), lambda a: None if a[0] is None else a[0] % (1 << 64)),
    "head_parallel": (("str?",), lambda x: (_head_parallel_text(x),), lambda a: a[0]),
    "text?": (("str?",), lambda x: (None if x is None else str(x),), lambda a: a[0]),
    "ints?": (("int[]?",), lambda x: (None if x is None else [_exact_int(i) for i in x],),
              lambda a: None if a[0] is None else tuple(a[0])),
    "window": (("int?", "int?", "bool"), _window_args, lambda a: (a[0], a[1]) if a[2] else None),
}
_SUFFIXES = {"window": ("_left", "_right", "_given")}
_PER_HEAD = tuple(n for n in option_fields("op") if option_edge(n)["op"] == "per_head")  # options.PER_HEAD
_SCALARS = tuple((n, _KINDS[option_edge(n)["op"]]) for n in option_fields("op") if n not in _PER_HEAD)
_OPTION_SCHEMA = ", ".join(
    f"{t} {n}{_SUFFIXES.get(option_edge(n)['op'], ('',) * len(types))[i]}"
    for n, (types, _, _) in _SCALARS for i, t in enumerate(types))
_OPTION_COUNT = sum(len(types) for _, (types, _, _) in _SCALARS)


def _option_args(options: AttentionOptions) -> tuple:
    """``options``' scalar fields as the ops' arguments (ValueError or TypeError for a value those
    types cannot hold exactly)."""
    return tuple(x for n, (_, pack, _) in _SCALARS for x in pack(getattr(options, n)))


def _per_head_args(options: AttentionOptions) -> tuple:
    """``(tensors, present)``: the per-head arrays given and the bits of :data:`_PER_HEAD` they are.
    A score modifier's values are options, read on the host (host tensors); ``sinks`` stays where it
    is (a parameter, with a gradient)."""
    tensors, present = [], 0
    for i, name in enumerate(_PER_HEAD):
        x = getattr(options, name)
        if x is not None:
            tensors.append(_host_tensor(x) if name in MODIFIER_FIELDS else x.contiguous())
            present |= 1 << i
    return tensors, present


def _options_of(args, per_head, present) -> AttentionOptions:
    """The inverse of :func:`_option_args` and :func:`_per_head_args`."""
    values, it = {}, iter(args)
    for n, (types, _, unpack) in _SCALARS:
        values[n] = unpack(tuple(next(it) for _ in types))
    tensors = iter(per_head)
    for i, n in enumerate(_PER_HEAD):
        if present >> i & 1:
            values[n] = to_array(next(tensors))
    return AttentionOptions(**values)


def _op_arguments(options: AttentionOptions, q) -> tuple:
    """``(options' typed arguments, per-head tensors, their bits, None)``, or ``(None, None, 0, this
    rank's problem)`` when they cannot be carried (named by ``options``' own checks)."""
    try:
        return (_option_args(options),) + _per_head_args(options) + (None,)
    except (TypeError, ValueError, OverflowError, AttributeError) as exc:
        heads = q.shape[2] if getattr(q, "ndim", 0) == 4 else 0
        arrays = {n: to_array(x.contiguous()) for n in _PER_HEAD
                  if isinstance(x := getattr(options, n), torch.Tensor)}  # as the library sees them
        return None, None, 0, replace(options, **arrays).problem(heads) or str(exc)


def _exact_int(x) -> Optional[int]:
    if x is None:
        return None
    if int(x) != x:
        raise ValueError(f"{x!r} is not an integer")
    return int(x)


def _float(x) -> Optional[float]:
    return None if x is None else float(x)


def _signed64(x) -> Optional[int]:
    if x is None:
        return None
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or not 0 <= int(x) < 1 << 64:
        raise ValueError(f"{x!r} is not an int in [0, 2^64)")
    x = int(x)
    return x - (1 << 64) if x >= 1 << 63 else x


def _head_parallel_text(x) -> Optional[str]:
    """None and strings as they are (the library reads them); a number as its int's text,
    or the library's ValueError (:func:`ringmpi.parallel.topology.head_parallel_setting`)."""
    return x if x is None or isinstance(x, str) else str(head_parallel_setting(x))


def _host_tensor(x):
    """An optional array or tensor (any device) as a host tensor (segment ids, positions, per-head values)."""
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    return torch.from_numpy(to_host(x))


def _host_numpy(t):
    return None if t is None else t.detach().cpu().numpy()


# ------------------------------------------------------------ the custom ops
class _Args(NamedTuple):
    """The ops' arguments after their leading tensors, in the schema's order (:data:`_ARGUMENTS`)."""

    per_head: list     # the per-head tensors given (sinks first when given)
    present: int       # which of _PER_HEAD they are (bits)
    seg_q: Optional[torch.Tensor]
    seg_kv: Optional[torch.Tensor]
    pos_q: Optional[torch.Tensor]
    pos_kv: Optional[torch.Tensor]
    where: tuple       # _Where's fields
    options: tuple     # _option_args

    @classmethod
    def of(cls, args) -> "_Args":
        head, where, options = args[:6], args[6:6 + _WHERE_COUNT], args[6 + _WHERE_COUNT:]
        return cls(*head, tuple(where), tuple(options))

    def flat(self) -> tuple:
        return tuple(self[:6]) + self.where + self.options

    def sinks(self) -> Optional[torch.Tensor]:
        return self.per_head[0] if self.present & 1 else None

    def library_call(self, q, k, v) -> dict:
        """The library's keywords (``options`` included) for these arguments: those of
        :func:`ringmpi.attention.forward` and :func:`ringmpi.attention.backward`."""
        return dict(options=_options_of(self.options, self.per_head, self.present),
                    **_Where(*self.where).library_kwargs(q, k, v, self.seg_q, self.seg_kv, self.pos_q, self.pos_kv))


assert _PER_HEAD[0] == "sinks"  # _Args.sinks: the one per-head tensor with a gradient


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


_ARGUMENTS = ("Tensor[] per_head, int per_head_present, Tensor? seg_q, Tensor? seg_kv, Tensor? pos_q, "
              "Tensor? pos_kv, " + _WHERE_SCHEMA + ", " + _OPTION_SCHEMA)
torch.library.define("ringmpi::ring_attention", "(Tensor q, Tensor k, Tensor v, " + _ARGUMENTS + ") -> (Tensor, Tensor)")
torch.library.define("ringmpi::ring_attention_backward",
                     "(Tensor do, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, " + _ARGUMENTS
                     + ") -> (Tensor, Tensor, Tensor, Tensor)")


@torch.library.impl("ringmpi::ring_attention", "CompositeExplicitAutograd")
def _forward_op(q, k, v, *args):
    with on_torch_stream(q.device):
        o, lse, _ = ring_forward(to_array(q), to_array(k), to_array(v), **_Args.of(args).library_call(q, k, v))
        return to_tensor(o, q.device), to_tensor(lse, q.device)


@torch.library.register_fake("ringmpi::ring_attention")
def _forward_fake(q, k, v, *args):
    b, s, h, _ = q.shape
    return q.new_empty((b, s, h, v.shape[3])), q.new_empty((b, h, s), dtype=_lse_dtype(q.dtype))


@torch.library.impl("ringmpi::ring_attention_backward", "CompositeExplicitAutograd")
def _backward_op(do, q, k, v, o, lse, *args):
    """dq, dk, dv and dsinks (this rank's share; ``(0,)`` without sinks)."""
    a = _Args.of(args)
    with on_torch_stream(q.device):
        grads = ring_backward(*(to_array(x) for x in (do, q, k, v, o, lse)), **a.library_call(q, k, v),
                              reduce_dsinks=False)
        dq, dk, dv = (to_tensor(g, q.device) for g in grads[:3])
        sinks = a.sinks()
        dsinks = q.new_empty((0,)) if sinks is None else to_tensor(np.ascontiguousarray(grads.dsinks), sinks.device)
        return dq, dk, dv, dsinks


@torch.library.register_fake("ringmpi::ring_attention_backward")
def _backward_fake(do, q, k, v, o, lse, *args):
    sinks = _Args.of(args).sinks()
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            q.new_empty((0,)) if sinks is None else torch.empty_like(sinks))


def _setup_context(ctx, inputs, output):
    q, k, v, *args = inputs
    a = _Args.of(args)
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, a.seg_q, a.seg_kv, a.pos_q, a.pos_kv, *a.per_head)
    ctx.rest = (a.present, a.where, a.options)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, do, _dlse):
    q, k, v, o, lse, seg_q, seg_kv, pos_q, pos_kv, *per_head = ctx.saved_tensors
    present, where, options = ctx.rest
    a = _Args(per_head, present, seg_q, seg_kv, pos_q, pos_kv, where, options)
    with torch.no_grad():
        dq, dk, dv, dsinks = torch.ops.ringmpi.ring_attention_backward(do.contiguous(), q, k, v, o, lse, *a.flat())
    _STATS.pop(_Where(*where).stats, None)
    wanted = ctx.needs_input_grad
    grads = [g if want else None for g, want in zip((dq, dk, dv), wanted[:3])]
    head_grads = [None] * len(per_head)
    if a.sinks() is not None and wanted[3][0]:
        head_grads[0] = dsinks
    if torch.is_grad_enabled():  # create_graph=True: these gradients must not be differentiated
        given = [g for g in grads + head_grads if g is not None]
        refused = iter(_NotDifferentiable.apply(*(g.detach().requires_grad_(True) for g in given)))
        grads = [None if g is None else next(refused) for g in grads]
        head_grads = [None if g is None else next(refused) for g in head_grads]
    return tuple(grads) + (head_grads,) + (None,) * (len(wanted) - 4)


torch.library.register_autograd("ringmpi::ring_attention", _backward, setup_context=_setup_context)


class _NotDifferentiable(torch.autograd.Function):
    """Identity whose backward raises: the gradients of the ring attention op
    under ``create_graph=True``, so that a double backward fails loudly instead
    of treating them as constants."""

    @staticmethod
    def forward(ctx, *grads):
        return tuple(g.view_as(g) for g in grads)

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError("ringmpi.torch.ring_attention cannot be differentiated twice: its backward "
                           "(ringmpi.ring_attention_backward) has no derivative of its own")


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                   window=WINDOW_OFF, softmax_scale: Optional[float] = None, softcap: float = 0.0,
                   alibi_slopes=None, sinks: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                   dropout_seed: Optional[int] = None, segment_ids=None, positions=None,
                   context: Optional[RingContext] = None) -> Attention:
    """Exact softmax attention over a sequence sharded across ranks, differentiable.

    Collective over ``context.comm``, in the forward and in the backward: every rank
    calls it with its own shard, and every rank backpropagates through it.

    Parameters
    ----------
    q : (B, S_q_local, H, D) tensor, float16/bfloat16/float32/float64, CPU or CUDA
        This rank's queries: the global tokens ``Layout(context.layout, N_q, P).indices(rank)``.
    k, v : (B, S_kv_local, H_kv, D), (B, S_kv_local, H_kv, D_v) tensors, same dtype and
        device; ``H % H_kv == 0``; ``D_v`` may differ from ``D`` (as in torch's SDPA).
    causal, window, softmax_scale, softcap, alibi_slopes, dropout_p, dropout_seed, segment_ids, positions
        As in :func:`ringmpi.ring_attention` (segment ids, positions and ALiBi slopes as integer or
        float tensors or arrays; no gradient flows to them); the backward regenerates the dropout
        mask from the seed.
    sinks : (H,) float16/bfloat16/float32/float64 tensor, optional, the same on every rank
        As in :func:`ringmpi.ring_attention`.  A replicated parameter: when it
        requires a gradient, ``sinks.grad`` receives this rank's own contribution (from its
        own queries), in the sinks' dtype, like every other parameter's gradient, so summing
        gradients over the ranks (``comm.Allreduce``, DDP, FSDP) gives the total (the context's
        ``reduce_dsinks`` is not used here).
    context : :class:`ringmpi.RingContext`, optional
        As in :func:`ringmpi.ring_attention`.  ``backend="auto"`` follows the tensors' device
        (NumPy for CPU tensors, CuPy for CUDA); a name that does not fit the device is an error.
        ``stats`` receives the forward's ring step records, and the backward's when it runs.  A
        ``"balanced"`` :class:`~ringmpi.Layout` reaches the op as the positions it gives this
        rank, with its default schedule (``"auto"``).  With ``invariant`` the forward and the
        gradients of ``q, k, v`` are the same bits for any P, layout and ``head_parallel``.

    Returns
    -------
    :class:`ringmpi.Attention` ``(o, lse, None)``: ``o (B, S_q_local, H, D_v)`` tensor, the input
    dtype and device; ``lse (B, H, S_q_local)`` float32 tensor (float64 for float64 inputs), not
    differentiable: no gradient flows back through it.

    The custom op, its copies (none), stream and gradients: the module docstring.
    """
    ctx = RingContext.of(context)
    options = call_options(ctx, causal=causal, window=window, softmax_scale=softmax_scale, softcap=softcap,
                           alibi_slopes=alibi_slopes, sinks=sinks, dropout_p=dropout_p, dropout_seed=dropout_seed)
    segment_ids_q, segment_ids_kv = pair(segment_ids, "segment_ids")
    positions_q, positions_kv = pair(positions, "positions")
    comm, layout, backend, stats = resolve_comm(ctx.comm), ctx.layout, ctx.backend, ctx.stats
    if isinstance(layout, Layout) and layout.kind == BALANCED and positions_q is not None:
        layout = "contiguous"  # given positions place the tokens: the layout is not used (nor carried)
    if isinstance(layout, Layout) and layout.kind == BALANCED and positions_q is None:
        # the op's arguments name a layout by kind and length: a balanced one travels as its positions,
        # with the schedule it defaults to
        positions_q = positions_kv = torch.from_numpy(layout.indices(comm.Get_rank()))
        options = replace(options, schedule=options.kv_schedule(balanced=True))
        layout = "contiguous"
    args, per_head, present, problem = _op_arguments(options, q)
    problem = problem or _declared_dtype_problem(options.dtype, q, k, v)
    if not torch.compiler.is_compiling():  # MPI cannot be traced: compiled code checks inside the op
        agree(comm, _backend_problem(backend, q, k, v)[1] or problem)
    elif problem:
        raise ConfigError(problem)
    where = _where(comm, layout, backend, stats)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    op_args = _Args(per_head, present, _host_tensor(segment_ids_q), _host_tensor(segment_ids_kv),
                    _host_tensor(positions_q), _host_tensor(positions_kv), where.args(), args)
    o, lse = torch.ops.ringmpi.ring_attention(q, k, v, *op_args.flat())
    if stats is not None and not o.requires_grad:  # no backward will append to stats
        _STATS.pop(where.stats, None)
    return Attention(o, lse)


def _declared_dtype_problem(declared, *tensors) -> Optional[str]:
    """The problem with the context's ``dtype`` for these tensors (a tensor carries its dtype, so
    the declared one must be it), or None."""
    if declared is None:
        return None
    name = _dtypes.declared_name(declared)
    if name is None:
        return f"dtype={declared!r} is not one of {', '.join(_dtypes.NAMES)}"
    for label, t in zip("qkv", tensors):
        if str(t.dtype).removeprefix("torch.") != name:
            return f"{label} has dtype {t.dtype} but the context's dtype={declared!r}"
    return None


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: Optional[float] = None, enable_gqa: bool = False,
                                 *, context: Optional[RingContext] = None) -> torch.Tensor:
    """``torch.nn.functional.scaled_dot_product_attention``'s signature over :func:`ring_attention`.

    ``query (B, H, S_q_local, D)``, ``key (B, H_kv, S_kv_local, D)``, ``value (B, H_kv,
    S_kv_local, D_v)`` -> ``(B, H, S_q_local, D_v)``: this rank's shards, head-major, spread by
    ``context`` (:class:`ringmpi.RingContext`).  One copy of each input (the transpose made
    contiguous), none of the output (a transposed view).  ``attn_mask`` must be None (masks are
    ``ring_attention``'s keywords: ``window``, ``segment_ids``, ...); ``is_causal`` is bottom-right
    aligned (the same as torch's when ``N_q == N_kv``) and uses global positions; GQA needs no
    flag (``enable_gqa`` is accepted and not needed).  ``dropout_p > 0`` draws the mask's seed
    from torch's default generator (one ``torch.randint``), so ranks whose generators are seeded
    alike draw the same mask (ranks that disagree get a ConfigError).
    """
    if attn_mask is not None:
        raise ValueError("ringmpi.torch.scaled_dot_product_attention takes no attn_mask: pass the mask as "
                         "ringmpi.torch.ring_attention's keywords (causal, window, segment_ids, positions)")
    seed = int(torch.randint(0, 1 << 62, (1,)).item()) if dropout_p > 0 else None
    o, _, _ = ring_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), causal=is_causal,
                             softmax_scale=scale, dropout_p=dropout_p, dropout_seed=seed, context=context)
    return o.transpose(1, 2)


class RingSelfAttention(torch.nn.Module):
    """Multi-head self-attention (GQA) over a sequence sharded across ranks.

    ``forward(x (B, S_local, E), segment_ids=None) -> (B, S_local, E)`` on this
    rank's tokens.  Projections ``q: E -> H*D``, ``k, v: E -> H_kv*D``,
    ``out: H*D -> E`` with ``D = E // H``.  The parameters are replicated:
    initialise them identically on every rank and sum their gradients over the
    ranks after the backward (``comm.Allreduce``), as
    ``jobs/train_context_parallel.py`` does.  ``sinks=True`` adds a learned
    attention sink per head (``self.sinks (H,)``, zeros at first), a replicated
    parameter like the others.  ``causal``, ``window`` and ``softcap`` are
    :func:`ring_attention`'s; ``context`` (:class:`ringmpi.RingContext`) says where it runs.
    """

    def __init__(self, embed_dim: int, num_heads: int, num_kv_heads: Optional[int] = None, *,
                 bias: bool = False, sinks: bool = False, causal: bool = False, window=WINDOW_OFF,
                 softcap: float = 0.0, context: Optional[RingContext] = None):
        super().__init__()
        num_kv_heads = num_kv_heads or num_heads
        if embed_dim % num_heads or num_heads % num_kv_heads:
            raise ValueError(f"need embed_dim % num_heads == 0 and num_heads % num_kv_heads == 0, "
                             f"got {embed_dim}, {num_heads}, {num_kv_heads}")
        self.heads, self.kv_heads, self.head_dim = num_heads, num_kv_heads, embed_dim // num_heads
        self.q_proj = torch.nn.Linear(embed_dim, num_heads * self.head_dim, bias=bias)
        self.kv_proj = torch.nn.Linear(embed_dim, 2 * num_kv_heads * self.head_dim, bias=bias)
        self.out_proj = torch.nn.Linear(num_heads * self.head_dim, embed_dim, bias=bias)
        self.sinks = torch.nn.Parameter(torch.zeros(num_heads)) if sinks else None
        self.causal, self.window, self.softcap, self.context = causal, window, softcap, context

    def forward(self, x: torch.Tensor, segment_ids=None) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim)
        k, v = self.kv_proj(x).view(b, s, 2, self.kv_heads, self.head_dim).unbind(2)
        o, _, _ = ring_attention(q, k, v, causal=self.causal, window=self.window, softcap=self.softcap,
                                 segment_ids=segment_ids, sinks=self.sinks, context=self.context)
        return self.out_proj(o.reshape(b, s, self.heads * self.head_dim))
