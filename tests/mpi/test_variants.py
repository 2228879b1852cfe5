"""Attention sinks, logit softcap, max logit (issue 13, parts 1, 2, 4) and ALiBi (issue 25) under real mpirun.

One launch per world size (P = 1, 3, 4) runs the whole case list of
``variant_cases.py``; each case is its own pytest item.  Shapes are uneven
(N % P != 0, N_q != N_kv), every layout, alone and combined with window,
segments and GQA; float64 finite differences check dsinks through the ring.
"""

import itertools

import ml_dtypes

import numpy as np
import pytest

import packed_cases
from mpi_util import CaseLaunches

WORLD_SIZES = (1, 3, 4)
LAYOUTS = ("contiguous", "zigzag", "striped")


def cases_for(p):
    cases, spin = [], itertools.count()

    def add(name, **kw):
        i = next(spin)
        case = dict(id=f"P{p}-{name}", B=1, H=4, Hkv=2, D=16, dtype="float32", seed=5000 * p + i)
        case.update(kw)
        cases.append(case)

    for layout in LAYOUTS:
        add(f"sinks-{layout}", n_q=37, layout=layout, causal=True, sinks=True)
        add(f"softcap-{layout}", n_q=41, layout=layout, softcap=2.0, k_scale=4.0)
        add(f"maxlogit-{layout}", n_q=30, n_kv=45, layout=layout, causal=True, window=[7, 0])
        add(f"combined-{layout}", n_q=53, layout=layout, causal=True, window=[12, 0], segments=3, B=2,
            H=6, Hkv=2, sinks=True, softcap=5.0, k_scale=3.0, own_share=layout == "zigzag")
        add(f"combined64-{layout}", n_q=29, n_kv=40, layout=layout, causal=True, window=[9, 2], segments=2,
            H=4, Hkv=1, sinks=True, sink_dtype="float64", softcap=1.5, k_scale=3.0, dtype="float64")
        # and with dropout: every option of issue 13 in one call
        add(f"all-{layout}", n_q=47, n_kv=52, layout=layout, causal=True, window=[15, 0], segments=2, B=2,
            H=4, Hkv=2, sinks=True, softcap=4.0, k_scale=3.0, dropout=0.25, dropout_seed=4242)
    if p == 4:  # the head x ring schedule (U ranks per group) carries all of them
        for u in (2, 4):
            add(f"combined-U{u}", n_q=53, layout="zigzag", causal=True, window=[12, 0], segments=3, B=2,
                H=4, Hkv=2, sinks=True, softcap=5.0, k_scale=3.0, head_parallel=u, own_share=True)
            add(f"all-U{u}", n_q=47, layout="striped", causal=True, segments=2, B=2, H=4, Hkv=2, sinks=True,
                softcap=4.0, k_scale=3.0, dropout=0.25, dropout_seed=4242, head_parallel=u)
    # ALiBi (issue 25): alone with N_q != N_kv on every layout, then with every other option
    for layout in LAYOUTS:
        add(f"alibi-{layout}", n_q=37, n_kv=45, layout=layout, causal=True, alibi=True)
    add("alibi-all", n_q=47, n_kv=52, layout="zigzag", causal=True, window=[15, 0], segments=2, B=2,
        H=4, Hkv=2, sinks=True, softcap=4.0, k_scale=3.0, dropout=0.25, dropout_seed=4242, alibi=True)
    add("alibi-all64", n_q=29, n_kv=40, layout="striped", window=[9, 2], H=4, Hkv=1, sinks=True,
        sink_dtype="float64", softcap=1.5, dtype="float64", alibi=True, alibi_scale=4.0)
    if p == 4:
        add("alibi-all-U2", n_q=47, layout="striped", causal=True, segments=2, B=2, H=4, Hkv=2, sinks=True,
            softcap=4.0, k_scale=3.0, dropout=0.25, dropout_seed=4242, head_parallel=2, alibi=True)
    add("large-sinks", n_q=33, layout="zigzag", sinks=True, sink_scale=30.0)  # sink far above the scores
    add("disjoint-sinks", n_q=20, layout="striped", segments=2, disjoint=True, sinks=True)
    add("disjoint", n_q=20, layout="contiguous", segments=2, disjoint=True, softcap=3.0)
    add("float16", n_q=45, layout="zigzag", causal=True, sinks=True, softcap=4.0, dtype="float16")
    add("bfloat16", n_q=45, layout="striped", window=[5, 5], sinks=True, softcap=4.0, dtype="bfloat16")
    add("scale", n_q=27, layout="contiguous", scale=0.7, softcap=0.5, sinks=True, q_scale=3.0)
    add("fd", kind="fd", n_q=11, n_kv=13, H=2, Hkv=1, D=5, layout="zigzag", causal=True, sinks=True,
        softcap=1.3, k_scale=2.0)
    add("errors", kind="errors", n_q=12, layout="striped")
    add("nan-max-logit", kind="nan_max", n_q=4, layout="contiguous")
    # file jobs: batch passes (a tiny pass budget) and head passes
    add("file-batch-passes", kind="file", n_q=23, B=3, layout="zigzag", causal=True, softcap=3.0, k_scale=3.0,
        pass_bytes=1)
    add("file-head-passes", kind="file", n_q=19, H=4, Hkv=2, layout="striped", softcap=1.0,
        argv=["--heads-per-pass", "2"])
    add("file-bad-sinks", kind="file", n_q=8, layout="contiguous", softcap=1.0, dataset="bad_sinks",
        expect_error="shape (5,), expected (H,) = (4,)")
    add("file-missing-sinks", kind="file", n_q=8, layout="contiguous", softcap=1.0, dataset="nope",
        expect_error="no such dataset")
    if p == 3:  # torch imports slowly: one launch
        add("torch", kind="torch", n_q=31, layout="zigzag", causal=True, sinks=True, softcap=2.0,
            k_scale=3.0)
        add("torch-alibi", kind="torch", n_q=31, layout="zigzag", causal=True, sinks=True, softcap=2.0,
            k_scale=3.0, alibi=True)
    for layout in LAYOUTS:
        add(f"decode-{layout}", kind="decode", n_q=3, n_kv=50, layout=layout, window=[20, 0], softcap=2.0,
            k_scale=4.0, sinks=layout != "zigzag")
    add("decode-alibi", kind="decode", n_q=3, n_kv=50, layout="striped", window=[20, 0], softcap=2.0,
        k_scale=4.0, sinks=True, alibi=True, H=4, Hkv=1)
    # 16-bit sinks (issue 27): computed in float32, the gradient in the sinks' dtype
    add("sinks-bfloat16", n_q=37, layout="zigzag", causal=True, sinks=True, sink_dtype="bfloat16")
    add("bfloat16-sinks-bfloat16", n_q=45, layout="striped", window=[5, 5], sinks=True, softcap=4.0,
        dtype="bfloat16", sink_dtype="bfloat16")
    add("sinks-float16", n_q=30, layout="contiguous", sinks=True, sink_dtype="float16")
    if p == 3:
        add("torch-sinks-bfloat16", kind="torch", n_q=31, layout="zigzag", causal=True, sinks=True, softcap=2.0,
            k_scale=3.0, sink_dtype="bfloat16")
    # explicit positions (issue 27): ALiBi, dropout, sinks, softcap, window, segments on any placement
    add("positions-all", n_q=47, n_kv=52, layout="zigzag", causal=True, window=[15, 0], segments=2, B=2,
        H=4, Hkv=2, sinks=True, softcap=4.0, k_scale=3.0, dropout=0.25, dropout_seed=4242, alibi=True,
        positions="permutation")
    add("positions-documents", n_q=60, layout="contiguous", causal=True, segments=4, B=2, sinks=True,
        dropout=0.25, dropout_seed=99, alibi=True, positions="documents")
    if p == 4:
        add("positions-all-U2", n_q=47, layout="striped", causal=True, segments=2, B=2, H=4, Hkv=2, sinks=True,
            softcap=4.0, k_scale=3.0, dropout=0.25, dropout_seed=4242, head_parallel=2, alibi=True,
            positions="permutation")
    # packed documents, balanced layout, routed schedule (issue 42): P = 1, 3, 4 here
    cases += packed_cases.cases_for(p)
    return cases


