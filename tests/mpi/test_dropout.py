"""Dropout on the attention weights: one mask for every world size, layout and tiling.

In-process: the keep rule (rate, packing, independence from how positions are
split) against ``reference.dropout_factors``, which draws from Philox directly.
Under mpirun (``dropout_cases.py``, one launch per world size): forward and
gradients against the float64 dense reference with the same mask, float64
finite differences, argument errors, and the same results (to float64
rounding) for P = 1, 2, 3 and every layout with one seed, different ones with another.
"""

import itertools

import numpy as np
import pytest

import reference
from mpi_util import CaseLaunches, mpirun_env
from ringmpi.core.dropout import Dropout, validate

LAYOUTS = ("contiguous", "zigzag", "striped")
WORLD_SIZES = (1, 2, 3)
SEEDS = (2024, 7)
# P = 2 runs with small tiles: every block spans several tiles (shifted and exact paths)
ENVS = {2: {"RINGMPI_TILE_Q": 8, "RINGMPI_TILE_KV": 16}}
INVARIANT = dict(B=2, H=4, Hkv=2, D=6, n_q=37, n_kv=41, dtype="float64", causal=True, p=0.3)


# ------------------------------------------------------------ the keep rule, in-process
def test_keep_rate_within_three_sigma():
    p, n = 0.27, 1024
    keep = Dropout(p=p, seed=99, heads=1).keep(0, 0, np.arange(n), np.arange(n))
    sigma = np.sqrt(p * (1 - p) / keep.size)
    assert abs(keep.mean() - (1 - p)) < 3 * sigma


def test_keep_matches_reference_factors():
    d = Dropout(p=0.4, seed=(5 << 32) + 11, heads=3)
    ref = reference.dropout_factors(d.seed, d.p, 2, 3, 9, 14)
    for b, h in itertools.product(range(2), range(3)):
        got = d.multiplier(b, h, np.arange(9), np.arange(14), np.float64)
        np.testing.assert_array_equal(got, ref[b, h])


def test_keep_is_a_function_of_positions_only():
    d = Dropout(p=0.5, seed=3, heads=2)
    full = d.keep(1, 1, np.arange(50), np.arange(60))
    rng = np.random.default_rng(0)
    qi, kj = rng.permutation(50)[:17], rng.permutation(60)[:23]
    np.testing.assert_array_equal(d.keep(1, 1, qi, kj), full[np.ix_(qi, kj)])
    # the file job's slice (batch 1, heads 1.. of 2) draws the whole tensor's mask
    sliced = Dropout(p=0.5, seed=3, heads=2, batch_offset=1, head_offset=1)
    np.testing.assert_array_equal(sliced.keep(0, 0, np.arange(50), np.arange(60)), full)


def test_keep_uses_every_word():
    d = Dropout(p=0.5, seed=1, heads=4)
    base = d.keep(0, 0, np.arange(64), np.arange(64))
    high = 1 << 33  # positions beyond 2^32 draw their own mask
    others = [d.keep(0, 1, np.arange(64), np.arange(64)), d.keep(1, 0, np.arange(64), np.arange(64)),
              d.keep(0, 0, np.arange(64) + high, np.arange(64)), d.keep(0, 0, np.arange(64), np.arange(64) + high),
              Dropout(p=0.5, seed=1 + (1 << 32), heads=4).keep(0, 0, np.arange(64), np.arange(64))]
    for other in others:
        assert 0.3 < np.mean(other != base) < 0.7


def test_threshold_and_rescale():
    assert Dropout(p=0.25, seed=0, heads=1).threshold == 1 << 30
    assert Dropout(p=0.25, seed=0, heads=1).rescale(np.float32) == np.float32(4 / 3)
    tiny = Dropout(p=2.0 ** -40, seed=0, heads=1)
    assert tiny.threshold == 1 and tiny.keep(0, 0, np.arange(200), np.arange(200)).all()


@pytest.mark.parametrize("p, seed, want", [
    (0.0, None, None), (0.1, 5, None), (1.0, 5, "[0, 1)"), (-0.5, 5, "[0, 1)"), (0.1, None, "needs a dropout_seed"),
    (0.1, 2 ** 64, "[0, 2^64)"), (0.1, True, "must be an int"), ("x", 1, "a number"),
])
def test_validate(p, seed, want):
    got = validate(p, seed)
    assert (got is None) if want is None else (want in got)


