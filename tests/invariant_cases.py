"""Rank-side driver: the bitwise matrix of ``invariant=True`` (issue 37).

    mpirun -n P python tests/invariant_cases.py CASES.json

Every rank builds a case's global inputs (``ring_cases.make_inputs``, plus sinks, ALiBi
slopes, NaN/Inf where asked), then runs ``ring_attention(..., invariant=True,
return_max_logit=True)`` and its backward under every placement that applies at this P:
each layout whose shards are whole 64-token tiles (:func:`placements_at`), a random
placement of whole tiles by explicit positions (tiles shuffled over the ranks, rows shuffled
inside each), and head x ring ``U = 2`` over such a placement.  Rank 0 gathers ``o, lse, dq,
dk, dv`` in global order (``max_logit``, ``dsinks`` as returned) and reports one sha256 per
output array and placement as the case's message (JSON); the case fails when the placements
of this launch disagree.  ``tests/test_invariant.py`` compares the hashes across launches
(P = 1, 2, 3, 4, 6, 8).  With ``check`` rank 0 also holds the first placement's outputs to
the float64 dense reference under the tolerance rule (and, with ``nonfinite``, checks which
rows are NaN).  Kind ``errors``: a shard that is not whole tiles is one ConfigError on every
rank.
"""

import hashlib
import json
import os
import sys

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reference  # noqa: E402
from case_driver import agreed_error, run_file  # noqa: E402
from ring_cases import Assignment, make_inputs  # noqa: E402
from variant_cases import make_alibi, make_sinks  # noqa: E402
import ringmpi  # noqa: E402
from ringmpi import Layout  # noqa: E402
from ringmpi.core.global_tiles import TILE, shard_problem  # noqa: E402

OUTPUTS = ("o", "lse", "max_logit", "dq", "dk", "dv", "dsinks")


def whole_tiles(lay, size) -> bool:
    return all(shard_problem("x", lay.indices(r), lay.n) is None for r in range(size))


