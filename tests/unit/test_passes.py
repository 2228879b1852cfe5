"""Pass planning of ``ringmpi run`` (in-process, no MPI): passes cover the work
once, keep GQA groups whole, fit the byte budget at the input's element size."""

import itertools

import pytest

from ringmpi.filejob.hdf5 import InputSpec
from ringmpi.filejob.pass_plan import Pass, bytes_per_batch_entry, pass_boxes, plan_passes


def spec(batch=6, n=100, heads=8, kv_heads=2, dim=16, dtype="float32", rank4=True, do=True):
    q = (batch, n, heads, dim) if rank4 else (n, heads, dim)
    kv = (batch, n, kv_heads, dim) if rank4 else (n, kv_heads, dim)
    shapes = {"q": q, "k": kv, "v": kv, **({"do": q} if do else {})}
    return InputSpec(path="in.h5", batch=batch if rank4 else 1, n_q=n, n_kv=n, heads=heads, kv_heads=kv_heads,
                     dim=dim, dtype=dtype, seg_q=None, seg_kv=None, shapes=shapes)


def covered(passes):
    return sorted((b, g) for p in passes for b in range(p.b0, p.b1) for g in range(p.g0, p.g1))


@pytest.mark.parametrize("heads_per_pass,budget",
                         list(itertools.product([None, 4, 8], [1, 10 ** 5, 10 ** 6, 10 ** 12])))
def test_passes_cover_every_batch_entry_and_head_group_once(heads_per_pass, budget):
    s = spec()
    passes = plan_passes(s, 3, heads_per_pass, budget)
    assert covered(passes) == [(b, g) for b in range(s.batch) for g in range(s.kv_heads)]
    kv_per = s.kv_heads if heads_per_pass is None else heads_per_pass // s.group
    assert all(p.g1 - p.g0 == kv_per for p in passes)


def test_batch_entries_per_pass_follow_the_budget():
    s = spec()
    one = bytes_per_batch_entry(s, 3, s.kv_heads)
    assert [p.b1 - p.b0 for p in plan_passes(s, 3, None, 2 * one)] == [2, 2, 2]
    assert [p.b1 - p.b0 for p in plan_passes(s, 3, None, 2 * one - 1)] == [1] * 6
    assert [p.b1 - p.b0 for p in plan_passes(s, 3, None, 0)] == [1] * 6  # at least one entry
    assert plan_passes(s, 3, None, 10 ** 15) == [Pass(0, 6, 0, 2)]


def test_float64_counts_eight_bytes_per_element():
    """float64 computes in float64: twice float32's bytes, so half the entries per pass."""
    s32, s64, s16 = spec(dtype="float32"), spec(dtype="float64"), spec(dtype="float16")
    assert bytes_per_batch_entry(s64, 3, 2) == 2 * bytes_per_batch_entry(s32, 3, 2)
    assert bytes_per_batch_entry(s16, 3, 2) == bytes_per_batch_entry(s32, 3, 2)  # computes in float32
    budget = 4 * bytes_per_batch_entry(s32, 3, 2)
    assert [p.b1 - p.b0 for p in plan_passes(s32, 3, None, budget)] == [4, 2]
    assert [p.b1 - p.b0 for p in plan_passes(s64, 3, None, budget)] == [2, 2, 2]


def test_bytes_scale_with_the_local_rows():
    s = spec(n=100)
    assert bytes_per_batch_entry(s, 4, 2) == bytes_per_batch_entry(spec(n=25), 1, 2)
    assert bytes_per_batch_entry(s, 3, 2) == bytes_per_batch_entry(spec(n=34), 1, 2)  # ceil(100 / 3)


def test_boxes_select_the_pass_of_4d_and_3d_datasets():
    p = Pass(b0=2, b1=4, g0=1, g1=2)
    boxes = pass_boxes(spec(), p)
    assert boxes["q"] == (1, [(2, 4), (0, 0), (4, 8), (0, 16)])
    assert boxes["kv"] == (1, [(2, 4), (0, 0), (1, 2), (0, 16)])
    assert boxes["lse"] == (2, [(2, 4), (4, 8), (0, 0)])
    flat = pass_boxes(spec(rank4=False), Pass(0, 1, 0, 1))
    assert flat == {"q": (0, [(0, 0), (0, 4), (0, 16)]), "kv": (0, [(0, 0), (0, 1), (0, 16)]),
                    "lse": (1, [(0, 4), (0, 0)]),
                    "o": (0, [(0, 0), (0, 4), (0, 16)]), "v": (0, [(0, 0), (0, 1), (0, 16)])}  # D_v = D


def test_input_spec_derives_rank_and_do_from_the_shapes():
    assert spec(rank4=True).rank4 and not spec(rank4=False).rank4
    assert spec(do=True).has_do and not spec(do=False).has_do
    assert spec(dtype="float64").itemsize == 8 and spec(dtype="float16").itemsize == 2
