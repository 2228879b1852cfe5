"""The CPU tiles' elementwise passes between their GEMMs, and which code runs them.

``exp_pass(s, scale, bias, shift, sums)``: ``s = exp(s * scale + bias - shift[:, None])`` in
place, each step rounded in that order, with the rows' sums of the result when asked;
``ds_pass(dp, p, dvec)``: the backward's ``dp = (dp - dvec[:, None]) * p``.  For
float32 each is one sweep of the compiled extension (``ringmpi._ext._fused``, built by ``pip
install`` from ``src/ringmpi/_ext/fused.c``), which is compiled once per vector path
(``avx512``, ``avx2``, ``plain``: the same float32 operations in the same order, so the same
bits on each); other dtypes, and every dtype where the extension was not built or
``RINGMPI_CPU_KERNEL=numpy`` asks for it, take NumPy's passes.

The same extension holds the compiled forward block op of the path (:func:`block_op`), which
:mod:`ringmpi.backends.numpy_backend` runs for the common float32 forward.

The path is chosen when this module is first imported: ``RINGMPI_CPU_VECTOR`` pins one (a
``ValueError`` naming the variable where this CPU or build cannot run it), else a short
calibration times each path the CPU runs on one small tile and takes the fastest, not the
widest (an AVX-512 unit may run at half rate, an AVX2 one may be the faster; every path
gives the same bits, so the choice changes only the time).
"""

from __future__ import annotations

import os
import time

import numpy as np

CALIBRATION_SHAPE = (64, 512)  # the tile each path is timed on at import: a few hundred microseconds in all
CALIBRATION_REPEAT = 5


def _calibrate(fused) -> dict:
    """Elements per second of each path this CPU runs on a small tile, best of a few rounds
    taken in turn (so a burst of load elsewhere hits every path alike)."""
    start = np.linspace(-30, 0, CALIBRATION_SHAPE[0] * CALIBRATION_SHAPE[1], dtype=np.float32)
    start = start.reshape(CALIBRATION_SHAPE)
    tile = np.empty_like(start)
    best = {path: float("inf") for path in fused.paths()}
    for _ in range(CALIBRATION_REPEAT):
        for path in best:
            fused.use(path)
            np.copyto(tile, start)
            began = time.perf_counter()
            fused.exp_tile(tile, np.float32(1), None, None)
            best[path] = min(best[path], time.perf_counter() - began)
    return {path: tile.size / max(seconds, 1e-9) for path, seconds in best.items()}


def _load():
    """(the compiled pass set to its path, or None; the calibration's rates, empty when none ran)."""
    if os.environ.get("RINGMPI_CPU_KERNEL", "compiled") == "numpy":
        return None, {}
    pinned = os.environ.get("RINGMPI_CPU_VECTOR", "")
    try:
        from .._ext import _fused
    except ImportError:
        if pinned:
            raise ValueError(f"RINGMPI_CPU_VECTOR={pinned} pins a path of the compiled tile pass, "
                             "which was not built (pip install the checkout with a C compiler)") from None
        return None, {}
    if pinned:
        if pinned not in _fused.paths():
            raise ValueError(f"RINGMPI_CPU_VECTOR must be a path this CPU runs "
                             f"({', '.join(_fused.paths())}), got {pinned!r}")
        _fused.use(pinned)
        return _fused, {}
    if len(_fused.paths()) == 1:
        return _fused, {}
    rates = _calibrate(_fused)
    _fused.use(max(rates, key=rates.get))
    return _fused, rates


# the compiled pass (its module, set to the chosen path), or None where NumPy's passes run
compiled, _rates = _load()

PANEL = 32  # keys per packed K panel of the compiled products (block_rows.h's PANEL): kp (panels * D, PANEL)


def implementation() -> str:
    """Which elementwise pass float32 tiles use: ``"compiled"`` or ``"numpy"``."""
    return "numpy" if compiled is None else "compiled"


def vector_path():
    """The vector path the compiled pass runs (``"avx512"``, ``"avx2"``, ``"plain"``), or None
    where NumPy's passes run."""
    return None if compiled is None else compiled.path()


def vector_paths() -> tuple:
    """The compiled pass's paths this CPU runs, widest first (empty where it is not built)."""
    return () if compiled is None else tuple(compiled.paths())


def use(path: str) -> None:
    """Run the compiled pass on ``path`` from now on (``ValueError`` where this CPU cannot)."""
    if compiled is None:
        raise ValueError("the compiled tile pass is not loaded (not built, or RINGMPI_CPU_KERNEL=numpy)")
    compiled.use(path)


def calibration() -> dict:
    """Elements per second each path reached on the import's calibration tile (empty where
    none ran: one path, a pinned path or no compiled pass)."""
    return dict(_rates)


def block_op():
    """The compiled forward block op (``_fused.fwd_chunk``, see ``_ext/block_rows.h``) of the path in
    use, or None: where the pass is not built, ``RINGMPI_CPU_KERNEL=numpy``, ``RINGMPI_CPU_BLOCK=tiles``
    (the BLAS tiles, for comparison) or the path has no FMA instructions (plain on a CPU without FMA)."""
    if compiled is None or os.environ.get("RINGMPI_CPU_BLOCK", "compiled") == "tiles":
        return None
    return compiled.fwd_chunk if compiled.has_block() else None