def tile_assignment(rng, n, size):
    """Whole tiles of ``n`` positions over ``size`` ranks: tiles shuffled, cut at random places
    (a rank may hold none), each rank's rows shuffled."""
    tiles = rng.permutation(-(-n // TILE))
    cuts = np.sort(rng.integers(0, len(tiles) + 1, size=size - 1))
    parts = []
    for chunk in np.split(tiles, cuts):
        rows = np.concatenate([np.arange(t * TILE, min(n, t * TILE + TILE)) for t in chunk] or [np.zeros(0, int)])
        parts.append(rng.permutation(rows).astype(np.int64))
    return Assignment(parts)


def placements_at(case, size):
    """``[(name, lay_q, lay_kv, head_parallel)]``: what applies at ``size`` ranks."""
    n_q, n_kv = case["n_q"], case.get("n_kv", case["n_q"])
    out = []
    for kind in case.get("layouts", ("contiguous", "zigzag", "striped")):
        lq, lkv = Layout(kind, n_q, size), Layout(kind, n_kv, size)
        if whole_tiles(lq, size) and whole_tiles(lkv, size):
            out.append((kind, lq, lkv, 1))
    rng = np.random.default_rng(case["seed"] + 1000 * size)
    tiles = (tile_assignment(rng, n_q, size), tile_assignment(rng, n_kv, size))
    out.append(("tiles", *tiles, 1))
    if size % 2 == 0 and case["H"] % 2 == 0 and case.get("head_parallel", True):
        out.append(("tiles-U2", *tiles, 2))
    return out


def inputs(case):
    q, k, v, do, seg_q, seg_kv = make_inputs(case)
    for name, x in (("q", q), ("k", k), ("v", v)):
        for b, t, h, d, value in case.get("nonfinite", {}).get(name, []):
            x[b, t, h, d] = value
    return q, k, v, do, seg_q, seg_kv, make_sinks(case, q.shape[2]), make_alibi(case, q.shape[2])


def call_kw(case, comm, rank, lay_q, lay_kv, seg_q, seg_kv, sinks, alibi, u):
    kw = dict(comm=comm, causal=case.get("causal", False), backend="numpy", invariant=True, head_parallel=u,
              softcap=case.get("softcap"), softmax_scale=case.get("scale"))
    if case.get("window") is not None:
        kw["window"] = tuple(case["window"])
    if isinstance(lay_q, Assignment):
        kw.update(positions_q=lay_q.indices(rank), positions_kv=lay_kv.indices(rank))
    else:
        kw["layout"] = lay_q.kind
    if seg_q is not None:
        kw.update(segment_ids_q=lay_q.shard(seg_q, rank), segment_ids_kv=lay_kv.shard(seg_kv, rank))
    if case.get("dropout"):
        kw.update(dropout_p=case["dropout"], dropout_seed=case["dropout_seed"])
    if sinks is not None:
        kw["sinks"] = sinks
    if alibi is not None:
        kw["alibi_slopes"] = alibi
    return kw


def digest(x) -> str:
    x = np.ascontiguousarray(x)
    return hashlib.sha256(f"{x.dtype} {x.shape} ".encode() + x.tobytes()).hexdigest()


def run_placement(comm, case, data, lay_q, lay_kv, u):
    rank, size = comm.Get_rank(), comm.Get_size()
    q, k, v, do, seg_q, seg_kv, sinks, alibi = data
    kw = call_kw(case, comm, rank, lay_q, lay_kv, seg_q, seg_kv, sinks, alibi, u)
    args = [lay.shard(x, rank) for lay, x in ((lay_q, q), (lay_kv, k), (lay_kv, v))]
    o, lse, max_logit = ringmpi.ring_attention(*args, return_max_logit=True, **kw)
    grads = ringmpi.ring_attention_backward(lay_q.shard(do, rank), *args, o, lse, **kw)
    mine = dict(o=o, lse=lse, dq=grads[0], dk=grads[1], dv=grads[2])
    every = comm.gather(mine, root=0)
    if rank != 0:
        return None
    out = dict(max_logit=np.asarray(max_logit))
    if sinks is not None:
        out["dsinks"] = np.asarray(grads[3])
    for name, lay, axis in (("o", lay_q, 1), ("lse", lay_q, 2), ("dq", lay_q, 1), ("dk", lay_kv, 1),
                            ("dv", lay_kv, 1)):
        out[name] = lay.unshard([e[name] for e in every], axis=axis)
    return out


def accuracy(case, data, got):
    """``(ok, messages)``: the tolerance rule against the float64 dense reference."""
    q, k, v, do, seg_q, seg_kv, sinks, alibi = data
    window = None if case.get("window") is None else tuple(case["window"])
    vis = reference.visible(q.shape[1], k.shape[1], case.get("causal", False), window, seg_q, seg_kv)
    scale = case.get("scale") or 1.0 / np.sqrt(q.shape[3])
    drop = None
    if case.get("dropout"):
        drop = reference.dropout_factors(case["dropout_seed"], case["dropout"], q.shape[0], q.shape[2],
                                         q.shape[1], k.shape[1])
    opts = dict(sinks=sinks, softcap=case.get("softcap"), drop=drop, alibi=alibi)
    ref_o, ref_lse = reference.dense_forward(q, k, v, vis, scale, np.float64, **opts)
    naive_o, naive_lse = reference.dense_forward(q, k, v, vis, scale, q.dtype, **opts)
    ref_m = reference.dense_max_logit(q, k, vis, scale, np.float64, case.get("softcap"), alibi)
    naive_m = reference.dense_max_logit(q, k, vis, scale, q.dtype, case.get("softcap"), alibi)
    refs = reference.dense_backward(do, q, k, v, vis, scale, np.float64, **opts)
    naives = reference.dense_backward(do, q, k, v, vis, scale, q.dtype, **opts)
    checks = [("o", ref_o, naive_o, False), ("lse", ref_lse, naive_lse, False), ("max_logit", ref_m, naive_m, False),
              ("dq", refs[0], naives[0], True), ("dk", refs[1], naives[1], True), ("dv", refs[2], naives[2], True)]
    if sinks is not None:
        checks.append(("dsinks", refs[3], naives[3], True))
    results = [reference.tolerance_check(name, got[name], ref, naive, grad) for name, ref, naive, grad in checks]
    return all(ok for ok, _ in results), [msg for _, msg in results]


def nonfinite_rows(case, data, got):
    """The rows and keys that must be NaN (a row that sees a NaN/Inf value, the keys a
    NaN/Inf row sees) are, and every other value is finite."""
    q, k, v, do, seg_q, seg_kv, sinks, alibi = data
    window = None if case.get("window") is None else tuple(case["window"])
    vis = np.broadcast_to(reference.visible(q.shape[1], k.shape[1], case.get("causal", False), window, seg_q, seg_kv),
                          (q.shape[0], q.shape[1], k.shape[1]))
    group = q.shape[2] // k.shape[2]
    problems = []
    for h in range(q.shape[2]):
        hkv = h // group
        bad_q = ~np.isfinite(q[:, :, h].astype(np.float64)).all(axis=2)          # (B, N_q)
        bad_kv = ~(np.isfinite(k[:, :, hkv].astype(np.float64)).all(axis=2)
                   & np.isfinite(v[:, :, hkv].astype(np.float64)).all(axis=2))    # (B, N_kv)
        row_nan = (vis & bad_kv[:, None, :]).any(axis=2) | (bad_q & vis.any(axis=2))
        o_nan = np.isnan(got["o"][:, :, h].astype(np.float64)).any(axis=2)
        if not np.array_equal(o_nan, row_nan):
            problems.append(f"head {h}: o NaN rows {np.argwhere(o_nan).tolist()}, want {np.argwhere(row_nan).tolist()}")
        if not np.isfinite(got["o"][:, :, h].astype(np.float64)[~row_nan]).all():
            problems.append(f"head {h}: a row that sees no NaN/Inf is not finite")
    return not problems, problems


def run_case(comm, case):
    rank, size = comm.Get_rank(), comm.Get_size()
    data = inputs(case)
    hashes, first = {}, None
    for name, lay_q, lay_kv, u in placements_at(case, size):
        got = run_placement(comm, case, data, lay_q, lay_kv, u)
        if rank == 0:
            hashes[name] = {key: digest(got[key]) for key in OUTPUTS if key in got}
            first = first or got
    if rank != 0:
        return None
    messages, ok = [], True
    distinct = {json.dumps(h, sort_keys=True) for h in hashes.values()}
    if len(distinct) > 1:
        ok = False
        names = list(hashes)
        diff = sorted({key for n in names for key in hashes[n] if hashes[n][key] != hashes[names[0]][key]})
        messages.append(f"placements disagree at P={size} on {diff}")
    if case.get("check"):
        good, notes = accuracy(case, data, first) if not case.get("nonfinite") else nonfinite_rows(case, data, first)
        ok &= good
        messages += notes
    return ok, json.dumps({"hashes": hashes, "notes": messages})


def errors_case(comm, case):
    """Shards that are not whole tiles: one ConfigError on every rank."""
    size = comm.Get_size()
    rng = np.random.default_rng(case["seed"])
    q = rng.standard_normal((1, case["n_q"] // size, 2, 8)).astype(np.float32)
    problem = agreed_error(comm, lambda: ringmpi.ring_attention(q, q[:, :, :1], q[:, :, :1], comm=comm,
                                                                 invariant=True, backend="numpy"),
                           "whole 64-token tiles")
    return problem is None, problem or "ConfigError on every rank"


def main():
    run_file(MPI.COMM_WORLD, {"errors": errors_case}, run_case)


if __name__ == "__main__":
    main()
