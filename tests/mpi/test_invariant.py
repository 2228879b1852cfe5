"""invariant=True (issue 37): the same bits for every number of ranks, layout and head x ring.

The bitwise matrix: one launch of ``invariant_cases.py`` per world size P = 1, 2, 3, 4, 6, 8
runs every case under every placement that applies there (layouts whose shards are whole
64-token tiles, a random placement of whole tiles by explicit positions, head x ring U = 2);
each placement reports one sha256 per output array (``o, lse, max_logit, dq, dk, dv, dsinks``)
and every one must equal every other, across placements and launches.  The P = 1 launch also
holds each case to the float64 dense reference under the tolerance rule.  The cases cover GQA
and MQA, causal, window, segments, sinks, softcap, ALiBi, dropout, N_q != N_kv, short last
tiles, the four dtypes, NaN/Inf inputs, decode_attention, ringmpi.torch and ``ringmpi run``.

In process: the fixed-point sums (compiled and NumPy loops alike, exact, in any order, bad
values flagged), tiles in global positions, and the BLAS property the mode rests on: a tile
pair's products are the same bits whatever else shares the stacked GEMM call.
"""

import itertools
import json
import os

import numpy as np
import pytest

from mpi_util import launch_cache, run_cases

# test_vector_paths reruns this file under each pinned vector path with P = 1, 2, 3 only
# (RINGMPI_TEST_INVARIANT_SIZES): what differs between the paths is each tile's arithmetic,
# which those launches already run under every placement; the wider world sizes add ring
# placements, not arithmetic, and run once, on the path this CPU picks
WORLD_SIZES = tuple(int(p) for p in os.environ.get("RINGMPI_TEST_INVARIANT_SIZES", "1,2,3,4,6,8").split(","))


def cases_for(p):
    cases, spin = [], itertools.count()

    def add(name, **kw):
        case = dict(id=f"{name}", B=1, H=2, Hkv=1, D=8, dtype="float32", seed=3700 + next(spin), check=p == 1)
        case.update(kw)
        cases.append(case)

    # every layout applies at every P: N = 3072 is whole tiles for contiguous and zigzag shards
    # (its accuracy is the smaller cases': no dense reference of this size)
    add("layouts-causal-gqa", n_q=3072, causal=True, sinks=True, decode=3, check=False)
    add("options-mqa-float16", n_q=640, n_kv=768, B=2, H=4, Hkv=1, window=[300, 40], segments=3,
        softcap=3.0, k_scale=2.0, alibi=True, sinks=True, dtype="float16", torch=(2,))
    add("dropout-bfloat16", n_q=512, causal=True, dropout=0.25, dropout_seed=4242, sinks=True, dtype="bfloat16")
    add("float64-cross", n_q=704, n_kv=600, H=4, Hkv=2, window=[200, 50], softcap=2.0, alibi=True, sinks=True,
        dtype="float64", sink_dtype="float64", causal=True)
    add("short-tiles-gqa", n_q=1000, H=4, Hkv=2, D=5, causal=True, window=[300, 0], decode=70, softcap=5.0)
    add("nonfinite", n_q=768, H=2, Hkv=1, causal=True, window=[150, 0],
        nonfinite=dict(q=[[0, 70, 1, 3, float("nan")]], k=[[0, 300, 0, 2, float("inf")]],
                       v=[[0, 600, 0, 5, float("nan")]]))
    add("file-job", n_q=512, H=2, Hkv=1, causal=True, sinks=True, file=True)  # contiguous at P = 1, 2, 4, 8
    if p > 1:
        add("errors", kind="errors", n_q=200 * p)
    return cases


def launches_of(cases_at, tmp_path_factory, name: str):
    """Per world size P, one launch of ``invariant_cases.py`` with ``cases_at(P)`` (cached)."""
    def launch(p):
        tmp = tmp_path_factory.mktemp(f"{name}{p}")
        return run_cases(p, [dict(c, dir=str(tmp)) for c in cases_at(p)], tmp, timeout=600,
                         driver="invariant_cases.py")
    return launch_cache(launch)


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    return launches_of(cases_for, tmp_path_factory, "invariant")


