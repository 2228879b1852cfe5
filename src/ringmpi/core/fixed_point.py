"""Order-free sums: float partial sums added exactly as integers (``invariant=True``).

A float sum depends on the order of its terms; a ring adds key blocks in ring order, so
the last bits of a result move with the number of ranks.  Integer addition does not:
the invariant mode converts each fixed-shape tile's float partial sum (the same bits on
every rank, :mod:`ringmpi.core.global_tiles`) to an integer on a grid ``2^-G`` and adds
the integers, so the sum is the same whatever the order, the grouping and the ranks.

The grid.  A sum whose exact value is at most a bound ``B`` (in magnitude) is held as the
integer ``trunc(x * 2^G)`` per partial ``x``, with ``G = TOP - e`` and ``B <= 2^e``
(:func:`exponent`), ``TOP = 61``: partials and their sum stay within ``2^61`` (a float
partial rounded above its exact bound is far inside the remaining factor of 4 to ``2^63``).  Bounds are built from exact quantities only -- maxima (``MPI.MAX`` is exact in
any order), counts, integer exponents -- so ``G`` is the same on every rank and for every
P.  ``float64`` sums use two int64 words (``limbs = 2``): ``hi = trunc(y 2^-30)``, ``lo =
trunc(y - hi 2^30)`` for ``y = x 2^G`` with ``TOP = 91``.

Error.  Each partial loses less than ``2^-G`` to truncation, so a sum of ``T`` partials is
off by less than ``T 2^-G = T B 2^-TOP`` (``2^-61`` or ``2^-91`` of the bound per
partial).  In the forward (``o`` numerator, denominator ``l >= 1``), ``B = N V_max`` with
``T = N / 64`` partials per row: an absolute error below ``N^2 2^-67 V_max``, ``2^-27 V_max``
at ``N = 2^20`` (float32's own rounding of one value is up to ``2^-24``), ``2^-57 V_max`` for
float64.  The backward's bounds (:func:`dq_exponents`, :func:`kv_exponents`) carry a few more powers of two of
slack; the tests hold every result to the project's tolerance rule.

A row of ``x`` holding NaN/Inf or a value beyond the grid adds nothing and is reported in
``bad`` (the caller makes the row NaN): never a wrapped integer.

The loop is :func:`add_numpy` here, compiled in ``_ext/fixed.c`` (the same IEEE double
operations: the same integers); :func:`ringmpi.backends.fixed_sums.add` runs either.  The split
into words (``TOP``, ``LIMB_BITS``, the range limits) is :mod:`ringmpi.core.fixed_split`'s, which
the C loop and the GPU's ``kernels/invariant.cu`` take as ``-D`` defines.
"""

from __future__ import annotations

import numpy as np

from .fixed_split import LIMB, LIMB_BITS, TOP, limit, top  # noqa: F401 - TOP, LIMB_BITS: re-exported

MIN_EXPONENT = -1000  # bounds below 2^-1000 count as 2^-1000 (their values round to 0 on the grid)


def limbs_for(compute_dtype) -> int:
    """Int64 words per value: 2 for float64 sums (92 bits), 1 for float32 (62 bits)."""
    return 2 if np.dtype(compute_dtype) == np.float64 else 1


def exponent(x) -> np.ndarray:
    """Per element the least integer ``e`` with ``|x| <= 2^e`` (int64), NaN/Inf counted as 0
    (their rows are made NaN elsewhere) and 0 counted as 1; never below ``MIN_EXPONENT``.
    Exact, so a bound built from exponents is the same bits on every rank."""
    x = np.abs(np.asarray(x, dtype=np.float64))
    x = np.where(np.isfinite(x) & (x > 0), x, 1.0)
    mantissa, e = np.frexp(x)  # x = mantissa 2^e, 0.5 <= mantissa < 1
    return np.maximum(e.astype(np.int64) - (mantissa == 0.5), MIN_EXPONENT)


def count_exponent(n: int) -> int:
    """The least ``e >= 0`` with ``n <= 2^e`` for a count ``n >= 0``."""
    return max(int(n) - 1, 0).bit_length()


def grid(bound_exponent, limbs: int) -> np.ndarray:
    """``2^G`` (float64) for sums below ``2^bound_exponent``: ``G = top(limbs) - bound_exponent``,
    kept within float64's normal range (a grid clipped at the top only loses precision on
    values below ``2^-960``; one clipped at the bottom is caught by :func:`add`'s range check)."""
    g = top(limbs) - np.asarray(bound_exponent, dtype=np.int64)
    return np.ldexp(1.0, np.clip(g, -1022, 1000).astype(np.int32))


def zeros(shape, limbs: int, xp=np):
    """An accumulator for values of ``shape (..., C)``: int64 ``(..., limbs * C)``, zero (an
    array of the module ``xp``: NumPy, or CuPy for the GPU's block ops)."""
    shape = tuple(shape)
    return xp.zeros(shape[:-1] + (limbs * shape[-1],), dtype=np.int64)


def value(acc: np.ndarray, limbs: int) -> np.ndarray:
    """The float64 value of an accumulator ``(..., limbs * C)`` on the integer grid (multiply
    by ``1 / 2^G`` for the sum): ``hi 2^30 + lo`` for two words."""
    if limbs == 1:
        return acc.astype(np.float64)
    c = acc.shape[-1] // 2
    return acc[..., :c].astype(np.float64) * LIMB + acc[..., c:].astype(np.float64)