VARIANTS = CaseLaunches("variant_cases.py", WORLD_SIZES, cases_for, timeout=300)
results = VARIANTS.fixture()


@pytest.mark.mpi
@pytest.mark.parametrize("p,case", VARIANTS.params())
def test_variant_case(results, p, case):
    ok, msg = results(p)[case["id"]]
    assert ok, msg


def test_mask_spec_carries_softcap():
    from ringmpi.core.masks import ScoreSpec, kernel_scalars, modifier_scalars

    spec = ScoreSpec(causal=True, softcap=2.5)
    assert modifier_scalars(spec) == (np.float64(2.5),)
    assert modifier_scalars(ScoreSpec()) == (np.float64(0.0),)
    # the cap changes scores, never visibility
    assert kernel_scalars(spec) == kernel_scalars(ScoreSpec(causal=True))


def test_fold_sinks_rows_without_keys():
    from ringmpi.backends.numpy_backend import NumpyBackend
    from ringmpi.core.online_softmax import SoftmaxState

    state = SoftmaxState(NumpyBackend(), (1, 2, 3), 4, np.float64)
    o_acc, m, l = state.arrays()
    o_acc[0, 0, 0] = 2.0
    m[...] = np.array([[[0.5, -np.inf, -np.inf], [1.0, 2.0, -np.inf]]])
    l[...] = np.array([[[2.0, 0.0, 0.0], [1.0, 1.0, 0.0]]])
    sinks = np.array([0.25, 3.0])
    lse_before = m + np.log(np.where(l > 0, l, 1))
    state.fold_sinks(sinks)
    lse = m + np.log(l)
    seen = np.array([[[True, False, False], [True, True, False]]])
    want = np.where(seen, np.logaddexp(lse_before, sinks[None, :, None]), sinks[None, :, None])
    np.testing.assert_allclose(lse, want, rtol=1e-15)
    np.testing.assert_allclose(o_acc[0, 0, 0] / l[0, 0, 0], 2.0 / (2.0 + np.exp(0.25 - 0.5)), rtol=1e-15)
    assert (o_acc[~seen[0][None].repeat(1, 0)] == 0).all()


