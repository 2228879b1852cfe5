"""Packed documents (issue 42): the balanced layout and the routed schedule, one case kind for
several launches; the all-gather schedule's cases too (issue 53).

``packed_case(comm, case)`` runs in the launches of ``ring_cases.py``,
``variant_cases.py`` and ``head_parallel_cases.py`` (kind ``"packed"``), so that
world sizes 1 .. 6 share launches that run anyway.  A case packs the documents
``case["documents"]`` (segment ids: the document index), places them with
``case["placement"]`` (``"balanced"``: ``ringmpi.Layout("balanced", ...)``
passed as the layout; ``"zigzag"``/``"contiguous"``: that layout;
``"permutation"``: explicit positions), and calls ``ring_attention`` with
``return_max_logit`` and the case's options (GQA, window, sinks, softcap,
ALiBi, dropout, ``head_parallel``, ``schedule``), twice, then the backward
twice.  Rank 0 checks against the float64 dense reference under the tolerance
rule (``variant_cases.check``), and:

* the schedule every ring record names is ``case["expect"]``; ``"auto"``: one of the case's
  ``candidates``, the same on every rank, with the prediction and the runner-up's in the
  first record of each pass (issue 53);
* routed, flat: each rank received exactly the K/V bytes of the rows its queries
  can see on other ranks (from the dense visibility, not from the plan), and in
  the backward those again plus the partial sums of its own rows that others read;
* all-gather, flat: each rank received every other rank's K/V rows exactly once, and in the
  backward those again plus the partial sums of its own rows from every other rank;
* the repeated calls are bitwise equal;
* ``case["spanning"]``: the longest document has tokens on every rank;
* ``case["nonfinite"]``: a NaN in one key of the longest document reaches exactly the
  queries that see it (their ``o`` NaN on the heads reading it), every other query's
  ``o`` and ``lse`` are bitwise those of the clean call.

:func:`cases_for` is the case matrix of one world size, added to those launches by
the test modules.
"""

import numpy as np

import reference
import ringmpi
from ring_cases import BACKEND, Assignment, converters, make_inputs, split_tokens, window_of, with_context
from ringmpi import Layout
from variant_cases import check, make_alibi, make_sinks


def pack(p: int, seed: int, n: int):
    """A random pack of ``n`` tokens: one document of about 60 % (it spans every rank of a
    balanced layout: most of the work is there), single tokens, and short documents."""
    rng = np.random.default_rng(seed)
    long_doc = int(0.6 * n)
    docs, left = [1], n - long_doc - 1
    while left > 0:
        length = 1 if rng.random() < 0.35 else int(rng.integers(2, 14))
        length = min(length, left)
        docs.append(length)
        left -= length
    docs.insert(int(rng.integers(0, len(docs) + 1)), long_doc)
    return [int(d) for d in docs]


# which cases each world size runs (in the launches of the drivers named): every option at every
# P, the rest spread out, so that the suite's time grows by little
# (issue 53: the all-gather schedule, every option at every P, its other cases spread out)
SELECTION = {
    1: ("balanced-all", "auto-dense", "allgather-all"),                                        # variant_cases
    2: ("balanced-all", "balanced-gqa-b2", "zigzag-routed", "auto-dense", "allgather-all",
        "allgather-dense"),                                                                    # ring_cases
    3: ("balanced-all", "balanced-float64", "permutation-routed", "balanced-nonfinite", "allgather-all",
        "allgather-nonfinite"),                                                                # variant_cases
    4: ("balanced-all", "balanced-gqa-b2", "U2", "allgather-all", "allgather-U2"),             # variant_cases
    5: ("balanced-all", "zigzag-routed", "balanced-nonfinite", "allgather-all", "allgather-float64"),  # ring_cases
    6: ("balanced-all", "U3", "allgather-all", "allgather-U3"),                                # head_parallel_cases
}


