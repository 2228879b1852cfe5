"""Rank-side driver: attention sinks, logit softcap and max logit (issue 13, parts 1, 2, 4).

    mpirun -n P python tests/mpi/variant_cases.py CASES.json

Every rank builds the global inputs of ``ring_cases.make_inputs`` (plus sinks
from the seed), runs ``ring_attention(..., sinks=, softcap=, return_max_logit=True)``
and the backward on its shard; rank 0 gathers and checks ``o``, ``lse``, the
max logits, ``dq, dk, dv`` and ``dsinks`` against the float64 dense reference
of ``reference.py`` (sinks as an extra zero-value column, softcap through tanh)
under the tolerance rule, and that the per-head results are the same bits on
every rank.  Other kinds: ``errors`` (ConfigError agreed on every rank) and
``fd`` (float64 finite differences through the ring, dsinks included).
"""

import os
import sys

import numpy as np
from mpi4py import MPI

from case_driver import agreed_error, run_file
import reference
from finite_differences import ring_fd_worst
from ring_cases import BACKEND, converters, make_inputs, placements, position_kw, window_of
import ringmpi
from ringmpi import Layout, RingContext


def make_sinks(case, heads):
    if not case.get("sinks"):
        return None
    rng = np.random.default_rng(case.get("seed", 0) + 77)
    return (rng.standard_normal(heads) * case.get("sink_scale", 2.0)).astype(case.get("sink_dtype", "float32"))


def make_alibi(case, heads):
    """ALiBi slopes (H,) float32 of a case with ``alibi``: the usual geometric ones, 2^(-8 (h+1) / H)."""
    if not case.get("alibi"):
        return None
    return (2.0 ** (-8.0 * np.arange(1, heads + 1) / heads) * case.get("alibi_scale", 1.0)).astype(np.float32)


def inputs(case):
    q, k, v, do, seg_q, seg_kv = make_inputs(case)
    if case.get("disjoint") and seg_q is not None:
        seg_kv = seg_kv + 1000  # no query sees any key
    return q, k, v, do, seg_q, seg_kv, make_sinks(case, q.shape[2])


def options(case, comm, rank, lay_q, lay_kv, seg_q, seg_kv, sinks):
    window = window_of(case)
    context = RingContext(comm, layout=case["layout"], backend=BACKEND, head_parallel=case.get("head_parallel", 1))
    kw = dict(causal=case.get("causal", False), window=window, softmax_scale=case.get("scale"),
              softcap=case.get("softcap") or 0.0, context=context, **position_kw(lay_q, lay_kv, rank))
    if case.get("dropout"):
        kw.update(dropout_p=case["dropout"], dropout_seed=case["dropout_seed"])
    if seg_q is not None:
        kw["segment_ids"] = (lay_q.shard(seg_q, rank), lay_kv.shard(seg_kv, rank))
    if sinks is not None:
        kw["sinks"] = converters()[0](sinks)
    if case.get("alibi"):
        kw["alibi_slopes"] = make_alibi(case, case["H"])
    return kw, window


def run_case(comm, case):
    rank, size = comm.Get_rank(), comm.Get_size()
    q, k, v, do, seg_q, seg_kv, sinks = inputs(case)
    lay_q, lay_kv = placements(case, q.shape[1], k.shape[1], size, seg_q)
    kw, window = options(case, comm, rank, lay_q, lay_kv, seg_q, seg_kv, sinks)
    to_backend, to_host = converters()
    args = [to_backend(lay.shard(x, rank)) for lay, x in ((lay_q, q), (lay_kv, k), (lay_kv, v))]
    o, lse, max_logit = ringmpi.ring_attention(*args, return_max_logit=True, **kw)
    o2, lse2, no_max = ringmpi.ring_attention(*args, **kw)  # without the max logit: the same o, lse
    results = dict(o=to_host(o), lse=to_host(lse), max_logit=np.asarray(max_logit))
    results["same_without_max"] = bool(np.allclose(to_host(o2), results["o"], rtol=1e-5, atol=1e-6, equal_nan=True)
                                       and no_max is None)
    grads = ringmpi.ring_attention_backward(to_backend(lay_q.shard(do, rank)), *args, (o, lse), **kw)
    if len(grads) != 4 or (grads.dsinks is None) != (sinks is None):  # dsinks None exactly without sinks
        results["grads_len"] = f"{len(grads)} fields, dsinks {type(grads[-1]).__name__}"
    results.update(dq=to_host(grads.dq), dk=to_host(grads.dk), dv=to_host(grads.dv))
    if sinks is not None and grads.dsinks is not None:
        results["dsinks"] = np.asarray(grads.dsinks)
    if case.get("own_share"):  # reduce_dsinks=False: this rank's share of dsinks, dq/dk/dv unchanged
        own = ringmpi.ring_attention_backward(to_backend(lay_q.shard(do, rank)), *args, (o, lse),
                                              **dict(kw, context=kw["context"].replace(reduce_dsinks=False)))
        results["dsinks_share"] = np.asarray(own.dsinks)
        results["same_grads_own"] = all(to_host(a).tobytes() == to_host(b).tobytes()
                                        for a, b in zip(own[:3], grads[:3]))
    gathered = comm.gather(results, root=0)
    if rank != 0:
        return None
    return check(case, gathered, lay_q, lay_kv, q, k, v, do, seg_q, seg_kv, window, sinks)


