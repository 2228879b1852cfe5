"""decode_attention and KVCache under real mpirun against a float64 dense reference.

One mpirun launch per world size runs every case for it (``decode_cases.py``);
each case is its own pytest item.  Every case also checks that all ranks got
the same bits.
"""

import itertools

import pytest

from mpi_util import CaseLaunches, mpirun_env

WORLD_SIZES = (1, 2, 3, 4)
LAYOUTS = ("contiguous", "zigzag", "striped")
DTYPES = ("float16", "bfloat16", "float32", "float64")


def cases_for(p):
    cases, spin = [], itertools.count()

    def add(name, kind, **kw):
        i = next(spin)
        case = dict(id=f"P{p}-{name}", kind=kind, B=1, H=4, Hkv=2, D=16, dtype="float32", seed=100 * p + i)
        case.update(kw)
        cases.append(case)

    for layout in LAYOUTS:
        for n in (2, 61):  # 2 < P: empty shards; 61 % P != 0: uneven ones
            add(f"static-n{n}-{layout}", "static", N=n, S=1, layout=layout)
        add(f"static-chunk-{layout}", "static", N=61, S=5, layout=layout, H=6, Hkv=3, D=13)
        add(f"static-window-{layout}", "static", N=61, S=3, layout=layout, window=[9, 0])
        add(f"static-full-{layout}", "static", N=40, S=4, layout=layout, causal=False, window=[None, 2])
        add(f"static-mqa-sinks-{layout}", "static", N=50, S=2, layout=layout, H=4, Hkv=1, sinks=True,
            layout_obj=True, scale=0.3)
        add(f"static-ragged-{layout}", "static", N=45, S=2, B=3, layout=layout, lengths=[45, 17, 2])
        add(f"static-ragged-full-{layout}", "static", N=45, S=2, B=3, layout=layout, lengths=[0, 30, 45],
            causal=False, sinks=True)
        add(f"cache-{layout}", "cache", layout=layout, prefill=0, steps=[3, 1, 1, 2, 1], B=2, sinks=True)
        add(f"cache-prefill-ragged-{layout}", "cache", layout=layout, prefill=23, prefill_lengths=[23, 11],
            steps=[1, 1, 4, 1], B=2, window=[12, 0], capacity=3, chunk=5)
    for dtype in DTYPES:
        add(f"static-{dtype}", "static", N=70, S=2, layout="striped", dtype=dtype, B=2, sinks=True)
        add(f"cache-{dtype}", "cache", layout="zigzag", prefill=9, steps=[2, 1], dtype=dtype)
    add("static-large-merge", "static", N=33, S=64, B=2, H=8, Hkv=8, D=64, layout="zigzag")  # ~140 KiB rows
    add("static-root", "static", N=30, S=2, layout="contiguous", root=p - 1)
    if p in (1, 3):  # explicit cache positions (issue 27)
        add("static-positions", "static", N=61, S=3, B=3, layout="contiguous", window=[20, 0], sinks=True,
            lengths=[61, 30, 5], positions=True)
    add("cache-contiguous-owner", "cache", layout="contiguous", prefill=10, steps=[2, 3],
        expect_rows=[10 // p + (r < 10 % p) + 5 * (r == p - 1) for r in range(p)])  # appends: last rank
    for what, expect in (("softcap", "softcap must be finite and >= 0 (0.0: off)"),
                         ("softcap_one_rank", "ranks disagree"), ("dtype_one_rank", "k_cache dtype"),
                         ("q_differs", "ranks disagree"), ("lengths", "cache_lengths"),
                         ("positions_repeated", "positions_kv"), ("positions_range", "positions_kv must lie in")):
        if p > 1 or what not in ("q_differs", "softcap_one_rank"):
            add(f"error-{what}", "error", what=what, expect=expect)
    return cases


# Open MPI's allreduce algorithms, each forced in turn (other MPIs ignore the variables): the
# merge must give the same bits on every rank whichever one the library picks
ALLREDUCE_ALGORITHMS = {1: "linear", 2: "reduce-bcast", 3: "recursive-doubling", 4: "ring",
                        5: "segmented-ring", 6: "rabenseifner"}
FORCED_P = 3


def forced_cases(algorithm):
    keep = ("static-chunk-zigzag", "static-ragged-striped", "static-large-merge", "cache-contiguous",
            "static-float16", "static-mqa-sinks-striped")
    return [dict(c, id=c["id"].replace(f"P{FORCED_P}-", f"P{FORCED_P}a{algorithm}-"))
            for c in cases_for(FORCED_P) if c["id"].split("-", 1)[1] in keep]


LAUNCHES = [(p, None) for p in WORLD_SIZES] + [(FORCED_P, a) for a in ALLREDUCE_ALGORITHMS]


def launch_cases(launch):
    p, algorithm = launch
    return cases_for(p) if algorithm is None else forced_cases(algorithm)


def launch_env(launch):
    algorithm = launch[1]
    return None if algorithm is None else mpirun_env(OMPI_MCA_coll_tuned_use_dynamic_rules=1,
                                                     OMPI_MCA_coll_tuned_allreduce_algorithm=algorithm)


DECODE = CaseLaunches("decode_cases.py", LAUNCHES, launch_cases, timeout=240, env=launch_env)
results = DECODE.fixture()


@pytest.mark.mpi
@pytest.mark.parametrize("launch,case", DECODE.params())
def test_decode_case(results, launch, case):
    ok, msg = results(launch)[case["id"]]
    assert ok, msg
