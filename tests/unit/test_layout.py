"""Layout: which global tokens each rank owns (in-process, no MPI)."""

import numpy as np
import pytest

from ringmpi.core.layout import KINDS, Layout


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n, p", [(1, 1), (1, 4), (7, 3), (16, 4), (97, 8), (5, 5)])
def test_ranks_partition_the_sequence_in_ascending_local_order(kind, n, p):
    layout = Layout(kind, n, p)
    parts = [layout.indices(r) for r in range(p)]
    assert all(part.dtype == np.int64 and np.all(np.diff(part) > 0) for part in parts)
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(n))
    assert layout.counts().tolist() == [len(part) for part in parts]
    assert max(layout.counts()) - min(layout.counts()) <= (2 if kind == "zigzag" else 1)


def test_kinds_place_tokens_as_documented():
    assert Layout("contiguous", 7, 3).indices(0).tolist() == [0, 1, 2]
    assert Layout("contiguous", 7, 3).indices(2).tolist() == [5, 6]
    assert Layout("zigzag", 8, 2).indices(0).tolist() == [0, 1, 6, 7]
    assert Layout("zigzag", 8, 2).indices(1).tolist() == [2, 3, 4, 5]
    assert Layout("striped", 7, 3).indices(1).tolist() == [1, 4]


def test_counts_are_computed_once(monkeypatch):
    layout = Layout("zigzag", 50, 4)
    calls = []
    original = Layout.indices
    monkeypatch.setattr(Layout, "indices", lambda self, r: calls.append(r) or original(self, r))
    first = layout.counts()
    for _ in range(5):
        assert layout.counts() is first
    assert len(calls) == 4
    with pytest.raises(ValueError):
        first[0] = 1  # shared, so read-only


@pytest.mark.parametrize("kind", KINDS)
def test_shard_unshard_round_trip(kind):
    x = np.arange(2 * 11 * 3).reshape(2, 11, 3)
    layout = Layout(kind, 11, 4)
    shards = [layout.shard(x, r) for r in range(4)]
    assert np.array_equal(layout.unshard(shards), x)


def test_refuses_bad_arguments():
    with pytest.raises(ValueError, match="unknown layout"):
        Layout("spiral", 4, 2)
    with pytest.raises(ValueError, match="n >= 1"):
        Layout("contiguous", 0, 2)
    with pytest.raises(ValueError, match="world_size >= 1"):
        Layout("contiguous", 4, 0)
    with pytest.raises(ValueError, match="outside world"):
        Layout("contiguous", 4, 2).indices(2)
    with pytest.raises(ValueError, match="layout expects 5"):
        Layout("contiguous", 5, 2).shard(np.zeros((1, 4)), 0)
    with pytest.raises(ValueError, match="expected 2 shards"):
        Layout("contiguous", 5, 2).unshard([np.zeros((1, 3))])


@pytest.mark.parametrize("kind", KINDS)
def test_shard_and_unshard_torch_tensors_on_their_device(kind):
    """Torch tensors (CPU; CUDA where a GPU is visible) are sharded and reassembled as tensors
    on their own device, equal to the NumPy result (issue 27)."""
    torch = pytest.importorskip("torch")
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    layout = Layout(kind, 11, 3)
    x = np.arange(2 * 11 * 3, dtype=np.float32).reshape(2, 11, 3)
    for device in devices:
        t = torch.from_numpy(x).to(device)
        parts = [layout.shard(t, r) for r in range(3)]
        assert all(isinstance(p, torch.Tensor) and p.device.type == device for p in parts)
        for r, part in enumerate(parts):
            assert np.array_equal(part.cpu().numpy(), layout.shard(x, r))
        whole = layout.unshard(parts)
        assert whole.device.type == device and whole.dtype == t.dtype and torch.equal(whole, t)
        assert torch.equal(Layout(kind, 3, 2).unshard([Layout(kind, 3, 2).shard(t, r, axis=2) for r in range(2)],
                                                      axis=2), t)


def _check(parts):
    from ringmpi.core.positions import placement_problem, summary
    return placement_problem("positions_q", [summary(np.asarray(p, dtype=np.int64)) for p in parts])


@pytest.mark.parametrize("kind", KINDS)
def test_layout_positions_and_permutations_pass_the_placement_check(kind):
    """A layout's positions, a random permutation cut anywhere, empty shards and positions
    near 2^21 (cubes past 2^64, summed modulo 2^64) pass ringmpi.core.positions' check (issue 27)."""
    from ringmpi.core.positions import from_layout
    layout = Layout(kind, 97, 4)
    assert _check([layout.indices(r) for r in range(4)]) is None
    place = from_layout(layout, 2)
    assert place.n == 97 and list(place.counts) == list(layout.counts()) and place.layout == layout
    perm = np.random.default_rng(3).permutation(3_000_000)
    assert _check([perm[:10], perm[10:10], perm[10:2_000_000], perm[2_000_000:]]) is None


def test_bad_positions_are_found():
    """Out of range, repeated on a rank, held by two ranks (one missing), even where the first
    two power sums agree: {1, 5, 6} -> {2, 3, 7} keeps sum and sum of squares (issue 27)."""
    assert "must lie in [0, N = 5)" in _check([[0, 1], [2, 3, 5]])
    assert "must lie in [0, N = 3)" in _check([[-1, 0], [1]])
    assert "rank 1 holds 1 position(s) more than once" in _check([[0, 1], [2, 2]])
    assert "not a permutation" in _check([[0, 1, 2], [1, 4]])
    assert "not a permutation" in _check([[0, 2, 3, 4], [2, 3, 7, 8], [7]])  # 0..8 with 1, 5, 6 replaced