def test_option_problems():
    from ringmpi.options import sinks_problem, softcap_problem

    assert softcap_problem(None) is None and softcap_problem(30) is None
    for bad in (0, -1.0, float("nan"), float("inf"), "x"):
        assert softcap_problem(bad)
    assert sinks_problem(np.zeros(3, np.float32), 3) is None
    assert "shape" in sinks_problem(np.zeros((3, 1), np.float32), 3)
    assert "float32, float64" in sinks_problem(np.zeros(3, np.int64), 3)
    assert sinks_problem(np.zeros(3, ml_dtypes.bfloat16), 3) is None and sinks_problem(np.zeros(3, np.float16), 3) is None
    assert "finite" in sinks_problem(np.array([0, np.inf, 0], np.float64), 3)


@pytest.mark.mpi
def test_bench_takes_softcap_and_sinks():
    import sys

    from mpi_util import ROOT, mpirun

    base = [sys.executable, "-m", "ringmpi", "bench", "--n", "200", "--heads", "2", "--dim", "16", "--repeat", "1",
            "--warmup", "0", "--backend", "numpy"]
    rc, out, err, _ = mpirun(2, base + ["--softcap", "30", "--sinks", "--backward"], 120, cwd=ROOT)
    assert rc == 0, err[-2000:]
    assert "softcap 30.0, sinks" in out and "backward" in out
    rc, out, err, _ = mpirun(2, base + ["--softcap", "-1"], 120, cwd=ROOT)
    assert rc == 2 and "--softcap: softcap must be finite and >= 0 (0.0: off)" in err


@pytest.mark.mpi
def test_file_job_with_sinks_resumes_bitwise(tmp_path):
    """A job with sinks, softcap and max logit in 6 passes (3 batch x 2 head groups), killed at
    the start of pass 3 and resumed, writes the same bits as an uninterrupted one: the per-pass
    rows of max_logit/dsinks are rewritten, never added twice."""
    import h5py

    from cli_util import write_input
    from test_resume import job, load

    src = write_input(tmp_path / "in.h5", n=30, b=3)
    with h5py.File(src, "a") as f:
        f["sinks"] = np.array([0.5, -1.0, 2.0, 0.0], dtype=np.float32)
    extra = ["--sinks-dataset", "sinks", "--softcap", "2.5", "--max-logit"]
    rc, _, err, _ = job(3, src, tmp_path / "ref.h5", *extra)
    assert rc == 0, err
    out = tmp_path / "out.h5"
    rc, _, err, _ = job(3, src, out, *extra, fault="raise:0:3:pass")
    assert rc != 0 and not out.exists()
    rc, _, err, _ = job(3, src, out, "--resume", *extra)
    assert rc == 0 and "3 of 6 pass(es) already complete" in err, err
    ref, got = load(tmp_path / "ref.h5")[0], load(out)[0]
    assert sorted(got) == sorted(ref) and {"sinks", "dsinks", "max_logit"} <= set(ref)
    for name in ref:
        assert got[name].tobytes() == ref[name].tobytes(), name
    assert np.isfinite(ref["dsinks"]).all() and np.isfinite(ref["max_logit"]).all()