def sink_naive(naive, sinks):
    """The naive same-dtype dsinks: 16-bit sinks get their gradient in their own dtype (computed
    in float32), so the plain computation's gradient is rounded to it too."""
    if sinks.dtype.itemsize > 2:
        return naive
    return naive.astype(np.float32).astype(sinks.dtype).astype(np.float64)


def check(case, gathered, lay_q, lay_kv, q, k, v, do, seg_q, seg_kv, window, sinks):
    messages, ok = [], True
    if any("grads_len" in g for g in gathered):
        return False, f"backward returned {gathered[0]['grads_len']} (sinks given: {sinks is not None})"
    if not all(g["same_without_max"] for g in gathered):
        ok = False
        messages.append("return_max_logit changed o (or max_logit not None without it)")
    dtype = q.dtype
    softcap = case.get("softcap")
    scale = case.get("scale") or 1.0 / np.sqrt(q.shape[3])
    vis = reference.visible(q.shape[1], k.shape[1], case.get("causal", False), window, seg_q, seg_kv)
    drop = None
    if case.get("dropout"):  # the mask drawn straight from Philox (reference.dropout_factors)
        drop = reference.dropout_factors(case["dropout_seed"], case["dropout"], q.shape[0], q.shape[2],
                                         q.shape[1], k.shape[1])
    alibi = make_alibi(case, q.shape[2])
    opts = dict(sinks=sinks, softcap=softcap, drop=drop, alibi=alibi)
    ref_o, ref_lse = reference.dense_forward(q, k, v, vis, scale, np.float64, **opts)
    naive_o, naive_lse = reference.dense_forward(q, k, v, vis, scale, dtype, **opts)
    ref_m = reference.dense_max_logit(q, k, vis, scale, np.float64, softcap, alibi)
    naive_m = reference.dense_max_logit(q, k, vis, scale, dtype, softcap, alibi)
    o = lay_q.unshard([g["o"] for g in gathered], axis=1)
    lse = lay_q.unshard([g["lse"] for g in gathered], axis=2)
    per_head = ["max_logit"] + (["dsinks"] if sinks is not None else [])
    for name in per_head:
        if any(g[name].tobytes() != gathered[0][name].tobytes() for g in gathered):
            ok = False
            messages.append(f"{name} differs between ranks")
    ml = gathered[0]["max_logit"]
    want_ml_dtype = np.float64 if dtype == np.float64 else np.float32
    if ml.shape != (q.shape[2],) or ml.dtype != want_ml_dtype:
        ok = False
        messages.append(f"max_logit {ml.dtype} {ml.shape}")
    checks = [("o", o, ref_o, naive_o, False), ("lse", lse, ref_lse, naive_lse, False),
              ("max_logit", ml, ref_m, naive_m, False)]
    refs = reference.dense_backward(do, q, k, v, vis, scale, np.float64, **opts)
    naives = reference.dense_backward(do, q, k, v, vis, scale, dtype, **opts)
    for i, name in enumerate(("dq", "dk", "dv")):
        lay = lay_q if name == "dq" else lay_kv
        checks.append((name, lay.unshard([g[name] for g in gathered], axis=1), refs[i], naives[i], True))
    if sinks is not None:
        ds = gathered[0]["dsinks"]
        if ds.dtype != sinks.dtype or ds.shape != sinks.shape:
            ok = False
            messages.append(f"dsinks {ds.dtype} {ds.shape}, sinks {sinks.dtype} {sinks.shape}")
        checks.append(("dsinks", ds, refs[3], sink_naive(naives[3], sinks), True))
    if case.get("own_share"):
        if not all(g["same_grads_own"] for g in gathered):
            ok = False
            messages.append("reduce_dsinks=False changed dq, dk or dv")
        shares = np.array([g["dsinks_share"] for g in gathered])
        checks.append(("sum of dsinks shares", shares.astype(np.float64).sum(axis=0), refs[3],
                       sink_naive(naives[3], sinks), True))
    for name, ours, ref, naive, grad in checks:
        good, msg = reference.tolerance_check(name, ours, ref, naive, gradient=grad)
        ok &= good
        messages.append(msg)
    if case.get("disjoint"):
        want = sinks is not None
        if not (np.isneginf(ml).all() and (np.isfinite(lse).all() if want else np.isneginf(lse).all())):
            ok = False
            messages.append(f"disjoint: max_logit {ml}, lse finite {np.isfinite(lse).all()}")
    return ok, "; ".join(messages)


