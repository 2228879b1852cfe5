"""The balanced layout of packed documents (issue 42): visible-pair counts in closed form against
a dense count, the placement's balance, its edge cases and the Layout around it.  In process."""

import numpy as np
import pytest

import reference
from ringmpi.core import balance
from ringmpi.core.layout import Layout

MASKS = [(True, None), (False, None), (True, (5, 0)), (False, (3, 2)), (True, (None, 4)), (False, (0, None))]


def _dense_pairs(lengths, causal, window, positions):
    n = sum(lengths)
    seg = np.repeat(np.arange(len(lengths)), lengths)[None]
    vis = reference.visible(n, n, causal, window, seg, seg)[0]
    return int(vis[np.asarray(positions, dtype=np.int64)].sum())


@pytest.mark.parametrize("causal,window", MASKS)
def test_visible_pairs_match_a_dense_count(causal, window):
    rng = np.random.default_rng(3)
    for _ in range(40):
        lengths = [int(x) for x in rng.integers(1, 13, size=rng.integers(1, 7))]
        n = sum(lengths)
        positions = rng.choice(n, size=int(rng.integers(0, n + 1)), replace=False)
        assert balance.visible_pairs(positions, lengths, causal, window) == \
            _dense_pairs(lengths, causal, window, positions), (lengths, positions)
        assert balance.prefix_pairs(n, n, causal, window) == _dense_pairs([n], causal, window, range(n))


def _placement(lay):
    return [lay.indices(r) for r in range(lay.world_size)]


def _work(lay, parts):
    return np.array([balance.visible_pairs(part, lay.documents, lay.causal, lay.window) for part in parts])


@pytest.mark.parametrize("p", [4, 8])
@pytest.mark.parametrize("pack", ["lognormal", "long+short", "lognormal-window", "lognormal-full"])
def test_work_is_balanced_within_five_percent_and_tokens_stay_near_n_over_p(pack, p):
    n = 65536
    lengths = balance.lognormal_documents(n, 2048, 1.0) if pack.startswith("lognormal") else [32768] + [256] * 128
    causal = pack != "lognormal-full"
    window = (512, 0) if pack == "lognormal-window" else None
    lay = Layout("balanced", n, p, documents=lengths, causal=causal, window=window)
    parts = _placement(lay)
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(n))
    assert all(np.all(np.diff(part) > 0) for part in parts)
    work = _work(lay, parts)
    zigzag = _work(lay, _placement(Layout("zigzag", n, p)))
    assert work.max() / work.mean() <= 1.05 and work.max() <= zigzag.max(), (work, zigzag)
    assert lay.counts().max() / lay.counts().mean() <= 1.10, lay.counts()


@pytest.mark.parametrize("lengths,p", [([1] * 50, 4), ([7], 3), ([3], 5), ([1, 1, 1], 8), ([5, 1, 1, 7, 3], 6),
                                       ([1000], 7), ([10, 997, 1, 2], 4), ([2] * 13 + [101], 5)])
def test_any_lengths_partition_and_are_no_worse_than_zigzag(lengths, p):
    n = sum(lengths)
    for causal, window in MASKS[:3]:
        lay = Layout("balanced", n, p, documents=lengths, causal=causal, window=window)
        parts = _placement(lay)
        assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(n))
        assert lay.counts().tolist() == [len(part) for part in parts]
        zigzag = _work(lay, _placement(Layout("zigzag", n, p)))
        assert _work(lay, parts).max() <= zigzag.max()
        # the same placement from a second object: every rank computes it alone
        again = Layout("balanced", n, p, documents=list(lengths), causal=causal, window=window)
        assert all(np.array_equal(a, b) for a, b in zip(parts, _placement(again)))


def test_one_causal_document_is_split_head_and_tail_like_zigzag():
    lay = Layout("balanced", 64, 4, documents=[64], causal=True)
    zig = Layout("zigzag", 64, 4)
    assert [lay.indices(r).tolist() for r in range(4)] == [zig.indices(r).tolist() for r in range(4)]


def test_segment_ids_are_the_documents_of_local_tokens():
    lengths = [3, 1, 9, 2, 1, 20]
    lay = Layout("balanced", sum(lengths), 3, documents=lengths, causal=True)
    seg = np.repeat(np.arange(len(lengths)), lengths)
    for r in range(3):
        ids = lay.segment_ids(r, batch=2)
        assert ids.shape == (2, lay.counts()[r]) and np.array_equal(ids[1], seg[lay.indices(r)])
    with pytest.raises(ValueError, match="balanced layout"):
        Layout("zigzag", 4, 2).segment_ids(0)


def test_balanced_layout_refuses_bad_documents():
    with pytest.raises(ValueError, match="needs documents="):
        Layout("balanced", 4, 2)
    with pytest.raises(ValueError, match="summing to n = 5"):
        Layout("balanced", 5, 2, documents=[2, 2])
    with pytest.raises(ValueError, match="lengths >= 1"):
        Layout("balanced", 4, 2, documents=[4, 0])
    with pytest.raises(ValueError, match="for the balanced layout"):
        Layout("zigzag", 4, 2, documents=[4])
    with pytest.raises(ValueError, match=r"window must be \(left, right\), each an int >= 0 or -1"):
        Layout("balanced", 4, 2, documents=[4], window=(-2, 0))
    # a fractional side is refused, not truncated (the one rule: core.masks.window_problem)
    with pytest.raises(ValueError, match=r"window must be \(left, right\), each an int >= 0 or -1 \(unbounded\), "
                                         r"got \(2\.5, 0\)"):
        Layout("balanced", 4, 2, documents=[4], window=(2.5, 0))
    # flash-attn's convention: -1 is an unbounded side, (-1, -1) no window at all
    assert Layout("balanced", 4, 2, documents=[4], window=(-1, 0)).window == (None, 0)
    assert Layout("balanced", 4, 2, documents=[4], window=(-1, -1)).window is None
    lay = Layout("balanced", 10 ** 4, 2, documents=[1] * 10 ** 4)
    assert "<10000 documents>" in repr(lay) and len(repr(lay)) < 200


@pytest.mark.parametrize("causal,window", MASKS)
def test_keys_seen_elsewhere_match_a_dense_count(causal, window):
    """The bench's lower bound on what a rank must receive (issue 42's bytes target)."""
    rng = np.random.default_rng(11)
    for _ in range(40):
        lengths = [int(x) for x in rng.integers(1, 13, size=rng.integers(1, 7))]
        n = sum(lengths)
        mine = rng.choice(n, size=int(rng.integers(0, n + 1)), replace=False)
        seg = np.repeat(np.arange(len(lengths)), lengths)[None]
        vis = reference.visible(n, n, causal, window, seg, seg)[0]
        others = np.setdiff1d(np.arange(n), mine)
        want = int(vis[np.ix_(mine, others)].any(axis=0).sum()) if len(mine) and len(others) else 0
        assert balance.seen_elsewhere(mine, lengths, causal, window) == want, (lengths, mine)
