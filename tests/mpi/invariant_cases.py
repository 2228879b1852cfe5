"""Rank-side driver: the bitwise matrix of ``invariant=True`` (issue 37).

    mpirun -n P python tests/mpi/invariant_cases.py CASES.json

Every rank builds a case's global inputs (``ring_cases.make_inputs``, plus sinks, ALiBi
slopes, NaN/Inf where asked), then runs ``ring_attention(..., return_max_logit=True)`` (a
context with ``invariant=True``) and its backward under every placement that applies at this P:
each layout whose shards are whole 64-token tiles (:func:`placements_at`), a random
placement of whole tiles by explicit positions (tiles shuffled over the ranks, rows shuffled
inside each), and head x ring ``U = 2`` over such a placement.  Rank 0 gathers ``o, lse, dq,
dk, dv`` in global order (``max_logit``, ``dsinks`` as returned) and reports one sha256 per
output array and placement as the case's message (JSON); the case fails when the placements
of this launch disagree.  ``tests/mpi/test_invariant.py`` compares the hashes across launches
(P = 1, 2, 3, 4, 6, 8).  With ``check`` rank 0 also holds the first placement's outputs to
the float64 dense reference under the tolerance rule (and, with ``nonfinite``, checks which
rows are NaN).  A case may add entry points that must give the same bits as the library
calls of the same launch: ``decode`` (``decode_attention`` with ``invariant=True`` for the last
``decode`` tokens over the sharded cache: their ``o, lse`` rows), ``torch`` (``ringmpi.torch``
with autograd: ``o, lse, dq, dk, dv``; where ``torch`` lists this P) and ``file`` (``ringmpi run
--invariant --backward`` on an HDF5 file: ``o, lse, dq, dk, dv``).  Kind ``errors``: a shard
that is not whole tiles is one ConfigError on every rank.  A case's ``backend`` (default
``numpy``) runs the library calls (``tests/gpu/test_gpu_invariant.py``: ``cupy``).
"""

import hashlib
import json
import os

import numpy as np
from mpi4py import MPI

from case_driver import agreed_error, run_file
import reference
from ring_cases import Assignment, make_inputs, position_kw, window_of
from variant_cases import make_alibi, make_sinks
import ringmpi
from ringmpi import Layout, RingContext
from ringmpi.core.global_tiles import TILE, shard_problem
from ringmpi.core.host import to_host

OUTPUTS = ("o", "lse", "max_logit", "dq", "dk", "dv", "dsinks")


def whole_tiles(lay, size) -> bool:
    return all(shard_problem("x", lay.indices(r), lay.n) is None for r in range(size))


