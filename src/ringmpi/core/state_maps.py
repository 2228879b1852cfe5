"""Affine maps of a recurrent state, ``S -> M S + U``, and their composition, by the kind of ``M``.

A run of tokens of a linear-attention layer (a rank's shard, a chunk) moves the state ``S``
(per batch row and head, ``K x V``) by such a map; ``M`` is one of

* ``identity``: plain linear attention; ``m`` is 1, or 0 where a document starts inside the run
  (the state is reset), shape ``(R, H)``;
* ``scalar``: a scalar decay (Mamba-2, RetNet, simple GLA), ``(R, H)``;
* ``diagonal``: a per-key decay (GLA), ``(R, H, K)``;
* ``dense``: the delta rule's ``K x K`` (gated delta rule, KDA), ``(R, H, K, K)``;

``u`` is ``(R, H, K, V)``.  :func:`then` composes in order (not commutative: the ranks'
exclusive scan of ``parallel/state_scan.py`` is built on it); :func:`transposed` gives the
map the backward scans in reverse, ``dS -> M^T dS + c``.  A map travels as one flat array
(:func:`pack`, :func:`unpack`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .host import array_module

KINDS = ("identity", "scalar", "diagonal", "dense")


def m_shape(kind: str, rows: int, heads: int, kdim: int) -> tuple:
    return {"identity": (rows, heads), "scalar": (rows, heads), "diagonal": (rows, heads, kdim),
            "dense": (rows, heads, kdim, kdim)}[kind]


@dataclass
class StateMap:
    kind: str
    m: np.ndarray
    u: np.ndarray

    def apply(self, s) -> np.ndarray:
        """``M s`` (without ``U``) for states ``s`` of ``u``'s shape."""
        return apply_m(self.kind, self.m, s)


def apply_m(kind: str, m, s) -> np.ndarray:
    if kind == "dense":
        return m @ s
    if kind == "diagonal":
        return m[..., None] * s
    return m[..., None, None] * s


def identity(kind: str, rows: int, heads: int, kdim: int, vdim: int, dtype, xp=np) -> StateMap:
    """The map that changes nothing (an empty run), in the array module ``xp``."""
    shape = m_shape(kind, rows, heads, kdim)
    m = xp.broadcast_to(xp.eye(kdim, dtype=dtype), shape).copy() if kind == "dense" else xp.ones(shape, dtype)
    return StateMap(kind, m, xp.zeros((rows, heads, kdim, vdim), dtype))


def reset(kind: str, u) -> StateMap:
    """The map of a run in which a document starts: the entering state is forgotten."""
    rows, heads, kdim, _ = u.shape
    return StateMap(kind, array_module(u).zeros(m_shape(kind, rows, heads, kdim), u.dtype), u)


def then(first: StateMap, second: StateMap) -> StateMap:
    """``second`` after ``first``: ``S -> M2 (M1 S + U1) + U2``."""
    m = second.m @ first.m if first.kind == "dense" else second.m * first.m
    return StateMap(first.kind, m, second.apply(first.u) + second.u)


def transposed(smap: StateMap, c) -> StateMap:
    """The backward's map ``dS -> M^T dS + c``."""
    return StateMap(smap.kind, smap.m.swapaxes(-1, -2) if smap.kind == "dense" else smap.m, c)


def pack(smap: StateMap) -> np.ndarray:
    return array_module(smap.u).concatenate([smap.m.ravel(), smap.u.ravel()])


def unpack(kind: str, flat, u_shape: tuple) -> StateMap:
    shape = m_shape(kind, *u_shape[:3])
    size = int(np.prod(shape))
    return StateMap(kind, flat[:size].reshape(shape), flat[size:].reshape(u_shape))