def _hashes(launches, p, case_id):
    ok, msg = launches(p)[case_id]
    assert ok, f"P={p}: {msg}"
    return json.loads(msg)["hashes"]


MATRIX = [c["id"] for c in cases_for(2) if c.get("kind") != "errors"]


@pytest.mark.mpi
@pytest.mark.parametrize("case_id", MATRIX)
def test_same_bits_for_every_P_layout_and_head_parallel(launches, case_id):
    """One sha256 per output array, equal across every placement at P = 1, 2, 3, 4, 6, 8."""
    seen = {}
    for p in WORLD_SIZES:
        for placement, hashes in _hashes(launches, p, case_id).items():
            seen[f"P{p}:{placement}"] = hashes
    reference = next(iter(seen.values()))
    differ = {where: sorted(k for k in reference if hashes.get(k) != reference[k])
              for where, hashes in seen.items() if hashes != reference}
    assert not differ, f"{case_id}: outputs differ from {next(iter(seen))}: {differ}"
    layouts = {w.split(":")[1] for w in seen}
    assert {"contiguous", "tiles", "tiles-U2"} <= layouts, layouts
    if case_id == "layouts-causal-gqa":  # every layout at every P (at P = 1 they are one placement)
        for p in WORLD_SIZES[1:]:
            assert {"contiguous", "zigzag"} <= {w.split(":")[1] for w in seen if w.startswith(f"P{p}:")}, p


@pytest.mark.mpi
@pytest.mark.parametrize("p", WORLD_SIZES[1:])
def test_a_shard_of_partial_tiles_is_one_error_on_every_rank(launches, p):
    ok, msg = launches(p)["errors"]
    assert ok, msg


# ---------------------------------------------------------------- in process: the fixed-point sums
def _both(fn):
    """``fn(add)`` with the compiled loop (where built) and with the NumPy one: the same integers
    expected."""
    from ringmpi.backends import fixed_sums
    from ringmpi.core import fixed_point as fx

    return fn(fixed_sums.add), fn(fx.add_numpy)


@pytest.mark.parametrize("limbs,dtype", [(1, np.float32), (1, np.float64), (2, np.float32), (2, np.float64)])
def test_fixed_point_sums_are_exact_in_any_order_on_both_loops(limbs, dtype):
    from ringmpi.core import fixed_point as fx

    rng = np.random.default_rng(limbs)
    n, rows, cols = 9, 5, 7
    x = (rng.standard_normal((n, rows, cols)) * 2.0 ** rng.integers(-30, 30, (n, rows, cols))).astype(dtype)
    grid = fx.grid(fx.exponent(np.abs(x.astype(np.float64)).max(axis=(0, 1))) + fx.count_exponent(n), limbs)
    row_grid = np.ldexp(1.0, rng.integers(-3, 3, (1, rows)))

    def total(add, order):
        acc = fx.zeros((1, rows, cols), limbs)
        for i in order:
            add(acc, np.ascontiguousarray(x[i:i + 1]), rows=row_grid, cols=grid, limbs=limbs)
        return acc

    compiled, plain = _both(lambda add: total(add, range(n)))
    assert np.array_equal(compiled, plain)
    for order in (range(n)[::-1], rng.permutation(n)):
        assert np.array_equal(total(fx.add_numpy, order), compiled)
    once = fx.zeros((1, rows, cols), limbs)
    fx.add_numpy(once, x, rows=row_grid, cols=grid, limbs=limbs)  # all n partials in one call
    assert np.array_equal(once, compiled)
    # exact: the integers are the truncated partials, summed as Python integers
    scaled = [[[int(float(x[i, r, c]) * row_grid[0, r] * grid[c]) for c in range(cols)] for r in range(rows)]
              for i in range(n)]
    want = [[sum(scaled[i][r][c] for i in range(n)) for c in range(cols)] for r in range(rows)]
    words = compiled[0].astype(object)
    got = words if limbs == 1 else words[:, :cols] * 2 ** fx.LIMB_BITS + words[:, cols:]
    assert got.tolist() == want