def tile_assignment(rng, n, size):
    """Whole tiles of ``n`` positions over ``size`` ranks: tiles shuffled, cut at random places
    (a rank may hold none; from P = 3 the last holds none), each rank's rows shuffled."""
    tiles = rng.permutation(-(-n // TILE))
    cuts = np.sort(rng.integers(0, len(tiles) + 1, size=size - 1))
    if size >= 3:
        cuts[-1] = len(tiles)
    parts = []
    for chunk in np.split(tiles, cuts):
        rows = np.concatenate([np.arange(t * TILE, min(n, t * TILE + TILE)) for t in chunk] or [np.zeros(0, int)])
        parts.append(rng.permutation(rows).astype(np.int64))
    return Assignment(parts)


def placements_at(case, size):
    """``[(name, lay_q, lay_kv, head_parallel)]``: what applies at ``size`` ranks (a layout that
    places every token as one before it does, as all do at P = 1, is left out)."""
    n_q, n_kv = case["n_q"], case.get("n_kv", case["n_q"])
    out, seen = [], set()
    for kind in case.get("layouts", ("contiguous", "zigzag", "striped")):
        lq, lkv = Layout(kind, n_q, size), Layout(kind, n_kv, size)
        where = tuple(tuple(lay.indices(r)) for lay in (lq, lkv) for r in range(size))
        if whole_tiles(lq, size) and whole_tiles(lkv, size) and where not in seen:
            seen.add(where)
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
    layout = "contiguous" if isinstance(lay_q, Assignment) else lay_q.kind  # positions place an Assignment
    context = RingContext(comm, layout=layout, backend=case.get("backend", "numpy"), invariant=True, head_parallel=u)
    kw = dict(causal=case.get("causal", False), window=window_of(case), softcap=case.get("softcap") or 0.0,
              softmax_scale=case.get("scale"), context=context, **position_kw(lay_q, lay_kv, rank))
    if seg_q is not None:
        kw["segment_ids"] = (lay_q.shard(seg_q, rank), lay_kv.shard(seg_kv, rank))
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
    rank = comm.Get_rank()
    q, k, v, do, seg_q, seg_kv, sinks, alibi = data
    kw = call_kw(case, comm, rank, lay_q, lay_kv, seg_q, seg_kv, sinks, alibi, u)
    args = [lay.shard(x, rank) for lay, x in ((lay_q, q), (lay_kv, k), (lay_kv, v))]
    o, lse, max_logit = ringmpi.ring_attention(*args, return_max_logit=True, **kw)
    grads = ringmpi.ring_attention_backward(lay_q.shard(do, rank), *args, (o, lse), **kw)
    mine = {name: to_host(x) for name, x in dict(o=o, lse=lse, dq=grads[0], dk=grads[1], dv=grads[2]).items()}
    every = comm.gather(mine, root=0)
    if rank != 0:
        return None
    out = dict(max_logit=to_host(max_logit))
    if sinks is not None:
        out["dsinks"] = to_host(grads[3])
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


def decode_entry(comm, case, data, lay_kv):
    """``decode_attention`` (``invariant=True``) of the last ``case["decode"]`` tokens over the cache
    sharded as ``lay_kv`` (ascending rows): their ``o, lse`` in global order (rank 0)."""
    rank = comm.Get_rank()
    q, k, v, _, _, _, sinks, alibi = data
    s_new = case["decode"]
    rows = np.sort(lay_kv.indices(rank))
    kw = dict(causal=case.get("causal", True), sinks=sinks, alibi_slopes=alibi, softcap=case.get("softcap") or 0.0,
              window=window_of(case), softmax_scale=case.get("scale"))
    o, lse, _ = ringmpi.decode_attention(q[:, -s_new:], k[:, rows], v[:, rows], positions=rows,
                                         context=RingContext(comm, backend=case.get("backend", "numpy"),
                                                             invariant=True), **kw)
    return dict(o_new=to_host(o), lse_new=to_host(lse)) if rank == 0 else None


def torch_entry(comm, case, data, lay_q, lay_kv):
    """``ringmpi.torch.ring_attention`` (a context with ``invariant=True``): ``o, lse``, autograd for
    ``dq, dk, dv``."""
    import torch

    import ringmpi.torch as rt

    rank = comm.Get_rank()
    q, k, v, do, seg_q, seg_kv, sinks, alibi = data
    kw = call_kw(case, comm, rank, lay_q, lay_kv, seg_q, seg_kv, sinks, alibi, 1)
    def tensor(n, x):
        if isinstance(x, tuple):
            return tuple(tensor(n, y) for y in x)
        return torch.from_numpy(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) and n != "alibi_slopes" else x

    kw = {n: tensor(n, x) for n, x in kw.items()}
    kw["context"] = kw["context"].replace(backend="auto")  # the tensors' device
    leaves = [torch.from_numpy(np.ascontiguousarray(lay.shard(x, rank))).requires_grad_(True)
              for lay, x in ((lay_q, q), (lay_kv, k), (lay_kv, v))]
    o, lse, _ = rt.ring_attention(*leaves, **kw)
    (o * torch.from_numpy(np.ascontiguousarray(lay_q.shard(do, rank)))).sum().backward()
    mine = dict(o=o.detach().numpy(), lse=lse.numpy(), dq=leaves[0].grad.numpy(), dk=leaves[1].grad.numpy(),
                dv=leaves[2].grad.numpy())
    return _unshard(comm, mine, lay_q, lay_kv)


def file_entry(comm, case, data, layout):
    """``ringmpi run --invariant --backward`` (in process, every rank) on the case's inputs in an
    HDF5 file with ``layout``: the output datasets (rank 0)."""
    import h5py
    from ringmpi.cli.run import run

    rank = comm.Get_rank()
    q, k, v, do, sinks = data[0], data[1], data[2], data[3], data[6]
    src, dst = (os.path.join(case["dir"], f"{case['id']}.P{comm.Get_size()}.{x}.h5") for x in ("in", "out"))
    if rank == 0:
        with h5py.File(src, "w") as f:
            for name, x in (("q", q), ("k", k), ("v", v), ("do", do)):
                f[name] = x
            if sinks is not None:
                f["sinks"] = sinks
    comm.Barrier()
    argv = [src, "-o", dst, "--backend", "numpy", "--layout", layout, "--backward", "--overwrite", "--invariant"]
    argv += (["--causal"] if case.get("causal") else []) + (["--sinks-dataset", "sinks"] if sinks is not None else [])
    run.main(args=argv, standalone_mode=False)
    comm.Barrier()
    if rank != 0:
        return None
    with h5py.File(dst, "r") as f:
        return {name: f[name][()] for name in ("o", "lse", "dq", "dk", "dv")}


def _unshard(comm, mine, lay_q, lay_kv):
    every = comm.gather(mine, root=0)
    if comm.Get_rank() != 0:
        return None
    return {name: (lay_q if name in ("o", "lse", "dq") else lay_kv).unshard([e[name] for e in every],
                                                                            axis=2 if name == "lse" else 1)
            for name in mine}


def entries(comm, case, data, placements):
    """The other entry points' outputs: ``{name: {output: array}}`` (rank 0; None elsewhere)."""
    size = comm.Get_size()
    out = {}
    first_lay = next((p for p in placements if p[3] == 1 and not isinstance(p[1], Assignment)), placements[0])
    if case.get("decode"):
        out["decode"] = decode_entry(comm, case, data, placements[0][2])
    if size in case.get("torch", ()):
        out["torch"] = torch_entry(comm, case, data, *placements[0][1:3])
    if case.get("file") and not isinstance(first_lay[1], Assignment):
        out["file"] = file_entry(comm, case, data, first_lay[0])
    return out


def run_case(comm, case):
    rank, size = comm.Get_rank(), comm.Get_size()
    data = inputs(case)
    hashes, first = {}, None
    where = placements_at(case, size)
    for name, lay_q, lay_kv, u in where:
        got = run_placement(comm, case, data, lay_q, lay_kv, u)
        if rank == 0:
            hashes[name] = {key: digest(got[key]) for key in OUTPUTS if key in got}
            first = first or got
    others = entries(comm, case, data, where)
    if rank != 0:
        return None
    messages, ok = [], True
    if "decode" in others:  # the ring's rows of the new tokens
        s_new = case["decode"]
        first = dict(first, o_new=first["o"][:, -s_new:], lse_new=first["lse"][..., -s_new:])
    for name, got in others.items():
        differ = [key for key in got if digest(got[key]) != digest(first[key])]
        if differ:
            ok = False
            messages.append(f"{name} differs from the library's bits on {differ}")
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
    context = RingContext(comm, invariant=True, backend="numpy")
    problem = agreed_error(comm, lambda: ringmpi.ring_attention(q, q[:, :, :1], q[:, :, :1], context=context),
                           "whole 64-token tiles")
    return problem is None, problem or "ConfigError on every rank"


def main():
    run_file(MPI.COMM_WORLD, {"errors": errors_case}, run_case)


if __name__ == "__main__":
    main()