# ------------------------------------------------------------ under mpirun
def cases_for(p):
    cases = []
    for layout, seed in itertools.product(LAYOUTS, SEEDS):
        cases.append(dict(INVARIANT, id=f"P{p}-inv-{layout}-s{seed}", layout=layout, seed=5,
                          dropout_seed=seed, save=f"inv-P{p}-{layout}-{seed}.npz"))
    for i, layout in enumerate(LAYOUTS):
        common = dict(id="", layout=layout, seed=100 * p + i, dropout_seed=31 + i, p=0.2)
        cases += [
            dict(common, id=f"P{p}-f32-gqa-{layout}", B=1, H=4, Hkv=1, D=16, n_q=64, dtype="float32"),
            dict(common, id=f"P{p}-f32-window-seg-{layout}", B=2, H=2, Hkv=2, D=8, n_q=50, dtype="float32",
                 causal=True, window=[9, 0], segments=3),
            dict(common, id=f"P{p}-f16-causal-{layout}", B=1, H=2, Hkv=2, D=8, n_q=40, n_kv=45,
                 dtype="float16", causal=True, p=0.5),
            dict(common, id=f"P{p}-fd-{layout}", kind="fd", B=1, H=2, Hkv=1, D=5, n_q=11, n_kv=13,
                 causal=True, p=0.4),
        ]
    cases.append(dict(id=f"P{p}-errors", kind="errors", B=1, H=2, Hkv=2, D=4, n_q=10, layout="zigzag"))
    cases.append(dict(id=f"P{p}-torch", kind="torch", B=1, H=2, Hkv=1, D=4, n_q=19, layout="zigzag",
                      causal=True, p=0.3, dropout_seed=77))
    return cases


DROPOUT = CaseLaunches("dropout_cases.py", WORLD_SIZES, cases_for, timeout=300,
                       env=lambda p: mpirun_env(**ENVS[p]) if p in ENVS else None)
results = DROPOUT.fixture()


@pytest.mark.mpi
@pytest.mark.parametrize("p, case", DROPOUT.params())
def test_dropout_case(results, p, case):
    ok, msg = results(p)[case["id"]]
    assert ok, msg


@pytest.mark.mpi
def test_same_mask_for_every_world_size_and_layout(results):
    runs = {(p, layout, seed): dict(np.load(results.where(p) / f"inv-P{p}-{layout}-{seed}.npz"))
            for p in WORLD_SIZES for layout in LAYOUTS for seed in SEEDS}
    base = runs[(1, "contiguous", SEEDS[0])]
    for (p, layout, seed), got in runs.items():
        for name, x in got.items():
            if seed == SEEDS[0] or name == "lse":  # lse is the one without dropout
                np.testing.assert_allclose(x, base[name], rtol=1e-12, atol=1e-13,
                                           err_msg=f"{name} at P={p} {layout} differs from P=1 contiguous")
            else:
                assert np.max(np.abs(x - base[name])) > 1e-2, f"{name}: seed {seed} gives seed {SEEDS[0]}'s result"


def test_nonfinite_row_leaves_the_others_bitwise():
    """The careful (NaN/Inf) path applies the same mask: other rows are bitwise a clean run's."""
    from ringmpi.backends.numpy_backend import NumpyBackend
    from ringmpi.core.masks import BlockMask, ScoreSpec

    be, rng = NumpyBackend(), np.random.default_rng(4)
    q = rng.standard_normal((1, 2, 40, 8))
    k, v, do = rng.standard_normal((1, 1, 30, 8)), rng.standard_normal((1, 1, 30, 8)), rng.standard_normal(q.shape)
    mask = BlockMask(ScoreSpec(causal=True, offset=-10, dropout=Dropout(p=0.3, seed=5, heads=2)),
                     np.arange(40), np.arange(30))
    runs = []
    for bad in (False, True):
        qq = q.copy()
        if bad:
            qq[0, 1, 25, 3] = np.nan
        o, m, l = np.zeros_like(q), np.full(q.shape[:3], -np.inf), np.zeros(q.shape[:3])
        with np.errstate(invalid="ignore"):
            be.forward_block(qq, k, v, o, m, l, 0.5, mask)
            out, lse = be.finalize(o, m, l, np.float64)
            oh = np.ascontiguousarray(out.transpose(0, 2, 1, 3))
            dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
            be.backward_block(qq, do, lse, be.row_dot(do, oh), k, v, dq, dk, dv, 0.5, mask)
        runs.append((oh, lse, dq))
    (o0, lse0, dq0), (o1, lse1, dq1) = runs
    assert np.isnan(o1[0, 1, 25]).all() and np.isnan(lse1[0, 1, 25])
    keep = np.ones(o0.shape[:3], dtype=bool)
    keep[0, 1, 25] = False
    np.testing.assert_array_equal(o1[keep], o0[keep])
    np.testing.assert_array_equal(lse1[keep], lse0[keep])
    np.testing.assert_array_equal(dq1[keep], dq0[keep])
