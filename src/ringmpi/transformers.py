"""Hugging Face transformers integration: ring attention as ``attn_implementation="ringmpi"``.

::

    import ringmpi.transformers as rmt
    rmt.register()
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="ringmpi")
    ring = ringmpi.RingContext(comm, layout="zigzag")
    shard = rmt.shard_batch({"input_ids": ids, "attention_mask": mask, "labels": labels},
                            context=ring)                 # (B, N) tensors -> this rank's (B, S_local)
    out = model(**shard)                                  # out.loss summed over ranks: the global mean
    logits = rmt.gather(out.logits, context=ring)         # (B, N, vocab), every rank

With ``RingContext(layout="balanced")`` a batch of packed rows is flattened into one row of
``B * N`` tokens (each row's documents, and the rows themselves, kept apart by
segment ids) placed so that every rank sees the same number of (query, key)
pairs, and K/V move by the routed schedule; ``gather(..., context=
shard["ringmpi_context"].ring)`` then gives ``(1, B * N, ...)``.

Every rank holds the same model and the same global batch; :func:`shard_batch`
keeps this rank's tokens and adds what the attention needs (a
:class:`ShardContext`: communicator, layout, global positions, segment ids,
dropout seed) under the key ``ringmpi_context``, which HF passes through the
model to every attention call.  The gradients of the replicated parameters are
this rank's own contributions (sinks included): sum them over the ranks (an
Allreduce, DDP, FSDP) as for any data-parallel step.

A sharded forward either computes what one process computes or is refused, on
every rank and before the model's first module runs, by name: :func:`register`
also installs the check of :mod:`ringmpi.transformers_models` on every model call
that carries a ``ringmpi_context`` (sequence mixers ringmpi does not shard, such
as Mamba, gated delta rules or short convolutions; attention that bypasses
transformers' attention interface, such as Bloom's ALiBi; models without
attention), and adapts what depends on the whole sequence: rotary embeddings whose
frequencies depend on its length (dynamic NTK, LongRoPE) and MoE router
load-balancing losses, computed from every rank's tokens.

Importing this module imports torch and transformers; ``import ringmpi`` does not.
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass, field
from typing import Optional, Union

import numpy as np

try:
    import torch
    import transformers
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("ringmpi.transformers needs PyTorch and Hugging Face transformers: "
                      "pip install 'ringmpi[transformers]'") from exc

from . import torch as _rt
from . import transformers_models as _models
from .runtime.errors import ConfigError, agree
from .context import RingContext
from .core.layout import BALANCED, Layout
from .core.masks import WINDOW_OFF
from .parallel.comm import resolve_comm
from .runtime.watchdog import phase

__all__ = ["NAME", "CONTEXT_KEY", "IGNORE_INDEX", "ShardContext", "register", "attention_forward",
           "shard_batch", "gather", "dropout_seed"]

NAME = _models.NAME
CONTEXT_KEY = _models.CONTEXT_KEY
IGNORE_INDEX = -100        # HF's label that predicts nothing
PAD_SEGMENT = -1           # the segment id of padding tokens: no real token sees them

_steps = itertools.count()  # shard_batch calls in this process: the same count on every rank


@dataclass
class ShardContext:
    """What every attention call of one sharded forward needs, made by :func:`shard_batch`.

    ``positions (S_local,)`` int64: this rank's global token positions
    (``layout.indices(rank)``); ``segment_ids (B, S_local)`` int64 or None:
    documents (from restarting ``position_ids``) and padding (``PAD_SEGMENT``);
    ``dropout_seed``: the user's seed; ``step``: which batch this is (dropout
    masks differ per step and per layer, :func:`dropout_seed`); ``ring``: the
    :class:`ringmpi.RingContext` every attention call runs in (the caller's, with the schedule
    ``"auto"`` for the balanced layout unless it names one).
    """

    comm: object
    layout: Layout
    positions: np.ndarray
    segment_ids: Optional[torch.Tensor]
    ring: RingContext
    dropout_seed: Optional[int] = None
    step: int = 0
    batch_shape: tuple = (1, 0)
    position_max: Optional[int] = None
    _checked: set = field(default_factory=set, repr=False)
    _bounds: Optional[np.ndarray] = field(default=None, repr=False)

    def document_bounds(self) -> Optional[np.ndarray]:
        """Collective: the global token positions ``[0, ..., N]`` where the one row's runs of equal
        segment ids (its documents, and runs of padding) start and end, what the recurrent layers
        take as ``cu_seqlens``; None without segment ids.  Every rank's ids gathered once per
        forward (the first such layer)."""
        if self.segment_ids is None:
            return None
        if self._bounds is None:
            with phase("transformers: every rank's segment ids for the recurrent layers (allgather)"):
                parts = self.comm.allgather(self.segment_ids.cpu())
            self._bounds = _run_bounds(self.layout.unshard(parts, axis=1))
        return self._bounds

    def global_padding_mask(self) -> Optional[torch.Tensor]:
        """Collective: ``(B, N)`` 1 = token, 0 = padding, every rank's tokens rank after rank
        (the order :mod:`~ringmpi.transformers_models` gathers router logits in), or None
        without padding."""
        if self.segment_ids is None:
            return None
        with phase("transformers: every rank's padding (allgather)"):
            parts = self.comm.allgather(self.segment_ids.cpu())
        return (torch.cat(parts, dim=1) != PAD_SEGMENT).to(torch.int64)

    def check_positions(self, position_ids: Optional[torch.Tensor]) -> None:
        """Collective: the ``position_ids (1 or B, S_local)`` the model uses (RoPE) must be the
        layout's global positions up to one offset per document (packed documents restart
        them); padding is not checked.  One ConfigError on every rank otherwise.  Checked
        once per ``position_ids`` tensor (the first layer of a forward)."""
        if position_ids is None or id(position_ids) in self._checked:
            return
        problem, offsets = _position_offsets(position_ids, self.positions, self.segment_ids)
        top = int(position_ids.max()) if position_ids.numel() else None
        with phase("transformers: the ranks' position_ids check (allgather)"):
            every = self.comm.allgather((problem, offsets, top))
        problem = next((f"rank {r}: {p}" for r, (p, _, _) in enumerate(every) if p), None)
        tops = [t for _, _, t in every if t is not None]
        self.position_max = max(tops) if tops else None
        if problem is None:
            seen: dict = {}
            for r, (_, offs, _) in enumerate(every):
                for key, off in offs.items():
                    if seen.setdefault(key, (off, r))[0] != off:
                        problem = (f"document {key[1]} of batch entry {key[0]} has position_ids - global position "
                                   f"{seen[key][0]} on rank {seen[key][1]} but {off} on rank {r}")
                        break
        agree(self.comm, None if problem is None else
              f"position_ids do not match the {self.layout.kind} layout the attention uses ({problem}): "
              "pass the position_ids of ringmpi.transformers.shard_batch with the same layout")
        self._checked.add(id(position_ids))


def _position_offsets(position_ids, positions, segment_ids):
    """(problem or None, {(b, segment): position_ids - global position}) on this rank."""
    pos = position_ids.detach().cpu().numpy().astype(np.int64)
    if pos.ndim != 2 or pos.shape[1] != len(positions):
        return f"position_ids must be (1 or B, {len(positions)}), got {tuple(pos.shape)}", {}
    seg = None if segment_ids is None else segment_ids.cpu().numpy()
    if seg is not None and pos.shape[0] == 1:
        pos = np.broadcast_to(pos, seg.shape)
    offset = pos - positions[None, :]
    if seg is None:
        seg = np.zeros(offset.shape, dtype=np.int64)
    out = {}
    for b in range(offset.shape[0]):
        real = seg[b] != PAD_SEGMENT
        for s in np.unique(seg[b][real]):
            values = np.unique(offset[b][seg[b] == s])
            if len(values) > 1:
                return (f"batch entry {b}, document {int(s)}: position_ids - global position takes "
                        f"{len(values)} values ({values[:3].tolist()} ...)"), {}
            out[b, int(s)] = int(values[0])
    return None, out


def dropout_seed(seed: int, step: int, layer: int) -> int:
    """A 64-bit dropout seed for ``(user seed, step, layer)``: the same on every rank,
    different for every step and layer (BLAKE2b of the three)."""
    digest = hashlib.blake2b(f"ringmpi-dropout {int(seed)} {int(step)} {int(layer)}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little")


def _window(sliding_window, causal: bool):
    """HF's sliding window as ringmpi's ``(left, right)`` (-1 unbounded): causal ``i - w < j <= i``,
    bidirectional ``|i - j| <= w``."""
    if sliding_window is None:
        return WINDOW_OFF
    w = int(sliding_window)
    return (w - 1, 0) if causal else (w, w)


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                      scaling: Optional[float] = None, is_causal: Optional[bool] = None,
                      sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                      s_aux: Optional[torch.Tensor] = None, position_ids: Optional[torch.Tensor] = None,
                      ringmpi_context: Optional[ShardContext] = None, alibi_slopes: Optional[torch.Tensor] = None,
                      **kwargs):
    """HF's attention function signature over ring attention; collective over the context's comm.

    ``query (B, H, S_local, D)``, ``key (B, H_kv, S_local, D)``, ``value (B, H_kv, S_local, D_v)``
    (head-major, GQA heads unrepeated, this rank's tokens) -> ``(attn_output (B, S_local, H, D_v),
    None)``.  Honours ``scaling``, ``is_causal`` (default ``module.is_causal``), ``sliding_window``
    (HF's: key ``j`` visible from query ``i`` iff ``i - window < j <= i``), ``softcap``, ``s_aux``
    (sinks, a replicated parameter: its gradient is this rank's share), ``alibi_slopes (H,)`` (ringmpi's
    ALiBi in global positions: what :mod:`~ringmpi.transformers_models` hands Bloom's) and ``dropout`` (seeded by
    :func:`dropout_seed` of the context's seed, step and ``module.layer_idx``).  HF's ``position_ids``
    restart per document and differ per batch entry, so they are not ringmpi's positions (one
    permutation of ``0 .. N-1`` per call): they are checked once per forward against the
    context's global positions (:meth:`ShardContext.check_positions`), which the attention then
    passes as ``positions_q = positions_kv``, so masks, ALiBi and dropout use exactly the checked ones.  Refuses a mask
    (HF builds none for "ringmpi": padding arrives as segment ids) and a KV cache.
    """
    ctx = ringmpi_context if ringmpi_context is not None else _models.ACTIVE.get()  # a model that drops kwargs
    if ctx is None:
        raise ConfigError("attn_implementation='ringmpi' needs the sharded batch: call "
                          "model(**ringmpi.transformers.shard_batch(batch, context=ringmpi.RingContext(...)))")
    problem = None
    if attention_mask is not None:  # HF builds none for "ringmpi": the architecture made this one itself
        problem = (f"{type(module).__name__} hands the attention a mask or bias tensor of its own making, which "
                   "ringmpi cannot apply to sharded attention, so this architecture cannot run sharded; run it on "
                   "one process (a padding mask goes to shard_batch, which turns it into segment ids)")
    elif query.shape[2] != key.shape[2]:
        problem = ("ringmpi attention runs on the sharded sequence, not from a KV cache "
                   "(shard_batch sets use_cache=False): decode with ringmpi.decode_attention")
    elif dropout and ctx.dropout_seed is None:
        problem = f"attention dropout {dropout} needs shard_batch(..., dropout_seed=SEED)"
    elif dropout and getattr(module, "layer_idx", None) is None:
        problem = "attention dropout needs module.layer_idx (a per-layer seed)"
    agree(ctx.comm, problem)
    ctx.check_positions(position_ids)
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    drop = {}
    if dropout:
        drop = dict(dropout_p=float(dropout), dropout_seed=dropout_seed(ctx.dropout_seed, ctx.step, module.layer_idx))
    seg = ctx.segment_ids
    positions = torch.from_numpy(ctx.positions)  # the ones position_ids were checked against
    o, _, _ = _rt.ring_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                 positions=positions, causal=causal, window=_window(sliding_window, causal),
                                 segment_ids=seg, softmax_scale=scaling, sinks=s_aux,
                                 softcap=0.0 if softcap is None else softcap, alibi_slopes=alibi_slopes, **drop,
                                 context=ctx.ring)
    return o, None


def register(name: str = NAME) -> None:
    """Register :func:`attention_forward` as ``attn_implementation=name`` for every model
    that dispatches through ``transformers.AttentionInterface``.  No mask function is
    registered: HF then builds no ``(N, N)`` mask, and masks come from the layout and
    segment ids instead."""
    transformers.AttentionInterface.register(name, attention_forward)
    _install_model_check()


def _install_model_check() -> None:
    """Wrap ``transformers.PreTrainedModel.__call__`` once: a call with ``ringmpi_context`` is
    checked before any compute and runs with the context active
    (:func:`ringmpi.transformers_models.sharded_call`); any other call is untouched."""
    base = transformers.PreTrainedModel
    if getattr(base.__call__, "_ringmpi_checked", False):
        return
    call = base.__call__

    def checked_call(self, *args, **kwargs):
        return _models.sharded_call(call, self, args, kwargs)
    checked_call._ringmpi_checked = True
    base.__call__ = checked_call


def _segments(position_ids: Optional[torch.Tensor], attention_mask: Optional[torch.Tensor], shape):
    """``(B, N)`` int64 segment ids, or None when every token sees every earlier one: a new
    document where ``position_ids`` does not step by 1 (HF's packed-sequence rule), padding
    (``attention_mask == 0``) in ``PAD_SEGMENT``."""
    seg = None
    if position_ids is not None:
        pos = position_ids.expand(shape)
        first = pos[:, :1] - 1
        seg = (torch.diff(pos, prepend=first, dim=-1) != 1).cumsum(-1)
        if not bool(seg.any()):
            seg = None
    if attention_mask is not None:
        real = attention_mask.to(torch.bool)
        if not bool(real.all()):
            seg = torch.where(real, torch.zeros(shape, dtype=torch.int64) if seg is None else seg, PAD_SEGMENT)
    return None if seg is None else seg.to(torch.int64)


def shard_batch(batch: dict, *, context: Optional[RingContext] = None, dropout_seed: Optional[int] = None,
                step: Optional[int] = None, causal: bool = True, window=WINDOW_OFF) -> dict:
    """This rank's part of a global batch, ready for ``model(**shard)``; call it on every rank.

    Parameters
    ----------
    batch : dict
        The same global batch on every rank: ``input_ids (B, N)`` (or ``inputs_embeds
        (B, N, E)``), optional ``attention_mask (B, N)`` (1 = token, 0 = padding),
        ``position_ids (1 or B, N)`` (packed documents restart them; default
        ``arange(N)``), ``labels (B, N)`` (HF's: the model shifts them), and any other
        ``(B, N, ...)`` tensor.  Other entries pass through unchanged.
    context : :class:`ringmpi.RingContext`, optional
        Where every attention call of the forward runs (None: ``RingContext(layout="zigzag")``).
        Its ``layout`` ("contiguous", "zigzag", "striped" or "balanced") cuts the batch;
        ``"balanced"``: the batch is flattened into one row of ``B * N`` tokens (a
        document never crosses a row), whose documents (restarting ``position_ids``;
        padding counts as one) are placed with balanced attention work
        (:class:`~ringmpi.core.layout.Layout` ``"balanced"``, ``causal`` and ``window`` the
        model's mask as ``ring_attention`` takes it); every ``(B, N, ...)`` tensor is cut
        from the flattened ``(1, B * N, ...)``, and the schedule defaults to ``"auto"``.
        With ``invariant``, every attention call of the forward (and its backward) gives the
        same bits for any number of ranks and layout (each shard must be whole 64-token
        tiles: ``N / P``, or ``N / (2P)`` for zigzag, a multiple of 64).
    causal, window : the model's mask as :func:`ringmpi.ring_attention` takes it, for the
        balanced layout's placement.
    dropout_seed : int, optional
        Needed for attention dropout: masks are drawn from it, this ``step`` and the layer.
    step : int, optional
        Default: how many times this process called ``shard_batch`` before.

    Returns
    -------
    dict with every ``(B, N, ...)`` tensor cut to this rank's ``(B, S_local, ...)``
    tokens, global ``position_ids``, and, with ``labels``: ``labels`` and
    ``shift_labels`` both the *globally* shifted labels (the last token of one shard
    predicts the first of the next; a padding token predicts nothing) and
    ``num_items_in_batch`` (the global count of predicted tokens), so ``out.loss``
    summed over ranks is the global mean loss.  ``attention_mask`` is consumed (into
    segment ids); ``use_cache=False``; ``ringmpi_context``: a :class:`ShardContext`.
    """
    ring = RingContext(layout="zigzag") if context is None else RingContext.of(context)
    comm, layout, schedule = resolve_comm(ring.comm), ring.layout, ring.schedule
    rank, size = comm.Get_rank(), comm.Get_size()
    batch = dict(batch)
    lead = batch.get("input_ids", batch.get("inputs_embeds"))
    if lead is None or lead.ndim < 2:
        raise ConfigError("shard_batch needs input_ids (B, N) or inputs_embeds (B, N, E)")
    shape = tuple(lead.shape[:2])
    n = shape[1]
    kind = layout.kind if isinstance(layout, Layout) else layout
    mask = batch.pop("attention_mask", None)
    given = batch.get("position_ids")
    seg = _segments(given, mask, shape)
    if given is None:
        batch["position_ids"] = torch.arange(n, device=lead.device)[None]
    labels = batch.pop("labels", None)
    if labels is not None:
        shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        if mask is not None:
            shifted = shifted.masked_fill(~mask.to(torch.bool), IGNORE_INDEX)
        batch["labels"] = batch["shift_labels"] = shifted
        batch["num_items_in_batch"] = (shifted != IGNORE_INDEX).sum()
    if kind == BALANCED:
        batch, seg, n = _flattened(batch, seg, shape)
        lay = Layout(BALANCED, n, size, documents=_documents(seg, n), causal=causal, window=window)
        schedule = "auto" if schedule is None else schedule
    else:
        lay = Layout(kind, n, size)
    shard = {key: (lay.shard(x, rank) if isinstance(x, torch.Tensor) and x.ndim >= 2 and x.shape[1] == n
                   and key != "num_items_in_batch" else x) for key, x in batch.items()}
    if labels is not None:
        shard["labels"] = shard["shift_labels"]
    shard["use_cache"] = False
    shard[CONTEXT_KEY] = ShardContext(comm=comm, layout=lay, positions=lay.indices(rank),
                                      segment_ids=None if seg is None else lay.shard(seg, rank),
                                      ring=ring.replace(comm=comm, layout=lay, schedule=schedule),
                                      dropout_seed=dropout_seed, step=next(_steps) if step is None else int(step),
                                      batch_shape=(shard["input_ids" if "input_ids" in shard else "inputs_embeds"]
                                                   .shape[0], len(lay.indices(rank))))
    return shard


def _flattened(batch: dict, seg, shape):
    """``(batch, segment ids, B * N)``: every ``(B or 1, N, ...)`` tensor of ``batch`` as one row
    ``(1, B * N, ...)``, and segment ids that keep the rows apart (padding stays ``PAD_SEGMENT``)."""
    b, n = shape
    if b > 1:
        ids = torch.zeros(shape, dtype=torch.int64) if seg is None else seg
        row = torch.arange(b, dtype=torch.int64)[:, None] * (n + 1)
        seg = torch.where(ids == PAD_SEGMENT, ids, ids + row)
    flat = {}
    for key, x in batch.items():
        if isinstance(x, torch.Tensor) and x.ndim >= 2 and x.shape[1] == n and x.shape[0] in (1, b) \
                and key != "num_items_in_batch":
            x = x.expand(b, *x.shape[1:]).reshape(1, b * n, *x.shape[2:])
        flat[key] = x
    return flat, None if seg is None else seg.reshape(1, b * n), b * n


def _run_bounds(seg) -> np.ndarray:
    """``[0, ..., n]``: where the runs of equal segment ids of one row ``(1, n)`` start and end."""
    ids = seg[0].cpu().numpy()
    cut = np.flatnonzero(np.diff(ids) != 0) + 1
    return np.concatenate([[0], cut, [ids.shape[0]]]).astype(np.int64)


def _documents(seg, n: int):
    """Lengths of the runs of equal segment ids of one row ``(1, n)`` (one document without ids)."""
    return [n] if seg is None else np.diff(_run_bounds(seg)).tolist()


def gather(x: torch.Tensor, *, context: Optional[RingContext] = None, axis: int = 1) -> torch.Tensor:
    """Every rank's ``(B, S_local, ...)`` shard of ``x`` in global token order ``(B, N, ...)``,
    on every rank, on ``x``'s device; collective over ``context.comm``.  Not differentiable.
    ``context``: the one given to :func:`shard_batch` (None: its default, zigzag); for the
    balanced layout pass ``shard["ringmpi_context"].ring`` (whose layout is the Layout object):
    the result is the flattened ``(1, B * N, ...)``."""
    ring = RingContext(layout="zigzag") if context is None else RingContext.of(context)
    comm, layout = resolve_comm(ring.comm), ring.layout
    with phase("transformers.gather: every rank's shard (allgather)"):
        parts = comm.allgather(x.detach().cpu())
    if isinstance(layout, Layout) and layout.kind == BALANCED:  # its documents: the object itself
        return layout.unshard(parts, axis=axis).to(x.device)
    kind = layout.kind if isinstance(layout, Layout) else layout
    lay = Layout(kind, sum(p.shape[axis] for p in parts), comm.Get_size())
    return lay.unshard(parts, axis=axis).to(x.device)
