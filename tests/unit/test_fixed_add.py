"""The compiled loop of the order-free sums (``ringmpi._ext._fixed.add``) against its definition,
:func:`ringmpi.core.fixed_point.add_numpy`, on every vector path this CPU runs: the same int64
words and the same ``bad`` flags, bit for bit, over random inputs that reach every corner of the
loop -- one and two words, float32/float64 partials, rows/cols given or not, an index, a sum
over the partials (one slot), ``bad`` given or not (then a ValueError where a row held NaN/Inf or
a value beyond the grid), NaN, +-Inf, values at and just past the grid's limits (2^62, 2^92) on
both sides, negative values (truncation toward zero), subnormals, accumulators that wrap, and
accumulators that are views (strides between their rows and slots)."""

import os
import subprocess
import sys

import numpy as np
import pytest

from ringmpi.core.fixed_point import add_numpy

try:
    from ringmpi._ext import _fixed
except ImportError:
    _fixed = None

PATHS = tuple(_fixed.paths()) if _fixed is not None else ("not built",)


@pytest.fixture(params=PATHS)
def path(request):
    if _fixed is None:
        pytest.skip("ringmpi._ext._fixed was not built")
    before = _fixed.path()
    _fixed.use(request.param)
    assert _fixed.path() == request.param
    yield request.param
    _fixed.use(before)


def _limit(limbs):
    return 2.0 ** (62 if limbs == 1 else 92)


def _values(rng, shape, dtype, limbs, scale):
    """Partials ``x`` (shape, dtype) whose scaled values ``y = x * scale`` (scale broadcast, the
    rows' and columns' factors) fall in every region the loop tells apart."""
    lim = _limit(limbs)
    y = rng.standard_normal(shape) * np.ldexp(1.0, rng.integers(-8, 64 if limbs == 1 else 94, shape))
    pick = rng.random(shape)
    near = lim * (1.0 + rng.choice([-2.0 ** -52, -2.0 ** -40, -2.0 ** -24, -2.0 ** -23, 0.0, 2.0 ** -52,
                                    2.0 ** -24, 2.0 ** -20], size=shape))
    near *= rng.choice([-1.0, 1.0], size=shape)
    y = np.where(pick < 0.08, near, y)                                  # at and around the limit
    frac = rng.integers(-2 ** 40, 2 ** 40, shape) + rng.choice([0.25, 0.5, 0.75, 0.999], size=shape)
    y = np.where((pick >= 0.08) & (pick < 0.16), frac, y)              # fractions, both signs
    y = np.where((pick >= 0.16) & (pick < 0.2), rng.uniform(-1.5, 1.5, shape), y)  # |y| around 1
    if limbs == 2:  # around multiples of 2^30 (the split between the words)
        k = rng.integers(-2 ** 40, 2 ** 40, shape) * 2.0 ** 30 + rng.choice([-1.0, -0.5, 0.0, 0.5, 1.0], size=shape)
        y = np.where((pick >= 0.2) & (pick < 0.26), k, y)
    with np.errstate(all="ignore"):
        x = (y / scale).astype(dtype)
    special = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 2.0 ** 63, -2.0 ** 64, 2.0 ** 100, -2.0 ** 93,
                        np.finfo(dtype).smallest_subnormal, -np.finfo(dtype).smallest_subnormal * 3,
                        np.finfo(dtype).max, -np.finfo(dtype).tiny], dtype=dtype)
    sp = rng.random(shape) < 0.04
    x[sp] = rng.choice(special, size=int(sp.sum()))
    return x


def _powers(rng, shape, extreme):
    """Powers of two, as the grids are; some extreme (overflow and underflow on the way)."""
    e = rng.integers(-4, 5, shape)
    if extreme:
        e = np.where(rng.random(shape) < 0.15, rng.choice([-1022, -1000, -600, 600, 1000], size=shape), e)
    return np.ldexp(1.0, e)