def test_fixed_point_rows_with_nan_or_beyond_the_grid_add_nothing_and_are_flagged():
    from ringmpi.backends import fixed_sums
    from ringmpi.core import fixed_point as fx

    x = np.ones((3, 4, 2), dtype=np.float32)
    x[1, 2, 0] = np.nan
    x[2, 3, 1] = 2.0 ** 70
    index = np.array([2, 0, 1], dtype=np.int64)

    def run(add):
        acc = fx.zeros((3, 4, 2), 1)
        bad = np.zeros((3, 4), np.uint8)
        add(acc, x, index=index, bad=bad)
        wide = np.zeros((3, 4, 5), np.int64)  # into a view of some columns of a wider array
        add(wide[:, :, 1:3], x, index=index, bad=bad)
        return acc, bad, wide

    (acc, bad, wide), (acc2, bad2, wide2) = _both(run)
    assert np.array_equal(acc, acc2) and np.array_equal(bad, bad2) and np.array_equal(wide, wide2)
    assert bad[0, 2] == 1 and bad[1, 3] == 1 and bad.sum() == 2
    assert acc[0, 2, 0] == 0 and acc[0, 2, 1] == 1 and acc[2].sum() == 8
    assert np.array_equal(wide[..., 1:3], acc) and not wide[..., [0, 3, 4]].any()
    for add in (fixed_sums.add, fx.add_numpy):
        with pytest.raises(ValueError):
            add(fx.zeros((1, 4, 2), 1), x)


def test_the_forward_grid_bounds_float32_error_at_a_million_keys():
    """At N = 2^20 keys (16384 key tiles), one int64 word: the truncation of every tile's row
    sum costs at most 2^-27 of ``l`` (l >= 1), and of the ``o`` numerator 2^-27 of max |v|
    (with dropout at p = 0.5, 2^-26) -- below float32's own rounding of one value (up to 2^-24)."""
    from ringmpi.core import fixed_point as fx

    n = 1 << 20
    tiles = n // 64
    e_l, e_o = fx.forward_exponents(n, np.array([1.0, 0.75]), 1.0)
    assert tiles * 2.0 ** -(fx.top(1) - e_l) <= 2.0 ** -27
    assert (tiles * 2.0 ** -(fx.top(1) - e_o) <= 2.0 ** -27).all()
    assert tiles * 2.0 ** -(fx.top(1) - int(fx.forward_exponents(n, np.array([1.0]), 2.0)[1][0])) <= 2.0 ** -26
    assert tiles * 2.0 ** -(fx.top(2) - e_l) <= 2.0 ** -57  # float64: two words


# ---------------------------------------------------------------- in process: tiles in global positions
def test_whole_tiles_per_shard():
    from ringmpi import Layout
    from ringmpi.core.global_tiles import Tiling, shard_problem

    for kind, n, p, whole in (("contiguous", 3072, 6, True), ("zigzag", 3072, 8, True), ("zigzag", 1024, 3, False),
                              ("contiguous", 1000, 1, True), ("striped", 256, 2, False), ("striped", 256, 1, True)):
        lay = Layout(kind, n, p)
        found = [shard_problem("query", lay.indices(r), n) for r in range(p)]
        assert all(f is None for f in found) == whole, (kind, n, p, found)
    assert "tile 1 (64 .. 127)" in shard_problem("query", np.arange(100), 1000)
    rng = np.random.default_rng(5)
    pos = rng.permutation(np.concatenate([np.arange(128, 192), np.arange(960, 1000), np.arange(0, 64)]))
    tiling = Tiling.of(pos)
    assert tiling.tiles.tolist() == [0, 2, 15] and tiling.valid.sum() == len(pos) and not tiling.sorted
    x = rng.standard_normal((2, len(pos), 3))
    tiled = tiling.to_tiles(x, axis=1)
    assert tiled.shape == (2, 3, 64, 3) and tiled.ctypes.data % 64 == 0
    assert np.array_equal(tiled[:, 2, :40], x[:, np.argsort(pos)][:, 128:]) and not tiled[:, 2, 40:].any()
    assert np.array_equal(tiling.from_tiles(tiled, axis=1), x)
    decode = Tiling.of(np.array([1021, 1022, 1023, 1024]))  # a decode step's rows: their slots of their tiles
    assert decode.tiles.tolist() == [15, 16] and np.flatnonzero(decode.valid[0]).tolist() == [61, 62, 63]
    assert np.flatnonzero(decode.valid[1]).tolist() == [0]