def cases_for(p: int):
    """The packed cases of world size ``p`` (:data:`SELECTION`)."""
    cases = []

    def add(name, **kw):
        seed = 4200 + 31 * p + len(cases)
        case = dict(id=f"P{p}-packed-{name}", kind="packed", B=1, H=4, Hkv=2, D=16, dtype="float32", seed=seed,
                    causal=True, expect="auto" if p > 1 else "ring")
        case.update(kw)
        case.setdefault("documents", pack(p, seed, case.pop("n", 97)))
        case.pop("n", None)
        cases.append(case)

    # every option of the routed schedule at once, on the balanced layout (default schedule: auto)
    add("balanced-all", placement="balanced", n=97, window=[40, 0], sinks=True, softcap=4.0, k_scale=3.0,
        alibi=True, dropout=0.25, dropout_seed=4242, spanning=True)
    routed = "routed" if p > 1 else "ring"
    add("balanced-gqa-b2", placement="balanced", n=83, B=2, H=6, Hkv=2, schedule="routed", spanning=True,
        expect=routed)
    add("balanced-float64", placement="balanced", dtype="float64", window=[5, 0], schedule="routed",
        documents=[1] * 7 + [20, 1, 3, 1, 25], expect=routed)
    add("balanced-nonfinite", placement="balanced", n=89, window=[30, 0], schedule="routed", nonfinite=True,
        expect=routed)
    add("zigzag-routed", placement="zigzag", n=90, causal=False, schedule="routed", sinks=True, expect=routed)
    add("permutation-routed", placement="permutation", n=75, window=[6, 6], causal=False, schedule="routed",
        alibi=True, expect=routed)
    # one document and no positional mask: the plan moves what the ring moves, so auto chooses between
    # the ring and the all-gather (issue 53: by predicted time)
    add("auto-dense", placement="balanced", causal=False, documents=[64], schedule="auto",
        expect="auto" if p > 1 else "ring", candidates=("ring", "allgather"))
    # the head x ring schedule with a routed ring across its groups
    for u in (2, 3):
        if p % u == 0 and p > u:
            add(f"U{u}", placement="balanced", n=61, head_parallel=u, H=2 * u, Hkv=u, sinks=True, alibi=True,
                schedule="routed", expect=routed)
    # the all-gather schedule (issue 53): every option at once on packed documents, a dense mask,
    # non-finite keys, float64, and head x all-gather
    gathered = "allgather" if p > 1 else "ring"
    add("allgather-all", placement="zigzag", n=95, B=2, window=[40, 0], sinks=True, softcap=4.0, k_scale=3.0,
        alibi=True, dropout=0.25, dropout_seed=5353, schedule="allgather", expect=gathered)
    add("allgather-dense", placement="contiguous", n=300, causal=False, documents=[300], H=6, Hkv=3,
        schedule="allgather", expect=gathered, sinks=True, budget=True)
    add("allgather-nonfinite", placement="permutation", n=89, window=[30, 0], schedule="allgather",
        expect=gathered, nonfinite=True)
    add("allgather-float64", placement="zigzag", dtype="float64", documents=[400], causal=True, schedule="allgather",
        expect=gathered, alibi=True)
    for u in (2, 3):
        if p % u == 0 and p > u:
            add(f"allgather-U{u}", placement="contiguous", n=61, head_parallel=u, H=2 * u, Hkv=u, sinks=True,
                alibi=True, schedule="allgather", expect=gathered)
    return [c for c in cases if c["id"].split("-packed-")[1] in SELECTION.get(p, ())]


def _visible_rows(vis, mine, theirs):
    """How many of ``theirs`` (key positions) some query at ``mine`` sees."""
    if len(mine) == 0 or len(theirs) == 0:
        return 0
    return int(vis[np.ix_(mine, theirs)].any(axis=0).sum())


def _nonfinite(comm, case, lay, kw, args, whole, docs, causal, window):
    """A NaN in key ``j`` (head 0) of the longest document: the queries that see it get NaN on
    the heads that read K/V head 0, everything else keeps the clean call's bits (this rank's)."""
    rank = comm.Get_rank()
    to_backend, to_host = converters()
    longest = int(np.argmax(docs))
    j = sum(docs[:longest]) + docs[longest] // 3
    k_bad = whole[1].copy()
    k_bad[0, j, 0, 0] = np.nan
    clean = [to_host(x) for x in ringmpi.ring_attention(*args, **kw)[:2]]
    bad = [to_host(x) for x in ringmpi.ring_attention(args[0], to_backend(lay.shard(k_bad, rank)), args[2],
                                                      **kw)[:2]]
    n = sum(docs)
    seg = np.repeat(np.arange(len(docs)), docs)[None]
    sees = reference.visible(n, n, causal, window, seg, seg)[0][:, j][np.asarray(lay.indices(rank))]
    group = case["H"] // case["Hkv"]
    o_c, o_b, l_c, l_b = clean[0][0], bad[0][0], clean[1][0], bad[1][0]  # (S, H, D), (H, S)
    reading = np.zeros(case["H"], bool)
    reading[:group] = True  # query heads reading K/V head 0
    want_nan = sees[:, None] & reading[None, :]
    problems = []
    if not np.isnan(o_b[want_nan]).all():
        problems.append(f"rank {rank}: a query that sees the NaN key is not NaN")
    keep = ~want_nan
    if not (np.array_equal(o_b[keep], o_c[keep]) and np.array_equal(l_b.T[keep], l_c.T[keep])):
        problems.append(f"rank {rank}: queries that do not see the NaN key changed")
    return problems