def _accumulator(rng, A, R, width, wrap):
    """An int64 (A, R, width) accumulator, random (near the int64 limits where ``wrap``), as a view
    with strides between its rows and between its slots (or plain)."""
    kind = rng.integers(0, 4)
    if kind == 0:
        base = np.empty((A, R, width), np.int64)
        acc = base
    elif kind == 1:  # some columns of a wider array
        base = np.empty((A, R, width + 5), np.int64)
        acc = base[:, :, 2:2 + width]
    elif kind == 2:  # every other slot, some columns
        base = np.empty((2 * A, R, width + 3), np.int64)
        acc = base[::2, :, 3:3 + width]
    else:  # slots inside rows (slot stride < row stride)
        base = np.empty((R, A, width + 1), np.int64)
        acc = base.transpose(1, 0, 2)[:, :, 1:1 + width]
    big = 2 ** 63 - 2 ** 20 if wrap else 2 ** 50
    base[...] = rng.integers(-big, big, base.shape, dtype=np.int64)
    return base, acc


WIDTHS = (0, 1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 24, 31, 32, 33, 40, 63, 64, 65, 100)


def _case(rng, limbs, dtype, C, has_rows, has_cols, slots, with_bad, extreme):
    N = int(rng.integers(1, 6)) if slots != "one slot, one partial" else 1
    R = int(rng.integers(1, 5))
    if slots == "index":
        A = N + int(rng.integers(0, 3))
        index = rng.permutation(A)[:N].astype(np.int64)
    elif slots == "one slot, one partial":
        A, index = 1, np.zeros(1, np.int64)
    elif slots == "slot per partial":
        A, index = N, None
    else:  # "one slot": the sum over n
        A, index = 1, None
    slot_of = index if index is not None else (np.arange(N) if A == N else np.zeros(N, np.int64))
    rows = _powers(rng, (A, R), extreme) if has_rows else None
    cols = _powers(rng, (C,), extreme) if has_cols else None
    scale = np.ones((N, R, C))
    if rows is not None:
        scale = scale * rows[slot_of][:, :, None]
    if cols is not None:
        scale = scale * cols
    x = _values(rng, (N, R, C), dtype, limbs, scale)
    if rng.random() < 0.3:  # clean rows: nothing flagged
        x = np.where(np.isfinite(x.astype(np.float64) * scale) & (np.abs(x * scale) < _limit(limbs) / 2), x, 1)
        x = x.astype(dtype)
    base, acc = _accumulator(rng, A, R, limbs * C, wrap=rng.random() < 0.3)
    bad = None
    if with_bad:
        bad = (rng.random((A, R)) < 0.2).astype(rng.choice([np.uint8, np.bool_]))
    return dict(base=base, acc=acc, x=x, rows=rows, cols=cols, index=index, bad=bad, limbs=limbs)


def _run(add, case):
    """(the accumulator's whole base array after ``add``, bad after), or the ValueError's message."""
    base = case["base"].copy()  # the same view of a copy of the base
    offset = case["acc"].__array_interface__["data"][0] - case["base"].__array_interface__["data"][0]
    acc = np.ndarray(case["acc"].shape, np.int64, buffer=base, offset=offset, strides=case["acc"].strides)
    bad = None if case["bad"] is None else case["bad"].copy()
    try:
        with np.errstate(all="ignore"):  # add_numpy's products overflow where the inputs are extreme
            add(acc, case["x"], case["rows"], case["cols"], case["index"], bad, case["limbs"])
    except ValueError as e:
        return f"ValueError: {e}", None  # its message counts the rows flagged
    return base, bad


def _same(case):
    want, want_bad = _run(add_numpy, case)
    got, got_bad = _run(_fixed.add, case)
    if isinstance(want, str) or isinstance(got, str):
        assert want == got
        return
    assert got.dtype == np.int64 and np.array_equal(got, want)
    if want_bad is not None:
        assert np.array_equal(got_bad, want_bad)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("limbs,dtype", [(1, np.float32), (1, np.float64), (2, np.float32), (2, np.float64)])