def backward_op():
    """The compiled backward block op (``_fused.bwd_chunk``, see ``_ext/block_rows.h``) of the path in
    use, or None where :func:`block_op` is None."""
    return None if block_op() is None else compiled.bwd_chunk


def exp_pass(s, scale, bias=None, shift=None, sums=None) -> None:
    """``s = exp(s * scale + bias - shift[:, None])`` in place (``bias``, ``shift`` optional),
    each step rounded in that order; ``sums (rows,)``, when given, receives the rows' sums of
    the result.  ``s (rows, cols)`` with unit column stride; one compiled sweep for float32,
    NumPy passes otherwise."""
    if compiled is not None and s.dtype == np.float32 and (bias is None or bias.dtype == np.float32):
        compiled.exp_tile(s, scale, bias, shift, sums)
        return
    if scale != 1:
        s *= scale
    if bias is not None:
        s += bias
    if shift is not None:
        s -= shift[:, None]
    np.exp(s, out=s)
    if sums is not None:
        np.sum(s, axis=1, out=sums)


def ds_pass(dp, p, dvec) -> None:
    """The backward's ``dS = P * (dP - dvec)`` in place in ``dp``: ``dp = (dp - dvec[:, None]) * p``,
    the subtraction and the product each rounded, so NumPy's two passes give the same bits.
    ``dp``, ``p (rows, cols)`` with unit column stride, ``dvec (rows,)``; one compiled sweep
    for float32, NumPy passes otherwise."""
    if compiled is not None and dp.dtype == p.dtype == dvec.dtype == np.float32:
        compiled.ds_tile(dp, p, dvec)
        return
    dp -= dvec[:, None]
    dp *= p


# ------------------------------------------------------------ the per-element rules of kernels/rules.h
# The same extension builds kernels/rules.h, the rules the CUDA kernels run (masks, ALiBi, Philox
# dropout): where it is loaded, the NumPy tiles take their masks, dropout and ALiBi terms from that
# code, else from the Python references (ringmpi.core.masks, .dropout, .modifiers), which give the
# same bits (tests/unit/test_rules.py holds the two together).
def _positions(pos) -> np.ndarray:
    return np.ascontiguousarray(pos, dtype=np.int64)


def visible(spec, q_pos, kv_pos, seg_q=None, seg_kv=None) -> np.ndarray:
    """:meth:`ringmpi.core.masks.ScoreSpec.visible`: ``(len(q_pos), len(kv_pos))`` bool, by
    rules.h's ``elem_visible`` where the extension is loaded."""
    if compiled is None:
        return spec.visible(q_pos, kv_pos, seg_q, seg_kv)
    from ..core.masks import kernel_scalars

    q_pos, kv_pos = _positions(q_pos), _positions(kv_pos)
    if seg_q is not None:
        seg_q, seg_kv = _positions(seg_q), _positions(seg_kv)
    out = np.empty((len(q_pos), len(kv_pos)), dtype=bool)
    has_lo, lo, has_hi, hi = (int(x) for x in kernel_scalars(spec))
    compiled.visible(q_pos, kv_pos, seg_q, seg_kv, has_lo, lo, has_hi, hi, out)
    return out


def dropout_keep(dropout, b: int, h: int, q_pos, kv_pos) -> np.ndarray:
    """:meth:`ringmpi.core.dropout.Dropout.keep`: which weights survive, by rules.h's
    ``dropout_keep`` (Philox 4x32-10) where the extension is loaded."""
    if compiled is None:
        return dropout.keep(b, h, q_pos, kv_pos)
    q_pos, kv_pos = _positions(q_pos), _positions(kv_pos)
    out = np.empty((len(q_pos), len(kv_pos)), dtype=bool)
    compiled.dropout_keep(q_pos, kv_pos, *dropout.key(), dropout.threshold, dropout.heads,
                          dropout.batch_offset, dropout.head_offset, int(b), int(h), out)
    return out


def dropout_multiplier(dropout, b: int, h: int, q_pos, kv_pos, dtype) -> np.ndarray:
    """:meth:`ringmpi.core.dropout.Dropout.multiplier` (``keep * rescale`` in ``dtype``) from
    :func:`dropout_keep`."""
    return np.where(dropout_keep(dropout, b, h, q_pos, kv_pos), dropout.rescale(dtype), 0).astype(dtype)


def modifier_terms(spec, q_pos, kv_pos, dtype):
    """:meth:`ringmpi.core.masks.ScoreSpec.modifier_terms`, ALiBi's terms by rules.h's
    ``alibi_score`` where the extension is loaded (float32 and float64)."""
    from ..core.modifiers import Alibi

    dtype = np.dtype(dtype)
    if compiled is None or dtype not in (np.float32, np.float64) or \
            any(type(m) is not Alibi for m in spec.modifiers):
        return spec.modifier_terms(q_pos, kv_pos, dtype)
    if not spec.modifiers:
        return None
    q_pos, kv_pos = _positions(q_pos), _positions(kv_pos)
    offset = int(spec.offset)

    def term(slopes, h):
        out = np.empty((len(q_pos), len(kv_pos)), dtype=dtype)
        compiled.alibi_terms(q_pos, kv_pos, offset, float(slopes[h]), out)
        return out

    if len(spec.modifiers) == 1:
        return lambda h: term(spec.modifiers[0].values, h)
    parts = [m.values for m in spec.modifiers]
    return lambda h: sum((term(v, h) for v in parts[1:]), term(parts[0], h))