def add_numpy(acc, x, rows=None, cols=None, index=None, bad=None, limbs: int = 1) -> None:
    """``acc[slot] += trunc((x * rows[slot]) * cols)`` on the integer grid, in place: the definition
    of the order-free sums' loop, in NumPy (the compiled loop, ``_ext/fixed.c``, does the same
    IEEE double operations element by element: the same integers;
    :func:`ringmpi.backends.fixed_sums.add` runs whichever is there).

    ``acc`` int64 ``(A, R, limbs * C)`` (contiguous rows, any strides between them: a view of the
    columns of a wider array will do); ``x`` float32/float64 ``(N, R, C)`` C-contiguous (N partials);
    ``rows (A, R)``, ``cols (C,)``: float64 powers of two (the grid, :func:`grid`), or None (1);
    ``index (N,)`` int64 distinct slots of ``acc``, else slot ``n`` when ``A == N`` or slot 0 for
    every partial (``A == 1``: a sum over ``n``); ``bad`` uint8 ``(A, R)``: rows with NaN/Inf or an
    out-of-grid value (which adds nothing) set to 1 (None: ValueError instead).  One word: ``y =
    (x rows) cols`` truncated toward zero, ``|y| < 2^62``; two words (float64): ``hi = trunc(y
    2^-30)``, ``lo = trunc(y - hi 2^30)`` in columns ``c`` and ``C + c``, ``|y| < 2^92``."""
    n, a = x.shape[0], acc.shape[0]
    if index is not None:
        slots = np.asarray(index, dtype=np.int64)
    else:
        if a not in (n, 1):
            raise ValueError("without index, acc must have N slots or one")
        slots = np.arange(n) if a == n else np.zeros(n, dtype=np.int64)
    y = x.astype(np.float64)
    if rows is not None:
        y *= rows[slots][:, :, None]
    if cols is not None:
        y *= cols
    with np.errstate(invalid="ignore"):
        ok = np.abs(y) < limit(limbs)
    if not ok.all():
        row_bad = ~ok.all(axis=2)
        if bad is None:
            raise ValueError(f"{int(row_bad.sum())} row(s) held NaN/Inf or values beyond the fixed-point range")
        np.logical_or.at(bad.view(bool) if bad.dtype == np.uint8 else bad, slots, row_bad)
        y = np.where(ok, y, 0.0)
    if limbs == 1:
        t = y.astype(np.int64)
    else:
        hi = np.trunc(y * (1.0 / LIMB))
        t = np.concatenate([hi.astype(np.int64), (y - hi * LIMB).astype(np.int64)], axis=2)
    if index is not None:
        acc[slots] += t
    elif a == n:
        acc += t
    else:
        acc[0] += t.sum(axis=0)


# ---------------------------------------------------------------- the bounds of attention's sums
# Every bound is a power of two built from exact quantities: counts, and maxima of |x| over
# all ranks (per batch entry and head, MPI.MAX).
def forward_exponents(n_kv: int, vmax, rescale: float):
    """``(e_l, e_o)``: the forward's ``l = sum_j exp(s_j - M)`` (each term <= 1) is at most
    ``2^e_l``; its ``o`` numerator ``sum_j exp(s_j - M) z_j v_jd`` at most ``2^e_o`` with ``vmax
    (..., D_v)`` the largest ``|v|`` per column and ``rescale`` dropout's ``1 / (1 - p)``."""
    e_n = count_exponent(n_kv)
    return e_n, e_n + int(exponent(rescale)) + exponent(vmax)


def row_weight_exponents(dim_v: int, rescale: float, vmax, dorow, dvec):
    """``w`` with ``|dP_ij z_ij - Dv_i| <= 2^w`` for every key: ``dP_ij = do_i . v_j`` is at most
    ``D_v max|do_i| max|v|``, ``Dv_i = rowsum(do_i * o_i)``.  ``vmax``, ``dorow``, ``dvec``
    broadcast together (per row, or per head with the rows' maxima)."""
    lead = count_exponent(dim_v) + int(exponent(rescale)) + exponent(dorow) + exponent(vmax)
    return np.maximum(lead, exponent(dvec)) + 1


def dq_exponents(n_kv: int, w_rows, kmax):
    """``(rows, cols)`` with ``dq_id = sum_j dS_ij k_jd`` below ``2^(rows_i + cols_d)``:
    ``|dS_ij| <= P_ij 2^w_i`` (``w_rows``: :func:`row_weight_exponents`) and ``P`` sums to at most
    2 over each of the ``T_kv = ceil(N_kv / 64)`` key tiles (a tile summing past 2 is poisoned
    instead), so ``|dq_id| <= 2 T_kv 2^w_i kmax_d``."""
    tiles_kv = -(-int(n_kv) // 64)
    return count_exponent(2 * tiles_kv) + np.asarray(w_rows), exponent(kmax)


def kv_exponents(n_q: int, group: int, rescale: float, w_heads, qmax, domax):
    """``(dk, dv)`` bound exponents of a K/V head's gradients, summed over the ``N_q`` rows of its
    ``group`` query heads with ``P <= 2`` each: ``|dk_jd| <= 2 N_q group 2^w qmax_d`` and
    ``|dv_jd| <= 2 N_q group rescale domax_d``.  ``w_heads (...)``: the largest
    :func:`row_weight_exponents` over those rows; ``qmax (..., D)``, ``domax (..., D_v)``: the
    largest ``|q|``, ``|do|`` per column over those heads."""
    e_cnt = count_exponent(2 * int(n_q) * int(group))
    dk = e_cnt + np.asarray(w_heads)[..., None] + exponent(qmax)
    dv = e_cnt + int(exponent(rescale)) + exponent(domax)
    return dk, dv


def inverse_power(e) -> np.ndarray:
    """``2^-e`` (float64), ``e`` kept within the normal range."""
    return np.ldexp(1.0, np.clip(-np.asarray(e, dtype=np.int64), -1022, 1000).astype(np.int32))