def test_a_pair_is_the_same_bits_whatever_shares_its_gemm_call():
    """The stacked GEMMs call BLAS once per 64 x 64 pair with the same shape and strides; a pair's
    products do not depend on the stack's length, its place in it, or which operand is shared
    (the forward stacks key tiles against one query tile, the backward query tiles against one
    key tile), nor on a query row's neighbours (decode's zero rows)."""
    from ringmpi.core.global_tiles import aligned

    rng = np.random.default_rng(11)
    for dim in (5, 64, 128):
        q = aligned((6, 64, dim), np.float32)
        k = aligned((6, 64, dim), np.float32)
        q[...] = rng.standard_normal(q.shape)
        k[...] = rng.standard_normal(k.shape)
        alone = np.matmul(q[2][None], k[3:4].swapaxes(1, 2))[0]
        for lo, hi in ((0, 6), (3, 5), (1, 4)):
            s = np.matmul(q[2][None], k[lo:hi].swapaxes(1, 2))
            assert s[3 - lo].tobytes() == alone.tobytes(), (dim, lo, hi)
            s = np.matmul(q[lo:hi], k[3].T)
            if lo <= 2 < hi:
                assert s[2 - lo].tobytes() == alone.tobytes(), (dim, lo, hi)
        one_row = aligned((1, 64, dim), np.float32, fill=0)
        one_row[0, 17] = q[2, 17]
        assert np.matmul(one_row, k[3:4].swapaxes(1, 2))[0, 17].tobytes() == alone[17].tobytes()
        p = np.exp(alone - alone.max()).astype(np.float32)
        pv = np.matmul(p[None], k[3:4])[0]
        stack = aligned((4, 64, 64), np.float32)
        stack[...] = p
        assert np.matmul(stack, k[2:6])[1].tobytes() == pv.tobytes()