def test_compiled_add_gives_add_numpy_bits(path, limbs, dtype):
    rng = np.random.default_rng([limbs, np.dtype(dtype).itemsize, len(path)])
    cases = 0
    for slots in ("index", "slot per partial", "one slot", "one slot, one partial"):
        for has_rows in (False, True):
            for has_cols in (False, True):
                for with_bad in (True, False):
                    for C in WIDTHS:
                        extreme = bool(rng.random() < 0.25)
                        _same(_case(rng, limbs, dtype, C, has_rows, has_cols, slots, with_bad, extreme))
                        cases += 1
    assert cases == 4 * 2 * 2 * 2 * len(WIDTHS)


@pytest.mark.parametrize("limbs,dtype", [(1, np.float32), (2, np.float64)])
def test_compiled_add_on_the_invariant_modes_shapes(path, limbs, dtype):
    """The shapes of the backward: dq (an index into query tiles, rows and cols given) and dk/dv
    (a sum over 16 partials into one slot, cols only), a few elements flagged."""
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((16, 64, 64)) * 2.0 ** rng.integers(0, 20, (16, 64, 64))).astype(dtype)
    x[3, 5, 17] = np.nan
    x[9, 60, 63] = -np.inf
    x[11, 2, 0] = 2.0 ** 120
    cols = np.ldexp(1.0, rng.integers(20, 40, 64))
    rows = np.ldexp(1.0, rng.integers(-3, 2, (24, 64)))
    index = rng.permutation(24)[:16].astype(np.int64)
    for acc_shape, r, idx in (((24, 64, 64 * limbs), rows, index), ((1, 64, 64 * limbs), None, None)):
        base = rng.integers(-2 ** 60, 2 ** 60, acc_shape, dtype=np.int64)
        case = dict(base=base, acc=base, x=x, rows=r, cols=cols, index=idx,
                    bad=np.zeros(acc_shape[:2], np.uint8), limbs=limbs)
        _same(case)
        case["bad"] = None
        _same(case)  # a ValueError from both


def test_compiled_add_checks_its_arguments(path):
    x = np.ones((2, 3, 4), np.float32)
    with pytest.raises(ValueError):
        _fixed.add(np.zeros((2, 3, 4), np.int64), x, None, None, None, None, 3)
    with pytest.raises(ValueError):
        _fixed.add(np.zeros((2, 3, 5), np.int64), x, None, None, None, None, 1)
    with pytest.raises(ValueError):
        _fixed.add(np.zeros((3, 3, 4), np.int64), x, None, None, None, None, 1)
    with pytest.raises(ValueError):
        _fixed.add(np.zeros((2, 3, 4), np.int64), x, None, None, np.array([0, 2]), None, 1)
    with pytest.raises(ValueError):
        _fixed.add(np.zeros((2, 3, 8), np.int64)[:, :, ::2], x, None, None, None, None, 1)


@pytest.mark.skipif(_fixed is None, reason="ringmpi._ext._fixed was not built")
def test_ringmpi_cpu_vector_pins_the_path():
    code = "from ringmpi._ext import _fixed; print(_fixed.path())"
    for name in _fixed.paths():
        env = dict(os.environ, RINGMPI_CPU_VECTOR=name)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == name
    env = dict(os.environ, RINGMPI_CPU_VECTOR="sse9")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode != 0 and "ValueError" in out.stderr
    with pytest.raises(ValueError):
        _fixed.use("sse9")
    from ringmpi.backends import fixed_sums

    assert fixed_sums.vector_path() == _fixed.path()


@pytest.mark.skipif(_fixed is None, reason="ringmpi._ext._fixed was not built")
def test_compiled_loop_takes_the_split_from_fixed_split():
    """The built module's split (its -D defines, from setup.py) is ``core.fixed_split``'s: a build
    older than a change there fails here, not in the bits."""
    from ringmpi.core import fixed_point, fixed_split

    assert _fixed.constants() == {**fixed_split.constants(), "FIXED_LIMB_BITS": fixed_split.LIMB_BITS}
    assert fixed_split.constants()["FIXED_LIMIT_1"] == _limit(1) and fixed_split.constants()["FIXED_LIMIT_2"] == _limit(2)
    assert (fixed_point.TOP, fixed_point.LIMB_BITS) == (fixed_split.TOP, fixed_split.LIMB_BITS) == (61, 30)
