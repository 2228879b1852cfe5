"""Where and how the attention calls run, as one object; the maths stays in each call's keywords.

Every public attention call (:func:`ringmpi.ring_attention`, :func:`ringmpi.ring_attention_backward`,
:func:`ringmpi.decode_attention`, :func:`ringmpi.torch.ring_attention` and the torch wrappers) takes
the attention's maths as flash-attn's keywords (``causal``, ``window``, ``softmax_scale``,
``softcap``, ``alibi_slopes``, ``sinks``, ``dropout_p``, ...) and everything about where and how it
runs through one ``context=`` :class:`RingContext`: the communicator, the layout, the backend, the
schedule, the deadline, the checks, the record of what ran.  There is no other way to pass any of
them, and the environment is read here only (:mod:`ringmpi.runtime.env`), as the context's defaults.

:func:`call_options` joins a call's maths keywords and its context into the one
:class:`~ringmpi.options.AttentionOptions` that travels inside; :class:`Attention` and
:class:`Gradients` are what every call returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, NamedTuple, Optional, Tuple, Union

from .core.layout import Layout
from .options import AttentionOptions
from .runtime import env, watchdog

class Attention(NamedTuple):
    """What a forward returns: ``o``, ``lse`` and, when asked (``return_max_logit``), ``max_logit``
    (None otherwise).  ``o, lse, _ = ring_attention(...)`` or ``ring_attention(...).o``."""

    o: Any
    lse: Any
    max_logit: Any = None


class Gradients(NamedTuple):
    """What a backward returns: ``dq, dk, dv`` and ``dsinks`` (None without sinks)."""

    dq: Any
    dk: Any
    dv: Any
    dsinks: Any = None


@dataclass(frozen=True)
class RingContext:
    """Where and how the attention calls run: pass it as ``context=`` (None: ``RingContext()``).

    comm : mpi4py communicator, optional
        None: a library-owned duplicate of ``COMM_WORLD`` (made once).
    layout : "contiguous" | "zigzag" | "striped" | Layout
        How tokens are spread over ranks; a ``Layout`` must match ``N_q`` and ``P``.
        ``Layout("balanced", N, P, documents=..., causal=..., window=...)`` places a pack of
        documents so that every rank sees the same number of (query, key) pairs (self-attention);
        shard the segment ids with it too (``layout.segment_ids(rank)``).  A call given
        ``positions`` does not use it.  For :func:`ringmpi.decode_attention` it places the cache
        (a kind name, a ``Layout`` or ``KVCache.placement``).
    backend : "auto" | "numpy" | "cupy"
        "auto" follows the arrays (NumPy or CuPy; torch: the tensors' device).
    schedule : "auto" | "ring" | "routed" | "allgather", optional
        How keys and values move (:class:`~ringmpi.options.AttentionOptions` documents each);
        default ``"auto"`` with a balanced layout, else ``"ring"``.
    head_parallel : int or "auto", optional
        ``U`` ranks per group of the head x ring schedule; default ``RINGMPI_HEAD_PARALLEL``,
        else 1 (the flat ring).
    timeout : float, optional
        Deadline in seconds for each blocking wait; default ``RINGMPI_TIMEOUT`` (or ``ringmpi
        run --timeout``), else none.
    check_finite : bool
        Reject NaN/Inf inputs, naming the global index of the first one.
    dtype : str, optional
        The dtype every input must have; ``"bfloat16"`` also reads ``uint16`` bit patterns.
    invariant : bool
        The same bits for every number of ranks, layout and ``head_parallel`` (shards of whole
        64-token tiles of global positions).
    dropout_offsets : (batch_offset, head_offset, total_heads), optional
        Where this rank's batch entry 0 and head 0 sit in a larger tensor whose dropout mask the
        calls draw (a tensor-parallel rank's heads, a pass over a slice); default ``(0, 0, H)``.
    reduce_dsinks : bool
        True: a backward's ``dsinks`` is summed over the ranks (the same on every rank).  False:
        this rank's own queries' share, for a framework that sums replicated gradients itself
        (``ringmpi.torch`` runs so).
    stats : list, optional
        Every call run in this context appends its records: one
        :class:`~ringmpi.parallel.ring.StepRecord` per ring step (with head x ring, an
        :class:`~ringmpi.parallel.head_parallel.ExchangeRecord` before and after them), one
        :class:`~ringmpi.decode.DecodeRecord` per decode call.

    Every field but ``comm``, ``layout``, ``backend`` and ``stats`` is checked (and agreed across
    ranks) by each call, as :class:`~ringmpi.options.AttentionOptions` states its rules.
    """

    comm: Any = None
    layout: Union[str, Layout, Any] = "contiguous"
    backend: str = "auto"
    schedule: Optional[str] = None
    head_parallel: Union[int, str, None] = None
    timeout: Optional[float] = None
    check_finite: bool = False
    dtype: Optional[str] = None
    invariant: bool = False
    dropout_offsets: Optional[Tuple[int, int, int]] = None
    reduce_dsinks: bool = True
    stats: Optional[list] = field(default=None, compare=False)

    def __post_init__(self):
        if self.head_parallel is None:
            object.__setattr__(self, "head_parallel", env.head_parallel())
        if self.timeout is None:  # ringmpi run --timeout (watchdog.set_default), else RINGMPI_TIMEOUT
            object.__setattr__(self, "timeout", watchdog.deadline(None))

    @classmethod
    def of(cls, context: Optional["RingContext"]) -> "RingContext":
        """``context``, or the default one; a TypeError for anything else."""
        if context is None:
            return cls()
        if not isinstance(context, cls):
            raise TypeError(f"context must be a ringmpi.RingContext, got {type(context).__name__}")
        return context

    def replace(self, **changes) -> "RingContext":
        """This context with ``changes`` (``dataclasses.replace``)."""
        return replace(self, **changes)


def comm_of(context: Optional[RingContext]):
    """The communicator of ``context`` (None: the default context's), for the calls that use
    only it (the linear-attention calls, the convolution, ``relayout``)."""
    return RingContext.of(context).comm


RUN_FIELDS = tuple(f.name for f in fields(RingContext)
                   if f.name in AttentionOptions.__dataclass_fields__)  # those the options carry


def pair(x, name: str) -> tuple:
    """A varlen keyword (``segment_ids``, ``positions``): one array for self-attention (queries and
    keys alike), or a tuple ``(for_q, for_kv)``."""
    if isinstance(x, tuple):
        if len(x) != 2:
            raise TypeError(f"{name} must be one array or a tuple (for_q, for_kv), got a tuple of {len(x)}")
        return x
    return x, x


def call_options(context: RingContext, **maths) -> AttentionOptions:
    """The one :class:`~ringmpi.options.AttentionOptions` of a call: its maths keywords (flash-attn's
    conventions, ``window`` sides -1 unbounded and ``softcap`` 0.0 off, which the options take as
    they are) and its context's fields.  ``window=None`` and ``softcap=None``, the old
    spellings of "off", are a TypeError: one way to say each thing."""
    for name, off in (("window", "(-1, -1)"), ("softcap", "0.0")):
        if name in maths and maths[name] is None:
            raise TypeError(f"{name}=None: pass {name}={off} (flash-attn's convention) for none")
    run = {name: getattr(context, name) for name in RUN_FIELDS}
    return AttentionOptions(**maths, **run)
