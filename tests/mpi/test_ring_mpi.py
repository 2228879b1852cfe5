"""Ring attention under real mpirun against the float64 dense reference.

One mpirun launch per world size runs the whole case list for that size
(``ring_cases.py``); each case is then its own pytest item.  One more launch
at P = 3 uses tiny tiles (``RINGMPI_TILE_Q/KV``) so that every block spans
many tiles: skipped, full and partial ones, and the running-maximum paths.
The launches at P = 2 and 5 also run packed-document cases (``packed_cases.py``).
"""

import itertools
import os

import pytest

import packed_cases
from mpi_util import CaseLaunches, mpirun_env

WORLD_SIZES = (1, 2, 3, 4, 5, 8)
SMALL_TILES = {"RINGMPI_TILE_Q": 32, "RINGMPI_TILE_KV": 48}
LAUNCHES = [(p, False) for p in WORLD_SIZES] + [(3, True)]
LENGTHS = (1, 3, 97, 256, 257)
DIMS = (8, 59, 64, 128)
HEADS = ((4, 4), (8, 2), (4, 1))
LAYOUTS = ("contiguous", "zigzag", "striped")
BACKEND = os.environ.get("RINGMPI_TEST_BACKEND", "numpy")


def cases_for(p, small_tiles=False):
    cases, spin = [], itertools.count()
    tag = f"P{p}t" if small_tiles else f"P{p}"

    def add(name, **kw):
        i = next(spin)
        h, hkv = HEADS[i % len(HEADS)]
        case = dict(id=f"{tag}-{name}", B=1, H=h, Hkv=hkv, D=DIMS[i % len(DIMS)], dtype="float32",
                    backward=True, seed=1000 * p + i)
        case.update(kw)
        cases.append(case)

    for n, layout, causal in itertools.product(LENGTHS, LAYOUTS, (False, True)):
        add(f"n{n}-{layout}-{'causal' if causal else 'full'}", n_q=n, layout=layout, causal=causal,
            B=2 if n == 97 else 1)
    for layout in LAYOUTS:
        add(f"window-causal-{layout}", n_q=257, layout=layout, causal=True, window=[16, 0])
        add(f"window-both-{layout}", n_q=200, layout=layout, window=[8, 8])
        add(f"window-right-{layout}", n_q=97, layout=layout, window=[-1, 5])
        add(f"segments-{layout}", n_q=256, layout=layout, segments=5, B=2)
        add(f"segments-causal-{layout}", n_q=257, layout=layout, causal=True, segments=3)
        add(f"qlong-causal-{layout}", n_q=256, n_kv=97, layout=layout, causal=True)  # rows see nothing
        add(f"kvlong-causal-{layout}", n_q=97, n_kv=256, layout=layout, causal=True)
        add(f"kvlong-window-{layout}", n_q=64, n_kv=200, layout=layout, window=[10, 10], causal=True)
        add(f"float64-{layout}", n_q=97, layout=layout, causal=True, dtype="float64")
        add(f"float16-{layout}", n_q=97, layout=layout, causal=True, dtype="float16")
        # scores ~1e4 (or a large common offset): float32 forward; the float32 LSE hand-off bounds
        # backward accuracy to |lse| * 2^-24 in P, so those backwards are checked in float64
        add(f"extreme-{layout}", n_q=97, layout=layout, causal=True, q_scale=100.0, k_scale=100.0,
            backward=False)
        add(f"extreme64-{layout}", n_q=97, layout=layout, causal=True, q_scale=100.0, k_scale=100.0,
            dtype="float64")
        add(f"large-{layout}", n_q=97, layout=layout, q_scale=10.0, k_scale=10.0, backward=False)
        add(f"offset-{layout}", n_q=97, layout=layout, q_offset=40.0, backward=False)
        add(f"offset64-{layout}", n_q=97, layout=layout, q_offset=40.0, dtype="float64")
        add(f"scale-{layout}", n_q=64, layout=layout, scale=0.5)
        add(f"bitwise-{layout}", n_q=257, layout=layout, causal=True, repeat=3)
    if p in (1, 3):
        for layout in LAYOUTS:
            add(f"fd-{layout}", kind="fd", n_q=11, n_kv=13, B=1, H=2, Hkv=1, D=5, layout=layout, causal=True)
    # bfloat16 last, so the cases above keep their seeds
    for layout in LAYOUTS:
        add(f"bfloat16-causal-{layout}", n_q=97, layout=layout, causal=True, dtype="bfloat16", B=2)
        add(f"bfloat16-full-{layout}", n_q=256, n_kv=200, layout=layout, dtype="bfloat16")
        add(f"bfloat16-window-{layout}", n_q=200, layout=layout, causal=True, window=[16, 0],
            dtype="bfloat16")
        add(f"bfloat16-segments-{layout}", n_q=256, layout=layout, segments=5, B=2, dtype="bfloat16")
        add(f"bfloat16-bits-{layout}", n_q=97, layout=layout, window=[8, 8], dtype="bfloat16", bits=True)
    if p == 3:
        add("bf16-errors", kind="bf16_errors", n_q=20, layout="zigzag", nan_at=11)
    if p in (1, 3):  # explicit positions (issue 27): any assignment of tokens to ranks
        add("positions-perm-causal", n_q=97, layout="contiguous", causal=True, positions="permutation", B=2)
        add("positions-perm-window", n_q=64, n_kv=120, layout="zigzag", causal=True, window=[10, 10],
            positions="permutation")
        add("positions-documents", n_q=120, layout="contiguous", causal=True, segments=5, B=2,
            positions="documents")
        add("positions-float64", n_q=50, layout="striped", window=[6, 3], positions="permutation",
            dtype="float64")
        add("positions-errors", kind="positions_errors", n_q=20, H=2, Hkv=1, D=4, layout="zigzag")
    if p == 2 and not small_tiles:  # the all-gather's memory within its declared budget (issue 53)
        add("allgather-memory", kind="allgather_memory", n_q=8192, H=4, Hkv=4, D=64, layout="contiguous")
    if not small_tiles:  # packed documents, balanced layout, routed schedule (issue 42): P = 2 and 5 here
        cases += packed_cases.cases_for(p) if p in (2, 5) else []
    return cases


RING = CaseLaunches("ring_cases.py", LAUNCHES, lambda launch: cases_for(*launch), timeout=300,
                    env=lambda launch: mpirun_env(**SMALL_TILES) if launch[1] else None)
results = RING.fixture()


@pytest.mark.mpi
@pytest.mark.parametrize("launch,case", RING.params())
def test_ring_case(results, launch, case):
    ok, msg = results(launch)[case["id"]]
    assert ok, msg