@pytest.mark.parametrize("path", ["avx512", "avx2", "plain"])
def test_a_pair_is_the_same_bits_whatever_shares_its_compiled_call(path):
    """Where float32 pairs take the compiled block op's Q K^T (``_fused.scores_packed``, each score
    one chain of fused multiply-adds over d), a pair's scores do not depend on the stack's length,
    its place in it, which operand is shared, or a row's neighbours; they are the bits
    ``_fused.scores`` gives the default backward, ``_fused.scores_max`` their rows' maxima, and
    ``_fused.pair_forward`` (the second pass fused) the scores, exp pass and products in turn, and
    ``_fused.pair_backward`` the backward's steps in turn."""
    from ringmpi.backends import invariant_tiles as it
    from ringmpi.backends import tile_pass

    if tile_pass.compiled is None or path not in tile_pass.compiled.paths():
        pytest.skip(f"no compiled {path} path here")
    before = tile_pass.compiled.path()
    tile_pass.compiled.use(path)
    if not tile_pass.compiled.has_block():
        tile_pass.compiled.use(before)
        pytest.skip(f"the {path} path has no compiled block op on this CPU")
    try:
        res = type("R", (), {"products": tile_pass.compiled})()
        rng = np.random.default_rng(12)
        for dim in (5, 64, 128):
            q = rng.standard_normal((6, 64, dim)).astype(np.float32)
            k = rng.standard_normal((6, 64, dim)).astype(np.float32)
            alone = np.empty((64, 64), np.float32)
            tile_pass.compiled.scores(q[2], k[3], alone)
            kp = it._packed(k, {}, "k")
            for lo, hi in ((0, 6), (3, 5), (1, 4)):
                s = np.empty((hi - lo, 64, 64), np.float32)
                it._pair_scores(res, q[2], kp[lo:hi], s)  # one query tile against a stack of key tiles
                assert s[3 - lo].tobytes() == alone.tobytes(), (path, dim, lo, hi)
                it._stack_scores(res, q[lo:hi], kp[3], s)  # a stack of query tiles against one key tile
                if lo <= 2 < hi:
                    assert s[2 - lo].tobytes() == alone.tobytes(), (path, dim, lo, hi)
            one_row = np.zeros((1, 64, dim), np.float32)
            one_row[0, 17] = q[2, 17]
            s = np.empty((1, 64, 64), np.float32)
            it._stack_scores(res, one_row, kp[3], s)
            assert s[0, 17].tobytes() == alone[17].tobytes()
            assert np.abs(alone - q[2].astype(np.float64) @ k[3].T.astype(np.float64)).max() < 1e-4 * dim
            # the first pass's maxima, none stored: the maxima of those very scores
            s = np.empty((6, 64, 64), np.float32)
            it._pair_scores(res, q[2], kp, s)
            row_max = np.empty(64, np.float32)
            tile_pass.compiled.scores_max(q[2], kp.reshape(-1, it.PANEL), row_max)
            assert row_max.tobytes() == s.max(axis=0).max(axis=1).tobytes()
            # the second pass fused: bit for bit the scores, the exp pass and the products in turn
            v = rng.standard_normal((6, 64, 24)).astype(np.float32)
            shift = s.max(axis=0).max(axis=1) * np.float32(0.5)
            sums = np.empty(6 * 64, np.float32)
            tile_pass.compiled.exp_tile(s.reshape(-1, 64), np.float32(0.5), None, np.tile(shift, 6), sums)
            pv = np.empty((6, 64, 24), np.float32)
            it._pair_products(res, s, v, pv)
            fused_pv, fused_sums = np.empty_like(pv), np.empty_like(sums)
            tile_pass.compiled.pair_forward(q[2], kp.reshape(-1, it.PANEL), v.reshape(-1, 24), shift, 0.5,
                                            fused_pv.reshape(-1, 24), fused_sums)
            assert fused_pv.tobytes() == pv.tobytes() and fused_sums.tobytes() == sums.tobytes()
            # the backward fused: query tiles 0..5 against key tile 3, as its steps in turn
            do = rng.standard_normal((6, 64, 24)).astype(np.float32)
            lse = (s.max(axis=2) * np.float32(0.5) + 1).astype(np.float32).reshape(-1)
            dvec = rng.standard_normal(6 * 64).astype(np.float32)
            p = np.empty((6, 64, 64), np.float32)
            it._stack_scores(res, q, kp[3], p)
            p_sums = np.empty(6 * 64, np.float32)
            tile_pass.compiled.exp_tile(p.reshape(-1, 64), np.float32(0.5), None, lse, p_sums)
            dv_t = np.empty((6, 64, 24), np.float32)
            it._pair_products(res, p, do, dv_t, trans=True)
            vp = it._packed(v[3:4], {}, "v")
            dp = np.empty((6, 64, 64), np.float32)
            it._stack_scores(res, do, vp[0], dp)
            tile_pass.compiled.ds_tile(dp.reshape(-1, 64), p.reshape(-1, 64), dvec)
            dq_t, dk_t = np.empty((6, 64, dim), np.float32), np.empty((6, 64, dim), np.float32)
            it._pair_products(res, dp, k[3], dq_t)
            it._pair_products(res, dp, q, dk_t, trans=True)
            got = [np.empty_like(x) for x in (dv_t, dq_t, dk_t, p_sums)]
            tile_pass.compiled.pair_backward(q.reshape(-1, dim), do.reshape(-1, 24), kp[3].reshape(-1, it.PANEL),
                                             vp[0].reshape(-1, it.PANEL), k[3], lse, dvec, 0.5,
                                             got[0].reshape(-1, 24), got[1].reshape(-1, dim), got[2].reshape(-1, dim),
                                             got[3])
            assert all(a.tobytes() == b.tobytes() for a, b in zip(got, (dv_t, dq_t, dk_t, p_sums)))
    finally:
        tile_pass.compiled.use(before)


def test_invariant_backends():
    """NumPy runs every invariant entry point, and so does CuPy (tests/gpu/test_gpu_invariant.py)."""
    from mpi4py import MPI

    import ringmpi
    from ringmpi.backends.cupy_backend import CupyBackend

    q = np.zeros((1, 64, 2, 8), np.float32)
    o, lse, _ = ringmpi.ring_attention(q, q, q, context=ringmpi.RingContext(MPI.COMM_SELF, invariant=True,
                                                                            backend="numpy"))
    assert o.shape == q.shape and np.isfinite(lse).all()
    assert CupyBackend.INVARIANT
