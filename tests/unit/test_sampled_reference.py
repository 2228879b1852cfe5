"""The sampled rows of ``ringmpi verify --sample`` (:class:`ringmpi.core.dense_reference.SampledReference`)
against the tests' own dense reference (tests/support/reference.py) on whole small problems.

Query rows (``o``, ``lse``, ``dq``) and key rows (``dk``, ``dv``), fed in chunks that do not
divide the sequence, must equal the dense float64 reference's rows to rounding, for every
mask and score rule verify applies (causal with ``N_kv != N_q``, rows that see no key,
windows, segments, softcap, sinks, ALiBi, dropout, GQA, ``D_v != D``), in batch entry 1 (the
batch index reaches dropout).  In float32 and bfloat16 the same code is the naive computation
that sets the bound: it must stay within its precision of the reference.
"""

from __future__ import annotations

import numpy as np
import pytest

import reference
from ringmpi.core.dense_reference import SampledReference, max_err
from ringmpi.core.dtypes import BFLOAT16
from ringmpi.options import AttentionOptions

CASES = {
    "causal-gqa": dict(n=70, h=4, hkv=2, causal=True),
    "short-kv-unseen-rows-dv": dict(n=60, n_kv=40, d_v=5, causal=True),  # rows i < 20 see no key
    "offset-window": dict(n=50, n_kv=77, window=(5, 3)),
    "segments-softcap": dict(n=64, segments=True, softcap=2.0, causal=True),
    "sinks-alibi": dict(n=64, h=2, sinks=True, alibi=True, causal=True),
    "dropout-gqa": dict(n=66, h=4, hkv=1, dropout=0.3, causal=True),
}
CHUNK = 17  # rows per chunk: not a divisor of any length above


def problem(case):
    """Inputs (float64, B = 2), the options, and the test reference's keywords."""
    rng = np.random.default_rng(5)
    n_q, n_kv = case["n"], case.get("n_kv", case["n"])
    h, hkv, d, d_v = case.get("h", 2), case.get("hkv", case.get("h", 2)), 8, case.get("d_v", 8)
    q, do = rng.standard_normal((2, n_q, h, d)), rng.standard_normal((2, n_q, h, d_v))
    k, v = rng.standard_normal((2, n_kv, hkv, d)), rng.standard_normal((2, n_kv, hkv, d_v))
    seg_q = seg_kv = None
    if case.get("segments"):
        seg_q = seg_kv = np.sort(rng.integers(0, 4, size=(2, n_q)), axis=1)
    sinks = rng.standard_normal(h) if case.get("sinks") else None
    alibi = (0.5 ** np.arange(1, h + 1)) if case.get("alibi") else None
    p = case.get("dropout", 0.0)
    options = AttentionOptions(causal=case.get("causal", False), window=case.get("window"),
                               softcap=case.get("softcap"), alibi_slopes=alibi, dropout_p=p,
                               dropout_seed=91 if p else None)
    vis = reference.visible(n_q, n_kv, options.causal, case.get("window"), seg_q, seg_kv)
    dense = dict(vis=vis, scale=d ** -0.5, sinks=sinks, softcap=case.get("softcap"), alibi=alibi,
                 drop=reference.dropout_factors(91, p, 2, h, n_q, n_kv) if p else None)
    return (q, k, v, do, seg_q, seg_kv), options.score_spec(h, offset=n_kv - n_q), dense


def sampled(spec, scale, dtype, sinks, arrays, o, lse, b=1):
    """Query rows and key rows of batch entry ``b`` in ``dtype``, the chunks cut at CHUNK."""
    q, k, v, do, seg_q, seg_kv = (None if x is None else x[b] for x in arrays)
    rng = np.random.default_rng(8)
    rows = np.sort(rng.choice(len(q), size=min(23, len(q)), replace=False))
    cols = np.sort(rng.choice(len(k), size=min(19, len(k)), replace=False))
    seg = (lambda s, i: None if s is None else s[i])

    def key_chunks():
        for c in range(0, len(k), CHUNK):
            part = slice(c, c + CHUNK)
            yield np.arange(len(k))[part], k[part], v[part], seg(seg_kv, part)

    def query_chunks():
        for c in range(0, len(q), CHUNK):
            part = slice(c, c + CHUNK)
            yield np.arange(len(q))[part], q[part], do[part], o[b][part], lse[b][:, part], seg(seg_q, part)

    ref = SampledReference(spec, scale, dtype, sinks=sinks)
    got = ref.query_rows(rows, q[rows], key_chunks, do=do[rows], seg_q=seg(seg_q, rows), batch_index=b)
    got.update(ref.key_rows(cols, k[cols], v[cols], query_chunks, seg_kv=seg(seg_kv, cols), batch_index=b))
    return got, rows, cols


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("dtype,limit", [("float64", 1e-10), ("float32", 2e-4), ("bfloat16", 0.25)])
def test_sampled_rows_are_the_dense_rows(name, dtype, limit):
    arrays, spec, dense = problem(CASES[name])
    kw = {key: dense[key] for key in ("sinks", "softcap", "drop", "alibi")}
    o, lse = reference.dense_forward(*arrays[:3], dense["vis"], dense["scale"], np.float64, **kw)
    grads = reference.dense_backward(arrays[3], *arrays[:3], dense["vis"], dense["scale"], np.float64, **kw)
    stored = np.dtype(BFLOAT16 if dtype == "bfloat16" else dtype)
    inputs = tuple(x if x is None or x.dtype.kind == "i" else x.astype(stored) for x in arrays)
    lse_stored = lse.astype(np.float64 if dtype == "float64" else np.float32)
    got, rows, cols = sampled(spec, dense["scale"], dtype, dense["sinks"], inputs, o.astype(stored), lse_stored)
    want = {"o": o[1][rows], "lse": lse[1][:, rows], "dq": grads[0][1][rows],
            "dk": grads[1][1][cols], "dv": grads[2][1][cols]}
    for key, ref in want.items():
        assert got[key].shape == ref.shape, (key, got[key].shape, ref.shape)
        assert got[key].dtype == stored or (key == "lse" and dtype != "float64"), (key, got[key].dtype)
        err = max_err(got[key], ref)
        assert err <= limit, (name, dtype, key, err)
    if name.startswith("short-kv"):
        unseen = rows < 20
        assert unseen.any() and np.isneginf(got["lse"][:, unseen]).all() and not got["o"][unseen].any()