def _beyond_budget(comm, args, kw):
    """Beyond ``RINGMPI_MEMORY_BUDGET`` an explicit ``schedule="allgather"`` is one ConfigError on
    every rank, naming what it needs and the budget, before any compute."""
    import os

    from case_driver import agreed_error

    os.environ["RINGMPI_MEMORY_BUDGET"] = "1K"
    try:
        problems = [agreed_error(comm, lambda: ringmpi.ring_attention(*args, **kw),
                                 "beyond this rank's memory budget of 0.0 MiB"),
                    # schedule="auto" where nothing fits: each schedule's need named (issue 53)
                    agreed_error(comm, lambda: ringmpi.ring_attention(*args, **with_context(kw, schedule="auto")),
                                 "no schedule fits the memory budget of 0.0 MiB per rank")]
        if problems[1] is None and comm.Get_size() > 1:
            try:
                ringmpi.ring_attention(*args, **with_context(kw, schedule="auto"))
            except ringmpi.ConfigError as exc:
                if not all(f"{s} " in str(exc) for s in ("ring", "allgather")):
                    problems.append(f"the refusal does not name each schedule's need: {exc}")
    finally:
        del os.environ["RINGMPI_MEMORY_BUDGET"]
    return [p for p in problems if p is not None]


def packed_case(comm, case):
    rank, size = comm.Get_rank(), comm.Get_size()
    docs = case["documents"]
    n = sum(docs)
    q, k, v, do, _, _ = make_inputs(dict(case, n_q=n, segments=None))
    batch, heads, kv_heads, dim = q.shape[0], q.shape[2], k.shape[2], q.shape[3]
    seg = np.ascontiguousarray(np.broadcast_to(np.repeat(np.arange(len(docs)), docs), (batch, n)))
    sinks = make_sinks(case, heads)
    window = window_of(case)
    causal = case.get("causal", False)
    placement = case["placement"]
    to_backend, to_host = converters()
    run = dict(comm=comm, backend=BACKEND, head_parallel=case.get("head_parallel", 1),
               schedule=case.get("schedule"))
    kw = dict(causal=causal, window=window, softcap=case.get("softcap") or 0.0,
              alibi_slopes=make_alibi(case, heads))
    if placement == "balanced":
        lay = Layout("balanced", n, size, documents=docs, causal=causal, window=window)
        run["layout"] = lay
        kw.update(segment_ids=lay.segment_ids(rank, batch))
    else:
        if placement == "permutation":
            rng = np.random.default_rng(case["seed"] + 5)
            lay = Assignment(split_tokens(rng, rng.permutation(n), size) if size > 1 else [np.arange(n)])
            kw.update(positions=lay.indices(rank))
        else:
            lay = Layout(placement, n, size)
            run["layout"] = placement
        kw.update(segment_ids=lay.shard(seg, rank))
    kw["context"] = ringmpi.RingContext(**run)
    if case.get("dropout"):
        kw.update(dropout_p=case["dropout"], dropout_seed=case["dropout_seed"])
    if sinks is not None:
        kw["sinks"] = to_backend(sinks)
    args = [to_backend(lay.shard(x, rank)) for x in (q, k, v)]
    fwd, bwd = [], []
    o, lse, max_logit = ringmpi.ring_attention(*args, return_max_logit=True, **with_context(kw, stats=fwd))
    again = ringmpi.ring_attention(*args, return_max_logit=True, **kw)
    o2, _, _ = ringmpi.ring_attention(*args, **kw)
    do_local = to_backend(lay.shard(do, rank))
    grads = ringmpi.ring_attention_backward(do_local, *args, (o, lse), **with_context(kw, stats=bwd))
    grads2 = ringmpi.ring_attention_backward(do_local, *args, (o, lse), **kw)
    results = dict(o=to_host(o), lse=to_host(lse), max_logit=np.asarray(max_logit),
                   same_without_max=bool(np.allclose(to_host(o2), to_host(o), rtol=1e-5, atol=1e-6)),
                   dq=to_host(grads[0]), dk=to_host(grads[1]), dv=to_host(grads[2]))
    if sinks is not None:
        results["dsinks"] = np.asarray(grads[3])
    problems = []
    if not all(np.array_equal(to_host(a), to_host(b)) for a, b in zip((o, lse, max_logit), again)) or \
            not all(np.array_equal(to_host(a), to_host(b)) for a, b in zip(grads, grads2) if a is not None):
        problems.append(f"rank {rank}: repeated calls differ bitwise")
    steps = [r for r in fwd + bwd if not hasattr(r, "stage")]
    named = {r.schedule for r in steps}
    ran = case["expect"]
    if ran == "auto":
        # schedule="auto" (issue 53): per pass one of its candidates (the forward and the backward
        # choose apart), the same on every rank, each pass's first record holding the chosen
        # schedule's predicted time and the runner-up's
        candidates = case.get("candidates", ("ring", "routed", "allgather"))
        passes = [sorted({r.schedule for r in recs if not hasattr(r, "stage")}) for recs in (fwd, bwd)]
        everyone = comm.allgather(passes)
        firsts = [r for r in steps if r.step == 0]
        if any(len(names) != 1 or names[0] not in candidates for names in passes) or \
                any(e != everyone[0] for e in everyone):
            problems.append(f"rank {rank}: auto ran {passes} (ranks: {everyone}), expected one of {candidates}")
        elif not firsts or not all(r.predicted_s is not None and r.predicted_s > 0 and r.runner_up
                                   and r.runner_up_s >= r.predicted_s for r in firsts):
            problems.append(f"rank {rank}: auto's records lack its prediction: "
                            f"{[(r.predicted_s, r.runner_up, r.runner_up_s) for r in firsts]}")
        ran = passes[0][0] if passes[0] == passes[1] else "both"
    elif named != {ran}:
        problems.append(f"rank {rank}: records name the schedule {sorted(named)}, expected {ran!r}")
    if ran == "routed" and case.get("head_parallel", 1) == 1:
        vis = reference.visible(n, n, causal, window, seg, seg).any(axis=0)
        mine = np.asarray(lay.indices(rank))
        rows_in = sum(_visible_rows(vis, mine, np.asarray(lay.indices(s))) for s in range(size) if s != rank)
        rows_out = sum(_visible_rows(vis, np.asarray(lay.indices(r)), mine) for r in range(size) if r != rank)
        kv_row = batch * kv_heads * 2 * dim * q.dtype.itemsize
        grad_row = batch * kv_heads * 2 * dim * (8 if q.dtype == np.float64 else 4)
        got = [sum(r.bytes_recv for r in fwd), sum(r.bytes_recv for r in bwd)]
        want = [rows_in * kv_row, rows_in * kv_row + rows_out * grad_row]
        if got != want:
            problems.append(f"rank {rank}: bytes received (forward, backward) {got}, the visible rows make {want}")
    if ran == "allgather" and case.get("head_parallel", 1) == 1:
        # every other rank's rows arrive once; backward: again, plus this rank's rows' partial sums
        # from each other rank
        mine = len(lay.indices(rank))
        kv_row = batch * kv_heads * 2 * dim * q.dtype.itemsize
        grad_row = batch * kv_heads * 2 * dim * (8 if q.dtype == np.float64 else 4)
        got = [sum(r.bytes_recv for r in fwd), sum(r.bytes_recv for r in bwd)]
        want = [(n - mine) * kv_row, (n - mine) * kv_row + (size - 1) * mine * grad_row]
        if got != want:
            problems.append(f"rank {rank}: bytes received (forward, backward) {got}, the gathered rows make {want}")
    if case.get("spanning") and rank == 0:
        longest = int(np.argmax(docs))
        start = sum(docs[:longest])
        holders = [s for s in range(size) if np.any((np.asarray(lay.indices(s)) >= start)
                                                     & (np.asarray(lay.indices(s)) < start + docs[longest]))]
        if len(holders) != size:
            problems.append(f"the longest document sits on ranks {holders}, not on all {size}")
    if case.get("budget"):
        problems += _beyond_budget(comm, args, kw)
    if case.get("nonfinite"):
        problems += _nonfinite(comm, case, lay, kw, args, (q, k, v), docs, causal, window)
    problems = sum(comm.allgather(problems), [])
    gathered = comm.gather(results, root=0)
    if rank != 0:
        return None
    ok, msg = check(dict(case, n_q=n), gathered, lay, lay, q, k, v, do, seg, seg, window, sinks)
    return ok and not problems, "; ".join(problems + [msg])
