"""One attention call's options: the rules they obey, what ranks agree on, the mask they imply.

Every entry point (:func:`ringmpi.ring_attention`, :func:`ringmpi.ring_attention_backward`,
:func:`ringmpi.decode_attention`, :mod:`ringmpi.torch`, the file job, ``ringmpi
bench``) builds one :class:`AttentionOptions` (the public calls from their maths keywords
and their :class:`~ringmpi.context.RingContext`, :func:`ringmpi.context.call_options`); inside,
that object travels and nothing else checks what it checks:

* :meth:`AttentionOptions.problem` -- this rank's problem with its options (a
  message, or None), for the caller to agree on across ranks (``errors.agree``);
* :meth:`AttentionOptions.digest` -- a CRC of everything the ranks must pass
  alike (the call's own arrays may be added), compared with one collective;
* :meth:`AttentionOptions.score_spec` -- the :class:`~ringmpi.core.masks.ScoreSpec` the
  options imply for a call with global lengths ``N_q``, ``N_kv``.

The file job writes them as HDF5 attributes (:mod:`ringmpi.filejob.attributes`).

Per-device data (``sinks`` as this backend's array) stays as the caller gave it;
the object never copies it.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field, fields, replace
from typing import Optional, Tuple, Union

import numpy as np

from .core import dtypes as _dtypes
from .core.dropout import MAX_POSITION, Dropout
from .core.dropout import validate as _dropout_validate
from .core import modifiers as _modifiers
from .core.host import to_host
from .core.masks import ScoreSpec, Window, window_problem, window_sides

PER_HEAD = ("sinks",) + _modifiers.FIELDS  # the (H,) array fields, one value per query head


def softcap_problem(softcap) -> Optional[str]:
    """The problem with ``softcap`` (None when fine): a finite number > 0, or None."""
    if softcap is None:
        return None
    try:
        value = float(softcap)
    except (TypeError, ValueError):
        return f"softcap must be a number >= 0 (0.0: off), got {softcap!r}"
    if not (math.isfinite(value) and value > 0):
        return f"softcap must be finite and >= 0 (0.0: off), got {softcap!r}"
    return None


def sinks_problem(sinks, heads: int) -> Optional[str]:
    """The problem with ``sinks`` (None when fine): shape ``(H,)``, a float dtype, finite.

    16-bit sinks are used in the compute dtype (float32 for 16-bit inputs)."""
    if sinks is None:
        return None
    shape = getattr(sinks, "shape", None)
    if shape is None or tuple(shape) != (heads,):
        return f"sinks must have shape (H,) = ({heads},), got {None if shape is None else tuple(shape)}"
    if str(sinks.dtype) not in _dtypes.NAMES:
        return f"sinks must be one of {', '.join(_dtypes.NAMES)}, got dtype {sinks.dtype}"
    host = to_host(sinks).astype(np.float64)
    if not np.isfinite(host).all():
        return f"sinks must be finite, got {host[~np.isfinite(host)][0]} at head {int(np.argmin(np.isfinite(host)))}"
    return None


def _scale_problem(scale) -> Optional[str]:
    if scale is None:
        return None
    try:
        ok = math.isfinite(float(scale))
    except (TypeError, ValueError):
        ok = False
    return None if ok else f"softmax_scale must be a finite number, got {scale!r}"


SCHEDULES = ("auto", "ring", "routed", "allgather")


def schedule_problem(schedule) -> Optional[str]:
    """The problem with ``schedule`` (None when fine): one of :data:`SCHEDULES`, or None."""
    if schedule is None or schedule in SCHEDULES:
        return None
    return f"schedule must be one of {', '.join(repr(s) for s in SCHEDULES)}, got {schedule!r}"


def _timeout_problem(timeout) -> Optional[str]:
    if timeout is None:
        return None
    try:
        ok = float(timeout) > 0
    except (TypeError, ValueError):
        ok = False
    return None if ok else f"timeout must be a number of seconds > 0, got {timeout!r}"


def _option(default, *, op: Optional[str] = None, flag: Optional[str] = None, kind: Optional[str] = None,
            metavar: Optional[str] = None, help: Optional[str] = None):
    """A field of :class:`AttentionOptions` and how it crosses the package's edges, stated once:

    ``op``: its kind among the typed arguments of the torch op (:mod:`ringmpi.torch` builds its
    schema, packing and unpacking from these): ``"bool"``, ``"float"``, ``"float?"``,
    ``"uint64?"`` (a signed 64-bit int on the op), ``"window"``, ``"head_parallel"`` (text), ``"text?"``,
    ``"ints?"``, ``"per_head"`` (one of the op's list of per-head tensors); None: not carried
    (the arrays' dtype travels with the tensors).  ``flag``: its command-line flag where a
    command maps it one to one (:func:`ringmpi.cli.flags.attention_flags` builds the click
    options of ``ringmpi run`` and ``ringmpi bench`` from these), with its ``kind`` (``"switch"``,
    ``"float"``, ``"uint64"``, ``"text"``, ``"floats"``: comma-separated, ``"window"``: two ints,
    -1 unbounded), ``metavar`` and ``help``."""
    return field(default=default, metadata=dict(op=op, flag=flag, kind=kind, metavar=metavar, help=help))


def option_fields(key: str) -> Tuple[str, ...]:
    """The names of :class:`AttentionOptions`' fields whose ``key`` (``"op"``, ``"flag"``) is set,
    in field order."""
    return tuple(f.name for f in fields(AttentionOptions) if f.metadata.get(key) is not None)


def option_edge(name: str) -> dict:
    """How field ``name`` crosses the edges: its ``op``, ``flag``, ``kind``, ``metavar``, ``help``."""
    return dict(AttentionOptions.__dataclass_fields__[name].metadata)


@dataclass(frozen=True)
class AttentionOptions:
    """Everything about one attention call except its arrays, communicator, layout and backend.

    The maths keywords of :func:`ringmpi.ring_attention` (and of the other entry points) and
    the fields of :class:`ringmpi.RingContext` are these fields.  The maths (``causal``,
    ``window``, ``softmax_scale``, ``softcap``, ``alibi_slopes``, ``sinks``, ``dropout_p``,
    ``dropout_seed``, ``return_max_logit``) is documented once, in :func:`ringmpi.ring_attention`'s
    docstring; here they are checked, and flash-attn's "off" is held as None (``window`` sides of
    -1, :func:`ringmpi.core.masks.window_sides`; ``softcap`` 0.0).  The other fields:

    timeout : float, optional
        Deadline in seconds for each ring wait (default: the one rule of
        :func:`ringmpi.runtime.watchdog.deadline`: ``ringmpi run --timeout``, else
        ``RINGMPI_TIMEOUT``, else none).
    check_finite : bool
        Reject NaN/Inf inputs, naming the global index of the first one.
        Without the check (the default) a NaN/Inf reaches exactly the queries
        that see it: a query's ``o``, ``lse`` are dense attention over its
        visible keys alone (a masked key never influences it; a NaN or +Inf
        score makes its row NaN, a -Inf score is a weight of zero), and every
        other query's outputs are bitwise those of a run without the bad value.
    dtype : str, optional
        The dtype every input must have.  ``"bfloat16"`` also accepts ``uint16``
        arrays holding bfloat16 bit patterns (then the outputs are ``uint16``
        bit patterns too); a ``uint16`` array is never read as bfloat16 without it.
    head_parallel : int or "auto", optional
        ``U`` ranks per group of the two-level head x ring schedule
        (:mod:`ringmpi.parallel.head_parallel`): an all-to-all over heads inside groups of
        ``U`` ranks, a ring across the ``P/U`` groups.  ``U`` must divide ``P`` and
        ``H``; ``"auto"`` takes the ranks of a node (:mod:`ringmpi.parallel.topology`).
        Default ``RINGMPI_HEAD_PARALLEL``, else 1: the flat ring.  Shards in and
        out are the same for every ``U``.
    dropout_offsets : (batch_offset, head_offset, total_heads), optional
        Where this call's batch entry 0 and head 0 sit in a larger tensor whose
        mask it should draw (a call over a slice); default ``(0, 0, H)``.
    schedule : "auto" | "ring" | "routed" | "allgather", optional, the same on every rank
        How keys and values move.  ``"ring"``: every K/V block visits every rank
        (:mod:`ringmpi.parallel.ring_schedule`; right for dense masks).  ``"routed"``:
        each rank receives, straight from its owner, only the K/V rows its queries
        can see under the segment ids, causal mask and window
        (:mod:`ringmpi.parallel.routed_schedule`; one more small allgather per call
        plans it), and the backward returns their ``dK, dV`` to the owner.
        ``"allgather"``: every rank gathers every K/V row with nonblocking
        collectives in pieces (:mod:`ringmpi.parallel.allgather_schedule`: the work on
        the first pieces overlaps the transfer of the rest), and the backward hands
        the ``dK, dV`` partial sums back to their owners; it holds O(N_kv) per rank
        and is refused (a ConfigError on every rank) beyond the memory budget
        (``RINGMPI_MEMORY_BUDGET``, default this rank's share of the free memory).
        ``"auto"``: routed where its plan moves fewer K/V rows than the ring (a
        dense mask takes the ring without planning).  Default: ``"auto"`` with a
        ``"balanced"`` :class:`~ringmpi.core.layout.Layout`, else ``"ring"`` (so
        the results of every other call keep their bits).  The schedule that ran
        is in each ``stats`` record (``StepRecord.schedule``).  Results agree to
        rounding, not bitwise, between schedules; each is bitwise repeatable.
        ``invariant=True`` runs on the ring (``"auto"`` resolves to it; ``"routed"``
        and ``"allgather"`` are refused).
    invariant : bool
        The same bits for every number of ranks, layout and ``head_parallel``
        (on one machine and backend, for every dtype): ``o``, ``lse``, ``max_logit``
        and the gradients ``dq, dk, dv`` and ``dsinks`` (summed over the ranks,
        ``reduce_dsinks=True``).  Every shard must be made of whole 64-token
        tiles of global positions (``[64 t, 64 t + 64)``; the last tile of a
        sequence may be short), a ConfigError on every rank otherwise.  Sums
        over key tiles are exact integer sums in fixed point
        (:mod:`ringmpi.core.fixed_point`), the forward makes two passes over
        the ring (row maxima first), and a row reached by NaN/Inf is NaN.
        NumPy and CuPy backends (each its own bits: the same for every P on one
        machine, not the same between a CPU and a GPU).
    """

    causal: bool = _option(False, op="bool", flag="--causal", kind="switch",
                           help="Causal mask (bottom-right aligned when N_q != N_kv).")
    window: Window = _option(None, op="window", flag="--window", kind="window", metavar="L R",
                             help="Sliding window: query i sees keys i-L .. i+R (-1 = unbounded side).")
    softmax_scale: Optional[float] = _option(None, op="float?", flag="--scale", kind="float",
                                             help="Softmax scale [default: 1/sqrt(D)].")
    softcap: Optional[float] = _option(None, op="float?", flag="--softcap", kind="float", metavar="C",
                                       help="Logit softcap: scores become C * tanh(score / C) (C > 0).")
    sinks: Optional[object] = _option(None, op="per_head")
    alibi_slopes: Optional[object] = _option(
        None, op="per_head", flag="--alibi-slopes", kind="floats", metavar="S1,S2,...",
        help="ALiBi: H comma-separated slopes (float32, one per query head); the score of query i "
             "and key j of head h gains -S_h * |i + N_kv - N_q - j|.")
    dropout_p: float = _option(0.0, op="float", flag="--dropout", kind="float", metavar="P",
                               help="Dropout on the attention weights, 0 <= P < 1: the same mask for any "
                                    "number of ranks, layout, pass plan or backend (needs --seed).")
    dropout_seed: Optional[int] = _option(None, op="uint64?", flag="--seed", kind="uint64", metavar="S",
                                          help="Dropout seed (0 <= S < 2^64).")
    dropout_offsets: Optional[Tuple[int, int, int]] = _option(None, op="ints?")
    head_parallel: Union[int, str, None] = _option(
        None, op="head_parallel", flag="--head-parallel", kind="text", metavar="U|auto",
        help="Two-level head x ring schedule: all-to-all over heads in groups of U ranks, ring across "
             "groups; auto = the ranks of a node [default: RINGMPI_HEAD_PARALLEL, else 1].")
    timeout: Optional[float] = _option(None, op="float?", flag="--timeout", kind="float",
                                       help="Deadline in seconds for each blocking phase (ring wait, HDF5 "
                                            "open/write/close, agreement between ranks); a peer that never "
                                            "answers ends the job, naming the phase.")
    check_finite: bool = _option(False, op="bool", flag="--check-finite/--no-check-finite", kind="switch",
                                 help="Reject NaN/Inf inputs (exit 2), naming dataset and global index; "
                                      "without the check they propagate as documented.")
    dtype: Optional[str] = _option(None)  # the arrays' dtype travels with them (tensors, files)
    return_max_logit: bool = _option(False, flag="--max-logit", kind="switch",
                                     help="Also write max_logit (H,): each head's largest score over the "
                                          "whole input.")
    schedule: Optional[str] = _option(
        None, op="text?", flag="--schedule", kind="text", metavar="auto|ring|routed|allgather",
        help="How K/V move: ring (every block visits every rank), routed (each rank receives only the rows "
             "its queries see), allgather (every rank gathers all K/V in pieces: O(N) memory), auto "
             "(routed where that moves fewer rows) [default: auto with --layout "
             "balanced, else ring].")
    invariant: bool = _option(False, op="bool", flag="--invariant", kind="switch",
                              help="The same bits for any number of ranks, layout and head-parallel U "
                                   "(every rank's shard whole 64-token tiles of global positions; a "
                                   "forward makes two passes over the ring).")

    def __post_init__(self):
        # flash-attn's conventions, as the public calls take them: softcap 0.0 is off, a window side
        # of -1 is unbounded (held as None, so that digests and specs are those of an option not given)
        try:
            if self.softcap is not None and float(self.softcap) == 0.0:
                object.__setattr__(self, "softcap", None)
        except (TypeError, ValueError):
            pass  # softcap_problem names it
        if window_problem(self.window) is None:  # else the check names it
            object.__setattr__(self, "window", window_sides(self.window))

    def for_heads(self, first: int, count: int) -> "AttentionOptions":
        """These options for a call over the query heads ``[first, first + count)`` of this one
        (as :meth:`ScoreSpec.for_heads`): the per-head arrays (``sinks``, ``alibi_slopes``)
        sliced; ``dropout_offsets`` stay the caller's to set."""
        return replace(self, **{name: getattr(self, name)[first:first + count] for name in PER_HEAD
                                if getattr(self, name) is not None})

    # ------------------------------------------------------------------ rules
    def problem(self, heads: int) -> Optional[str]:
        """This rank's problem with its options for a call with ``heads`` query heads, or None
        (the declared dtype is :meth:`dtype_problem`, checked before the arrays)."""
        found = self.field_problem(heads)
        return None if found is None else found[1]

    def field_problem(self, heads: Optional[int] = None) -> Optional[Tuple[str, str]]:
        """``(option, message)`` of the first bad option, or None; the option is a field name,
        ``"dropout"`` for the dropout fields.  ``heads`` None: only the rules that need no head
        count (a command line checks them before it reads its input; not ``sinks``,
        ``alibi_slopes`` nor ``dropout_offsets``)."""
        per_head = heads is not None
        checks = (("window", lambda: window_problem(self.window)),
                  ("softmax_scale", lambda: _scale_problem(self.softmax_scale)),
                  ("softcap", lambda: softcap_problem(self.softcap)),
                  ("sinks", lambda: sinks_problem(self.sinks, heads) if per_head else None))
        checks += tuple((m.field, lambda m=m: m.problem(getattr(self, m.field), heads) if per_head else None)
                        for m in _modifiers.MODIFIERS)
        checks += (("dropout", lambda: self._dropout_problem(heads)),
                  ("timeout", lambda: _timeout_problem(self.timeout)),
                  ("schedule", lambda: schedule_problem(self.schedule)),
                  ("schedule", lambda: f"invariant=True runs on the ring schedule, not schedule={self.schedule!r}"
                   if self.invariant and self.schedule in ("routed", "allgather") else None))
        for name, check in checks:
            message = check()
            if message is not None:
                return name, message
        return None

    def modifier_names(self) -> Tuple[str, ...]:
        """The fields of the score modifiers with per-head data these options use
        (:mod:`ringmpi.core.modifiers`)."""
        return tuple(f for f in _modifiers.FIELDS if getattr(self, f) is not None)

    def dtype_problem(self) -> Optional[str]:
        """The problem with ``dtype`` (None when fine): one of the four names, or None."""
        if self.dtype is not None and _dtypes.declared_name(self.dtype) is None:
            return f"dtype={self.dtype!r} is not one of {', '.join(_dtypes.NAMES)}"
        return None

    def _dropout_problem(self, heads: Optional[int]) -> Optional[str]:
        problem = _dropout_validate(self.dropout_p, self.dropout_seed)
        offsets = self.dropout_offsets
        if problem is None and offsets is not None and heads is not None:
            ok = len(offsets) == 3 and all(isinstance(x, (int, np.integer)) for x in offsets)
            if not (ok and min(offsets) >= 0 and offsets[1] + heads <= offsets[2]):
                problem = ("dropout_offsets must be (batch_offset, head_offset, total_heads) covering "
                           f"this call, got {offsets!r}")
        return problem

    def size_problem(self, heads: int, batch: int, n_q: int, n_kv: int) -> Optional[str]:
        """The problem with dropout's counter ranges for these global sizes (None when fine)."""
        key = self.dropout_key(heads)
        if key is None:
            return None
        if max(n_q, n_kv) > MAX_POSITION:
            return f"dropout needs sequence lengths <= 2^48, got N_q={n_q}, N_kv={n_kv}"
        if (key[2] + batch) * key[4] > 1 << 32:
            return "dropout needs (batch entries x heads) <= 2^32"
        return None

    # ------------------------------------------------------------------ derived values (checked options)
    def scale(self, dim: int) -> float:
        """The softmax scale for head dim ``dim``: ``softmax_scale``, else ``1 / sqrt(dim)``."""
        return float(self.softmax_scale) if self.softmax_scale is not None else 1.0 / math.sqrt(dim)

    def kv_schedule(self, balanced: bool) -> str:
        """``schedule`` resolved for a call: its default is ``"auto"`` on a balanced layout
        (``balanced``), else ``"ring"``; ``invariant`` always runs on the ring (its block ops
        take whole tiles of global positions, its dK/dV integer sums travel the ring)."""
        if self.invariant:
            return "ring"
        if self.schedule is not None:
            return self.schedule
        return "auto" if balanced else "ring"

    def dropout_key(self, heads: int):
        """``(p, seed, batch_offset, head_offset, total_heads)``, None without dropout."""
        if float(self.dropout_p) == 0:
            return None
        b0, h0, total = (0, 0, heads) if self.dropout_offsets is None else self.dropout_offsets
        return float(self.dropout_p), int(self.dropout_seed), int(b0), int(h0), int(total)

    def score_spec(self, heads: int, offset: int = 0) -> ScoreSpec:
        """The mask spec of a call with ``heads`` query heads and ``offset = N_kv - N_q``."""
        key = self.dropout_key(heads)
        dropout = None if key is None else Dropout(p=key[0], seed=key[1], heads=key[4],
                                                   batch_offset=key[2], head_offset=key[3])
        return ScoreSpec(causal=bool(self.causal), window=self.window, offset=offset,
                        softcap=None if self.softcap is None else float(self.softcap),
                        exact_max=bool(self.return_max_logit), dropout=dropout,
                        modifiers=_modifiers.of_fields({f: getattr(self, f) for f in _modifiers.FIELDS}))

    # ------------------------------------------------------------------ agreement
    def digest(self, *arrays, extra=()) -> int:
        """CRC-32 of the options every rank must pass alike, then of ``arrays`` (host or
        device, by their bytes) and ``repr(extra)``; compare across ranks with one collective."""
        scalars = (bool(self.causal), self.window,
                   None if self.softmax_scale is None else float(self.softmax_scale),
                   None if self.softcap is None else float(self.softcap),
                   bool(self.check_finite), bool(self.return_max_logit), tuple(extra))
        if self.schedule is not None:  # (so that digests without it keep their values)
            scalars += (("schedule", str(self.schedule)),)
        if self.invariant:  # a separate term: the digests of calls without it are unchanged
            scalars += ("invariant",)
        crc = zlib.crc32(repr(scalars).encode())
        for name in PER_HEAD:
            per_head = getattr(self, name)
            if per_head is not None:
                crc = zlib.crc32(name.encode(), crc)
                crc = zlib.crc32(np.ascontiguousarray(to_host(per_head), dtype=np.float64).view(np.uint8), crc)
        for x in arrays:
            if x is not None:
                crc = zlib.crc32(np.ascontiguousarray(to_host(x)).view(np.uint8), crc)
        return crc


FIELD_NAMES: Tuple[str, ...] = tuple(f.name for f in fields(AttentionOptions))