def test_every_block_kernel_takes_the_modifier_scalars():
    """``MOD_PARAMS`` follows ``MASK_PARAMS`` in every block kernel, in the order
    ``CupyBackend._mask_values`` packs them (mask scalars, then ``modifier_scalars``)."""
    import inspect
    import re

    from ringmpi import kernels as K
    from ringmpi.backends import cupy_backend

    for name in ("forward.cu", "backward.cu", "invariant.cu"):
        text = (K.KERNEL_DIR / name).read_text()
        kernels = re.findall(r"__global__ void[^(]*\(([^{]*)\)\s*\{", text)
        assert kernels, name
        for params in kernels:
            assert re.search(r"MASK_PARAMS,\s*MOD_PARAMS,", params), params
    assert "+ modifier_scalars(mask.spec)" in inspect.getsource(cupy_backend.CupyBackend._mask_values)


# ---------------------------------------------------------------- max logit of non-finite scores
# One semantics on every backend (np.maximum's): a head with a visible NaN score has
# max_logit NaN; a row whose visible scores are all -inf contributes -inf (and gets
# o = 0, lse = -inf).  Heads (causal, B = 1, N = 40, D = 8):
#   0 clean;  1 one NaN in q (row 5);  2 every score -inf (q = (inf, 0, ...), k_0 < 0);
#   3 every score negative, key 0's -inf (k_0 = -inf): row 0 sees only -inf.
NF_N, NF_H, NF_D = 40, 4, 8


def nonfinite_max_logit_inputs(dtype):
    """``q, k, v`` (1, 40, 4, 8) in ``dtype`` with the heads above."""
    import ringmpi.core.dtypes

    rng = np.random.default_rng(29)
    q, k, v = (rng.standard_normal((1, NF_N, NF_H, NF_D)) for _ in range(3))
    q[0, 5, 1, 2] = np.nan
    q[..., 2, :] = 0
    q[..., 2, 0] = np.inf
    k[..., 2, 0] = -np.abs(k[..., 2, 0]) - 0.5
    q[..., 3, 0] = np.abs(q[..., 3, 0]) + 0.5
    k[..., 3, :] = 0
    k[..., 3, 0] = -np.abs(rng.standard_normal(NF_N)) - 0.5
    k[0, 0, 3, 0] = -np.inf
    return tuple(ringmpi.core.dtypes.to_dtype(x, dtype) for x in (q, k, v))


def nonfinite_max_logit_problems(backend, dtype, to_device=lambda x: x, to_host=np.asarray):
    """What differs from the semantics above for ``ring_attention(..., backend=backend)``."""
    from mpi4py import MPI

    import reference
    import ringmpi

    q, k, v = nonfinite_max_logit_inputs(dtype)
    o, lse, ml = ringmpi.ring_attention(*(to_device(x) for x in (q, k, v)), causal=True, return_max_logit=True,
                                        context=ringmpi.RingContext(MPI.COMM_SELF, backend=backend))
    o, lse = to_host(o).astype(np.float64), to_host(lse)
    vis = reference.visible(NF_N, NF_N, True, None, None, None)
    scale = 1 / np.sqrt(NF_D)
    ref = reference.dense_max_logit(q, k, vis, scale, np.float64)
    naive = reference.dense_max_logit(q, k, vis, scale, q.dtype)
    problems = []
    for h in (0, 3):
        ok, msg = reference.tolerance_check(f"max_logit[{h}]", ml[h:h + 1], ref[h:h + 1], naive[h:h + 1])
        problems += [] if ok and np.isfinite(ml[h]) else [msg]
    if not (np.isnan(ml[1]) and np.isnan(ref[1])):
        problems.append(f"max_logit[1] = {ml[1]} with a visible NaN score")
    if not (ml[2] == -np.inf and ref[2] == -np.inf):
        problems.append(f"max_logit[2] = {ml[2]} where every visible score is -inf")
    if not ((o[0, :, 2] == 0).all() and (lse[0, 2] == -np.inf).all()):
        problems.append("head 2 (every score -inf): o must be 0 and lse -inf")
    if not (np.isnan(o[0, 5, 1]).all() and np.isnan(lse[0, 1, 5]) and np.isfinite(lse[0, 1, :5]).all()):
        problems.append("head 1: row 5 (NaN q) must be NaN, the rows before it finite")
    if not ((o[0, 0, 3] == 0).all() and lse[0, 3, 0] == -np.inf and np.isfinite(lse[0, 3, 1:]).all()):
        problems.append("head 3: row 0 (only -inf) must be o = 0, lse = -inf, the other rows finite")
    return problems


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_max_logit_of_nan_and_all_minus_inf_rows(dtype):
    """NumPy side (tests/gpu/test_gpu_variants.py runs the same on CuPy)."""
    assert not nonfinite_max_logit_problems("numpy", np.dtype(dtype))