def fd_case(comm, case):
    """float64 finite differences of sum(o * do) through the ring: dq, dk, dv and dsinks."""
    rank, size = comm.Get_rank(), comm.Get_size()
    case = dict(case, dtype="float64", sink_dtype="float64")
    q, k, v, do, seg_q, seg_kv, sinks = inputs(case)
    lay_q, lay_kv = Layout(case["layout"], q.shape[1], size), Layout(case["layout"], k.shape[1], size)
    kw, _ = options(case, comm, rank, lay_q, lay_kv, seg_q, seg_kv, sinks)
    kw.pop("sinks", None)
    worst = ring_fd_worst(comm, lay_q, lay_kv, q, k, v, do, kw, converters(), np.random.default_rng(321),
                          probes=3, eps=1e-6, sinks=sinks)
    return worst < 1e-6, f"finite-difference worst relative error {worst:.3g}"


def decode_case(comm, case):
    """decode_attention with softcap (and sinks) over a sharded cache: S_new new tokens at
    the end of an N_kv cache, against the dense reference (bottom-right causal, window)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    q, k, v, _, _, _, sinks = inputs(case)
    lay = Layout(case["layout"], k.shape[1], size)
    window = window_of(case)
    to_backend, to_host = converters()
    o, lse, _ = ringmpi.decode_attention(to_backend(q), to_backend(lay.shard(k, rank)), to_backend(lay.shard(v, rank)),
                                         causal=True, window=window, softcap=case.get("softcap") or 0.0,
                                         sinks=None if sinks is None else to_backend(sinks),
                                         alibi_slopes=make_alibi(case, q.shape[2]),
                                         context=RingContext(comm, layout=case["layout"], backend=BACKEND))
    o, lse = to_host(o), to_host(lse)
    same = comm.allgather(o.tobytes() + lse.tobytes())
    if rank != 0:
        return None
    scale = 1.0 / np.sqrt(q.shape[3])
    vis = reference.visible(q.shape[1], k.shape[1], True, window)
    opts = dict(sinks=sinks, softcap=case.get("softcap"), alibi=make_alibi(case, q.shape[2]))
    ref = reference.dense_forward(q, k, v, vis, scale, np.float64, **opts)
    naive = reference.dense_forward(q, k, v, vis, scale, q.dtype, **opts)
    ok, messages = len(set(same)) == 1, [] if len(set(same)) == 1 else ["ranks differ"]
    for name, ours, r, nv in (("o", o, ref[0], naive[0]), ("lse", lse, ref[1], naive[1])):
        good, msg = reference.tolerance_check(name, ours, r, nv)
        ok &= good
        messages.append(msg)
    return ok, "; ".join(messages)


def file_case(comm, case):
    """``ringmpi run --sinks-dataset --softcap --max-logit [--backward]`` on an HDF5 file (in
    process, every rank), in several passes, its files beside the cases file; rank 0 checks the
    output datasets."""
    import h5py
    from ringmpi.cli.run import run
    from ringmpi.runtime.errors import ConfigError

    rank = comm.Get_rank()
    case = dict(case, sinks=True)
    q, k, v, do, _, _, sinks = inputs(case)
    where = os.path.dirname(os.path.abspath(sys.argv[1]))
    src, dst = (os.path.join(where, f"{case['id']}.{x}.h5") for x in ("in", "out"))
    if rank == 0:
        with h5py.File(src, "w") as f:
            for name, x in (("q", q), ("k", k), ("v", v), ("do", do), ("heads_sinks", sinks)):
                f[name] = x
            f["bad_sinks"] = np.append(sinks, 1.0)
    comm.Barrier()
    argv = [src, "-o", dst, "--backend", BACKEND, "--layout", case["layout"], "--softcap", str(case["softcap"]),
            "--sinks-dataset", case.get("dataset", "heads_sinks"), "--max-logit", "--backward", "--overwrite"]
    argv += (["--causal"] if case.get("causal") else []) + case.get("argv", [])
    saved = os.environ.get("RINGMPI_PASS_BYTES")
    os.environ["RINGMPI_PASS_BYTES"] = str(case.get("pass_bytes", 1 << 30))
    try:
        run.main(args=argv, standalone_mode=False)
        error = None
    except ConfigError as exc:
        error = str(exc)
    finally:
        os.environ.pop("RINGMPI_PASS_BYTES") if saved is None else os.environ.update(RINGMPI_PASS_BYTES=saved)
    errors = comm.allgather(error)
    verified = None
    if error is None and not case.get("expect_error"):  # ringmpi verify models sinks, softcap, max logit
        import contextlib
        import io
        from ringmpi.cli.verify import verify
        verified = []
        for extra in ([], ["--sample", "7", "--seed", "2"]):  # whole, then sampled rows dealt to the ranks
            text = io.StringIO()
            try:
                with contextlib.redirect_stdout(text):
                    verify.main(args=[src, dst] + extra, standalone_mode=False)
                verified.append((0, text.getvalue()))
            except SystemExit as exc:
                verified.append((exc.code, text.getvalue()))
        verified, sampled = verified
    if rank != 0:
        return None
    if case.get("expect_error"):
        ok = errors[0] is not None and case["expect_error"] in errors[0] and len(set(errors)) == 1
        return ok and not os.path.exists(dst), f"errors {errors}, output left: {os.path.exists(dst)}"
    if error is not None:
        return False, f"run failed: {errors}"
    with h5py.File(dst, "r") as f:
        out = {name: f[name][()] for name in f}
        attrs = dict(f.attrs)
    if any(name.endswith("_partial") for name in out):
        return False, f"partial datasets left: {sorted(out)}"
    softcap, scale = case["softcap"], 1.0 / np.sqrt(q.shape[3])
    vis = reference.visible(q.shape[1], k.shape[1], case.get("causal", False))
    opts = dict(sinks=sinks, softcap=softcap)
    ref, naive = (reference.dense_forward(q, k, v, vis, scale, dt, **opts) for dt in (np.float64, q.dtype))
    refg, naiveg = (reference.dense_backward(do, q, k, v, vis, scale, dt, **opts) for dt in (np.float64, q.dtype))
    refm, naivem = (reference.dense_max_logit(q, k, vis, scale, dt, softcap) for dt in (np.float64, q.dtype))
    ok = np.array_equal(out["sinks"], sinks) and attrs["softcap"] == softcap and attrs["max_logit"]
    ok &= verified[0] in (0, None) and "dsinks" in verified[1] and "max_logit" in verified[1]
    ok &= sampled[0] in (0, None) and "PASS: every sampled row" in sampled[1] \
        and "max_logit not checked" in sampled[1] and "dsinks   not checked" in sampled[1]
    messages = [f"sinks stored {np.array_equal(out['sinks'], sinks)}, attrs softcap {attrs['softcap']}",
                f"verify exit {verified[0]}: {verified[1]}", f"verify --sample exit {sampled[0]}: {sampled[1]}"]
    for name, r, nv, grad in (("o", ref[0], naive[0], False), ("lse", ref[1], naive[1], False),
                              ("max_logit", refm, naivem, False), ("dq", refg[0], naiveg[0], True),
                              ("dk", refg[1], naiveg[1], True), ("dv", refg[2], naiveg[2], True),
                              ("dsinks", refg[3], naiveg[3], True)):
        good, msg = reference.tolerance_check(name, out[name], r, nv, gradient=grad)
        ok &= good
        messages.append(msg)
    return ok, "; ".join(messages)


def torch_case(comm, case):
    """ringmpi.torch.ring_attention with sinks (a tensor with grad) and softcap on CPU tensors:
    o and the gradients of sum(o * do), dsinks included, against the dense reference."""
    import torch

    import ringmpi.torch as rt

    rank, size = comm.Get_rank(), comm.Get_size()
    q, k, v, do, _, _, sinks = inputs(case)
    lay_q, lay_kv = placements(case, q.shape[1], k.shape[1], size)
    leaves = [torch.from_numpy(np.ascontiguousarray(lay.shard(x, rank))).requires_grad_(True)
              for lay, x in ((lay_q, q), (lay_kv, k), (lay_kv, v))]
    # 16-bit sinks (bfloat16 has no NumPy view in torch): through float32, exact
    sinks_t = torch.from_numpy(sinks.astype(np.float32)).to(getattr(torch, str(sinks.dtype))).requires_grad_(True)
    positions = {n: tuple(torch.from_numpy(x) for x in pair) for n, pair in position_kw(lay_q, lay_kv, rank).items()}
    o = rt.ring_attention(*leaves, causal=case.get("causal", False), sinks=sinks_t, softcap=case["softcap"],
                          alibi_slopes=make_alibi(case, q.shape[2]), context=RingContext(comm, layout=case["layout"]),
                          **positions).o
    (o * torch.from_numpy(np.ascontiguousarray(lay_q.shard(do, rank)))).sum().backward()
    mine = dict(o=o.detach().numpy(), dq=leaves[0].grad.numpy(), dk=leaves[1].grad.numpy(),
                dv=leaves[2].grad.numpy(), dsinks=sinks_t.grad.float().numpy(),
                sinks_grad_dtype=str(sinks_t.grad.dtype))
    gathered = comm.gather(mine, root=0)
    if rank != 0:
        return None
    scale = 1.0 / np.sqrt(q.shape[3])
    vis = reference.visible(q.shape[1], k.shape[1], case.get("causal", False))
    opts = dict(sinks=sinks, softcap=case["softcap"], alibi=make_alibi(case, q.shape[2]))
    ref, naive = (reference.dense_forward(q, k, v, vis, scale, dt, **opts) for dt in (np.float64, q.dtype))
    refg, naiveg = (reference.dense_backward(do, q, k, v, vis, scale, dt, **opts) for dt in (np.float64, q.dtype))
    ok, messages = True, []
    for i, (name, lay, r, nv) in enumerate((("o", lay_q, ref[0], naive[0]), ("dq", lay_q, refg[0], naiveg[0]),
                                            ("dk", lay_kv, refg[1], naiveg[1]), ("dv", lay_kv, refg[2], naiveg[2]))):
        ours = lay.unshard([g[name] for g in gathered], axis=1)
        good, msg = reference.tolerance_check(name, ours, r, nv, gradient=i > 0)
        ok &= good
        messages.append(msg)
    # each rank's sinks.grad is its own share (the replicated-parameter convention): their sum is dsinks
    if sinks.dtype.itemsize > 2:
        dsinks = np.sum([g["dsinks"] for g in gathered], axis=0)
        good, msg = reference.tolerance_check("dsinks", dsinks, refg[3], naiveg[3], gradient=True)
    else:  # each share is rounded to the sinks' dtype on its rank: check every rank's share
        shares_ref, shares_naive = [], []
        for r in range(size):  # rank r's share: the gradient with do zero outside its queries
            do_r = np.zeros_like(do)
            do_r[:, lay_q.indices(r)] = do[:, lay_q.indices(r)]
            shares_ref.append(reference.dense_backward(do_r, q, k, v, vis, scale, np.float64, **opts)[3])
            shares_naive.append(sink_naive(reference.dense_backward(do_r, q, k, v, vis, scale, q.dtype, **opts)[3],
                                           sinks))
        good, msg = reference.tolerance_check("dsinks shares", np.array([g["dsinks"] for g in gathered]),
                                              np.array(shares_ref), np.array(shares_naive), gradient=True)
    if any(g["sinks_grad_dtype"] != str(sinks_t.dtype) for g in gathered):
        good, msg = False, f"sinks.grad dtype {gathered[0]['sinks_grad_dtype']}, sinks {sinks_t.dtype}; " + msg
    return ok and good, "; ".join(messages + [msg])


def errors_case(comm, case):
    """Bad sinks/softcap: one ConfigError with the same message on every rank, before any compute;
    softcap=0.0 is off (the bits of a call without softcap)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    q, k, v, _, _, _, _ = inputs(dict(case, sinks=False))
    lay = Layout(case["layout"], q.shape[1], size)
    to_backend, _ = converters()
    args = [to_backend(lay.shard(x, rank)) for x in (q, k, v)]
    heads = q.shape[2]
    good = np.zeros(heads, dtype=np.float32)
    nan_on_last = good.copy()
    if rank == size - 1:
        nan_on_last[1] = np.nan
    attempts = {
        "sinks shape": (dict(sinks=np.zeros(heads + 1, np.float32)), f"sinks must have shape (H,) = ({heads},)"),
        "sinks dtype": (dict(sinks=np.zeros(heads, np.int32)), "sinks must be one of float16, bfloat16"),
        "sinks NaN on one rank": (dict(sinks=nan_on_last), "sinks must be finite"),
        "sinks differ": (dict(sinks=good + rank), "ranks disagree on sinks or softcap"),
        "softcap negative": (dict(softcap=-1.0), "softcap must be finite and >= 0 (0.0: off)"),
        "softcap inf": (dict(softcap=float("inf")), "softcap must be finite and >= 0 (0.0: off)"),
        "softcap differs": (dict(softcap=1.0 + rank), "ranks disagree on sinks or softcap"),
    }
    if size == 1:
        for what in ("sinks NaN on one rank", "sinks differ", "softcap differs"):
            attempts.pop(what)
        attempts["sinks NaN"] = (dict(sinks=np.full(heads, np.nan, np.float32)), "sinks must be finite")
    context = RingContext(comm, layout=case["layout"], backend=BACKEND)
    off = ringmpi.ring_attention(*args, softcap=0.0, context=context)
    plain = ringmpi.ring_attention(*args, context=context)
    problems = [] if all(_bits(a) == _bits(b) for a, b in zip(off, plain)) else ["softcap=0.0 is not off"]
    for what, (extra, want) in attempts.items():
        extra = {n: (to_backend(x) if isinstance(x, np.ndarray) else x) for n, x in extra.items()}
        lse0 = to_backend(np.zeros((q.shape[0], heads, args[0].shape[1]), np.float32))
        calls = {"forward": lambda: ringmpi.ring_attention(*args, context=context, **extra),
                 "backward": lambda: ringmpi.ring_attention_backward(
                     args[0], *args, (args[0], lse0), context=context, **extra)}
        for call, fn in calls.items():
            problem = agreed_error(comm, fn, want)
            if problem:
                problems.append(f"{what} ({call}): {problem}")
    return not problems, "; ".join(problems) or f"{2 * len(attempts)} errors raised alike on {size} ranks"


