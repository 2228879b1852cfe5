"""The root attributes of a file job's output (docs/file-format.md): the one place that
writes and reads their names and encodings, the attention options' included.

:class:`OutputAttributes` is written by the job (:mod:`ringmpi.filejob.job`) and read back by
``ringmpi verify``; :func:`attention_attrs` / :func:`attention_of_attrs` encode one
:class:`~ringmpi.options.AttentionOptions` (a score modifier's per-head values are an
attribute named as its field, float32 ``(H,)``: a new modifier needs no line here).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np

from .. import __version__
from ..core import modifiers as _modifiers
from ..core.host import to_host
from ..core.masks import window_of
from ..options import AttentionOptions
from ..runtime.errors import ConfigError


def attention_attrs(options: AttentionOptions, dim: int) -> dict:
    """The output attributes of ``options`` for head dim ``dim``: ``causal``, ``window`` (int64
    ``[left, right]``, -1 unbounded; empty without a window), ``softmax_scale`` (resolved),
    ``softcap`` (0: none), ``max_logit``, with dropout ``dropout_p``, ``dropout_seed``, each
    score modifier in use as its field (``alibi_slopes``: float32 ``(H,)``), and ``invariant``
    (True) when used.  Sinks are a dataset, not an attribute (they have a gradient)."""
    attrs = {"causal": bool(options.causal),
             "window": np.array([] if options.window is None else window_of(options.window), dtype=np.int64),
             "softmax_scale": float(options.scale(dim)),
             "softcap": 0.0 if options.softcap is None else float(options.softcap),
             "max_logit": bool(options.return_max_logit)}
    if float(options.dropout_p) > 0:
        attrs.update(dropout_p=float(options.dropout_p), dropout_seed=np.uint64(options.dropout_seed))
    for name in options.modifier_names():
        attrs[name] = np.asarray(to_host(getattr(options, name)), dtype=np.float32)
    if options.invariant:
        attrs["invariant"] = True
    return attrs


def attention_of_attrs(attrs, sinks=None) -> AttentionOptions:
    """The options :func:`attention_attrs` wrote (``softmax_scale`` resolved), with ``sinks``;
    attributes added in later versions default to "not used"."""
    window = np.asarray(attrs.get("window", [])).ravel()
    dropout_p = float(attrs.get("dropout_p", 0.0))
    modifiers = {name: np.asarray(attrs[name], dtype=np.float32).ravel()
                 for name in _modifiers.FIELDS if name in attrs}
    return AttentionOptions(causal=bool(attrs["causal"]),
                            window=tuple(window) if window.size else None,
                            softmax_scale=float(attrs["softmax_scale"]),
                            softcap=float(attrs.get("softcap", 0.0)) or None, sinks=sinks,
                            dropout_p=dropout_p, dropout_seed=int(attrs["dropout_seed"]) if dropout_p > 0 else None,
                            return_max_logit=bool(attrs.get("max_logit", False)),
                            invariant=bool(attrs.get("invariant", False)), **modifiers)


@dataclass(frozen=True)
class OutputAttributes:
    """The root attributes of an output file (docs/file-format.md): written by the job,
    read back by ``ringmpi verify`` -- the one place that knows their names and encodings.
    ``attention``'s are :func:`attention_attrs` / :func:`attention_of_attrs` (``softmax_scale``
    resolved)."""

    ringmpi_version: str
    world_size: int
    layout: str
    segments: bool
    backend: str
    dtype: str
    backward: bool
    input_path: str
    input_shapes: dict  # dataset name -> shape (list)
    heads_per_pass: Optional[int]
    sinks_dataset: Optional[str]
    attention: AttentionOptions

    @classmethod
    def of_job(cls, options, spec, input_path: str, world_size: int, backend: str):
        """The attributes of a job with :class:`~ringmpi.filejob.job.JobOptions` ``options`` over the
        input ``spec``."""
        return cls(ringmpi_version=__version__, world_size=world_size, layout=options.layout_name,
                   segments=bool(spec.seg_q), backend=backend, dtype=spec.dtype, backward=bool(options.backward),
                   input_path=os.path.abspath(input_path),
                   input_shapes={k: list(v) for k, v in spec.shapes.items()},
                   heads_per_pass=options.heads_per_pass, sinks_dataset=options.sinks_dataset,
                   attention=attention_of_attrs(attention_attrs(options.attention, spec.dim)))

    def write(self, fout) -> None:
        """Set the attributes on an open output file (collective: the same values on every rank)."""
        attrs = dict(ringmpi_version=self.ringmpi_version, world_size=self.world_size, layout=self.layout,
                     segments=self.segments, backend=self.backend, dtype=self.dtype, backward=self.backward,
                     input_path=self.input_path, input_shapes=json.dumps(self.input_shapes, sort_keys=True),
                     heads_per_pass=-1 if self.heads_per_pass is None else int(self.heads_per_pass),
                     sinks_dataset=self.sinks_dataset or "", **attention_attrs(self.attention, dim=1))
        for key, value in attrs.items():
            fout.attrs[key] = value

    @classmethod
    def read(cls, fo, path: str) -> "OutputAttributes":
        """The attributes of the open output file ``fo`` at ``path``; ConfigError when it was not
        written by ``ringmpi run``.  Attributes added in later versions default to "not used"."""
        a = fo.attrs
        for key in ("causal", "softmax_scale", "input_shapes"):
            if key not in a:
                raise ConfigError(f"{path}: attribute '{key}' missing: not written by ringmpi run")
        heads_per_pass = int(a.get("heads_per_pass", -1))
        return cls(ringmpi_version=str(a.get("ringmpi_version", "")), world_size=int(a.get("world_size", 0)),
                   layout=str(a.get("layout", "")), segments=bool(a.get("segments", False)),
                   backend=str(a.get("backend", "")), dtype=str(a.get("dtype", "")),
                   backward=bool(a.get("backward", False)), input_path=str(a.get("input_path", "")),
                   input_shapes=json.loads(a["input_shapes"]),
                   heads_per_pass=None if heads_per_pass < 0 else heads_per_pass,
                   sinks_dataset=str(a.get("sinks_dataset", "")) or None,
                   attention=attention_of_attrs(a))

    def score_spec(self, spec):
        """The :class:`ringmpi.core.masks.ScoreSpec` the job computed with, for the input ``spec``."""
        return self.attention.score_spec(spec.heads, offset=spec.n_kv - spec.n_q)