def _bits(x):
    return None if x is None else converters()[1](x).tobytes()


def nan_max_case(comm, case):
    """``SoftmaxState.local_max_logit`` reduced over the ranks (``ring_passes.reduce_max_logit``):
    a NaN on any one rank gives NaN on every rank (``MPI.MAX`` alone may drop it), a head of
    -inf everywhere gives -inf."""
    from ringmpi.backends.numpy_backend import NumpyBackend
    from ringmpi.core.online_softmax import SoftmaxState
    from ringmpi.parallel.ring_passes import reduce_max_logit

    rank, size = comm.Get_rank(), comm.Get_size()
    problems = []
    for nan_rank in range(size):
        m = np.random.default_rng(100 * nan_rank + rank).standard_normal((2, 3, 4)).astype(np.float32)
        m[:, 2] = -np.inf
        if rank == nan_rank:
            m[1, 1, 3] = np.nan
        state = SoftmaxState(NumpyBackend(), m.shape, 1, m.dtype)
        state.m[...] = m
        out = reduce_max_logit(comm, state.local_max_logit())
        want0 = max(comm.allgather(float(m[:, 0].max())))
        if not (out[0] == np.float32(want0) and np.isnan(out[1]) and out[2] == -np.inf and out.dtype == m.dtype):
            problems.append(f"NaN on rank {nan_rank}: rank {rank} got {out}")
    problems = [p for ps in comm.allgather(problems) for p in ps]
    return not problems, "; ".join(problems) or f"NaN from each of {size} ranks reached every rank"


def main():
    from ring_cases import packed_case
    kinds = {"fd": fd_case, "errors": errors_case, "decode": decode_case, "file": file_case, "torch": torch_case,
             "nan_max": nan_max_case, "packed": packed_case}
    run_file(MPI.COMM_WORLD, kinds, run_case)


if __name__ == "__main__":
    main()
