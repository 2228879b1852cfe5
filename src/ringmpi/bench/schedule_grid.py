"""Issue 53's validation grid: every schedule measured and predicted on the namespace cluster.

    python -m ringmpi.bench.schedule_grid [--rates unshaped,1gbit,100mbit] [--quick] [--json grid.json]

Run as root from a source checkout: it starts the suite's two-host cluster of network namespaces
(``tests/cluster/netns_cluster.py``, imported by path: the harness lives with the tests, not in
the package), two ranks per host (P = 4), and for each link rate shapes both hosts' links (tc
tbf; ``unshaped``: veth as it is) and launches one ``mpirun`` that runs every cell.  A cell is
one problem (N, H, D, mask: causal on the zigzag layout, a causal sliding window of N / 8 or a
pack of causal documents (log-normal, mean N / 8) on contiguous shards), float32, forward
only.  In a cell every schedule runs (:data:`RUNS`: the ring, routed, the all-gather, head x
ring with U = 2, and ``auto`` for both ``schedule`` and ``head_parallel``), ``warmup`` untimed
calls each, then ``repeat`` rounds of one timed call of each schedule in turn, then more rounds
(up to ``max_repeat``) of the schedules whose calls are short, while those take under
``cell_seconds`` (:func:`rounds`, :func:`next_round`;
:func:`ringmpi.bench.measure.timed_calls`: a barrier before each; a call's time is its slowest
rank's, the cell's the median over the rounds), and the
cost model predicts each schedule on the parts it measured on that communicator (block rate,
links, each schedule's per-call cost)
(:meth:`ringmpi.parallel.ring_passes.LocalProblem.predictions`: the same block rate, links and
call shape ``"auto"`` chooses with; one source of truth).  ``auto``'s prediction is that of
the schedule it chose.

The table (:func:`format_report`) gives per cell each schedule's measured and predicted
seconds and their ratio, ``auto``'s choice and its time against the fastest measured
schedule; :func:`summarize` checks issue 53's targets: ``auto`` within 10 % of the fastest in
at least 90 % of the cells and never slower than 1.25x it, every prediction within 25 % of its
measurement.  Where the hosts' ranks outnumber the machine's cores the report says so: the
block rate is timed with every rank computing at once (:func:`ringmpi.parallel.cost_measure.block_rate`),
so the model's rate is the shared one; its cache is a fresh directory of each grid run.

The cluster (namespaces, processes) is torn down on every exit: an error, Ctrl-C, SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional, Sequence

# (column name, schedule, head_parallel): what each run of a cell asks for
RUNS = (("ring", "ring", 1), ("routed", "routed", 1), ("allgather", "allgather", 1),
        ("head x ring, U=2", "ring", 2), ("auto", "auto", "auto"))
EXPLICIT = tuple(name for name, _, _ in RUNS if name != "auto")
MASKS = ("causal", "window", "documents")
LAYOUT_OF = {"causal": "zigzag", "window": "contiguous", "documents": "contiguous"}
FULL = dict(ns=(4096, 16384), heads=(4, 8), dims=(64, 128), masks=MASKS, repeat=3, warmup=1, most=9, cell_seconds=5.0)
QUICK = dict(ns=(4096, 8192), heads=(4,), dims=(64,), masks=MASKS, repeat=2, warmup=1, most=2, cell_seconds=0.0)
RATES = ("unshaped", "1gbit", "100mbit")
AUTO_WITHIN, AUTO_SHARE, AUTO_WORST, PREDICT_WITHIN = 1.10, 0.90, 1.25, 0.25
SHORT_CALL = 0.5  # seconds: a schedule whose calls take less gets more rounds (next_round)
HOSTS, RANKS_PER_HOST = 2, 2


def grid_cells(ns: Sequence[int], heads: Sequence[int], dims: Sequence[int], masks: Sequence[str]) -> List[dict]:
    """Every cell of the grid: ``{"n", "heads", "dim", "mask", "layout"}``, smallest first."""
    return [dict(n=int(n), heads=int(h), dim=int(d), mask=m, layout=LAYOUT_OF[m])
            for n in sorted(ns) for h in sorted(heads) for d in sorted(dims) for m in masks]


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or b is None or b <= 0 else a / b


def cell_row(result: dict) -> dict:
    """One result (``{"rate", "cell", "measured": {name: s}, "predicted": {name: s}, "auto_chosen"}``)
    with its figures: ``ratio`` (predicted / measured) per schedule, the ``fastest`` explicit
    schedule measured, ``auto_slowdown`` (auto's time over the fastest's)."""
    measured, predicted = result["measured"], result["predicted"]
    timed = {name: measured[name] for name in EXPLICIT if measured.get(name) is not None}
    fastest = min(timed, key=timed.get) if timed else None
    row = dict(result)
    row["ratio"] = {name: _ratio(predicted.get(name), measured.get(name)) for name, _, _ in RUNS}
    row["fastest"] = fastest
    row["auto_slowdown"] = _ratio(measured.get("auto"), timed.get(fastest)) if fastest else None
    return row


def summarize(rows: Sequence[dict]) -> dict:
    """Issue 53's targets over ``rows`` (:func:`cell_row`): the share of cells where auto is
    within 10 % of the fastest and the worst auto slowdown; the share of (cell, schedule)
    predictions within 25 % and the worst (the ratio farthest from 1, either way)."""
    slow = [r["auto_slowdown"] for r in rows if r.get("auto_slowdown") is not None]
    ratios = [(r, name, x) for r in rows for name, x in r["ratio"].items() if x is not None]
    within = [x for _, _, x in ratios if abs(x - 1.0) <= PREDICT_WITHIN]
    worst = max(ratios, key=lambda t: abs(math.log(t[2])) if t[2] > 0 else math.inf, default=None)
    out = dict(cells=len(rows),
               auto_within=sum(1 for s in slow if s <= AUTO_WITHIN), auto_cells=len(slow),
               auto_worst=max(slow, default=None),
               predictions=len(ratios), predictions_within=len(within),
               prediction_worst=None if worst is None else worst[2],
               prediction_worst_at=None if worst is None else f"{label(worst[0])} {worst[1]}")
    out["auto_share"] = out["auto_within"] / out["auto_cells"] if out["auto_cells"] else None
    out["prediction_share"] = out["predictions_within"] / out["predictions"] if out["predictions"] else None
    out["auto_ok"] = (out["auto_share"] is not None and out["auto_share"] >= AUTO_SHARE
                      and out["auto_worst"] <= AUTO_WORST)
    out["predictions_ok"] = out["predictions"] > 0 and out["predictions_within"] == out["predictions"]
    return out


def label(row: dict) -> str:
    c = row["cell"]
    return f"{row['rate']} N={c['n']} H={c['heads']} D={c['dim']} {c['mask']}"


def _pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _fig(measured: Optional[float], predicted: Optional[float], ratio: Optional[float]) -> str:
    m = "-" if measured is None else f"{measured:.3g}"
    p = "-" if predicted is None else f"{predicted:.3g}"
    return f"{m} / {p}" + ("" if ratio is None else f" ({ratio:.2f})")


def format_report(rows: Sequence[dict], notes: Sequence[str] = ()) -> str:
    """The markdown table (one line per cell: each schedule's ``measured / predicted s (ratio)``,
    auto's choice and slowdown) and the summary against issue 53's targets."""
    names = [name for name, _, _ in RUNS]
    head = ["rate", "N", "H", "D", "mask"] + [f"{n} s" for n in names] + ["auto chose", "fastest", "auto / fastest"]
    lines = [f"- {n}" for n in notes]
    lines += ["", "Each schedule: measured s / predicted s (predicted / measured).", "",
              "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        c = r["cell"]
        figs = [_fig(r["measured"].get(n), r["predicted"].get(n), r["ratio"].get(n)) for n in names]
        slow = r.get("auto_slowdown")
        lines.append("| " + " | ".join([r["rate"], str(c["n"]), str(c["heads"]), str(c["dim"]), c["mask"], *figs,
                                         r.get("auto_chosen") or "-", r.get("fastest") or "-",
                                         "-" if slow is None else f"{slow:.2f}"]) + " |")
    s = summarize(rows)
    lines += ["", summary_lines(s)]
    return "\n".join(lines)


def summary_lines(s: dict) -> str:
    ok = {True: "met", False: "NOT met"}
    worst = "-" if s["auto_worst"] is None else f"{s['auto_worst']:.2f}x"
    pworst = "-" if s["prediction_worst"] is None else f"{s['prediction_worst']:.2f} ({s['prediction_worst_at']})"
    return "\n".join([
        f"auto within 10 % of the fastest measured: {s['auto_within']}/{s['auto_cells']} cells "
        f"({_pct(s['auto_share'])}; target >= 90 %), worst {worst} (target <= 1.25x): {ok[s['auto_ok']]}",
        f"predictions within 25 % of measured: {s['predictions_within']}/{s['predictions']} "
        f"(cell, schedule) pairs ({_pct(s['prediction_share'])}; target 100 %), worst predicted/measured "
        f"{pworst}: {ok[s['predictions_ok']]}"])


# ---- inside MPI: one launch runs every cell at one link rate --------------------------------------

def _inputs(comm, cell: dict, seed: int):
    """This rank's ``(q, k, v, call keywords, layout kind, positions, segment ids or None, counts)``."""
    import numpy as np

    from ..core.layout import Layout
    from .documents import document_lengths

    rank, p = comm.Get_rank(), comm.Get_size()
    n, h, d = cell["n"], cell["heads"], cell["dim"]
    layout = Layout(cell["layout"], n, p)
    mine = layout.indices(rank)
    rng = np.random.default_rng([seed, n, h, d, rank])
    q, k, v = (rng.standard_normal((1, len(mine), h, d), dtype=np.float32) for _ in range(3))
    kw, seg = dict(causal=True), None
    if cell["mask"] == "window":
        kw["window"] = (n // 8, 0)
    if cell["mask"] == "documents":
        ends = np.cumsum(np.asarray(document_lengths(f"lognormal:{n // 8}:1.0", n, seed), dtype=np.int64))
        seg = np.searchsorted(ends, mine, side="right").astype(np.int64)[None, :]
        kw["segment_ids"] = seg
    return q, k, v, kw, mine, seg, [int(c) for c in layout.counts()]


def _predictions(comm, be, cell, q, k, v, kw, mine, seg, counts) -> dict:
    """``{name: Prediction}`` of every schedule and every U that ``head_parallel="auto"`` weighs
    for this cell (collective)."""
    from ..options import AttentionOptions
    from ..parallel.ring_passes import LocalProblem
    from ..parallel.topology import cached_node_ids, head_parallel_candidates, ring_order

    options = AttentionOptions(causal=kw["causal"], window=kw.get("window"))
    problem = LocalProblem(comm, be, be.compute_dtype(k.dtype), options.score_spec(cell["heads"]),
                           options.scale(cell["dim"]), kv_counts=counts, q_pos=mine, kv_pos=mine, seg_q=seg,
                           seg_kv=seg, order=ring_order(comm), kv_schedule="auto", q_counts=counts,
                           q_heads=cell["heads"])
    us = head_parallel_candidates(cached_node_ids(comm), cell["heads"])  # those auto weighs
    return {p.name: p for p in problem.predictions(k, v, backward=False, head_parallel=us)}


def _chosen(records: List[dict]) -> str:
    """The name of what a call ran (its cost-model name): its K/V schedule and its ``U``."""
    from .summary import chosen_head_parallel

    u = chosen_head_parallel(records)
    schedule = next((r["schedule"] for r in records if "stage" not in r and "schedule" in r), "ring")
    return schedule if u == 1 else f"head x {schedule}, U={u}"


def rounds(names: Sequence[str], repeat: int) -> List[List[str]]:
    """The order of a cell's timed calls: ``repeat`` rounds of one call of each schedule, each
    round starting one schedule later, so that a slow spell of the machine (4 ranks on 2 cores
    here) falls on every schedule alike rather than on one schedule's calls in a row, and each
    schedule in turn runs first after the round's barrier."""
    names = list(names)
    return [names[r % len(names):] + names[:r % len(names)] for r in range(repeat)]


def next_round(walls: dict, done: int, extra_seconds: float, repeat: int, most: int, cell_seconds: float,
               short: float = SHORT_CALL) -> List[str]:
    """The schedules a cell times in its next round, after ``done`` rounds (``walls``: each
    schedule's times so far, in :data:`RUNS`' order): every schedule, each round starting one later
    (:func:`rounds`), for ``repeat`` rounds; then, up to ``most`` rounds, those whose calls take
    under ``short`` seconds (:data:`SHORT_CALL`; the median so far), while these extra rounds have
    taken under ``cell_seconds`` (``extra_seconds``): a call of tens of ms spreads 10-25 % on this
    VM, and three of them beside calls of seconds are too few for a median; none: the cell is done."""
    names = list(walls)
    if done < repeat:
        return rounds(names, done + 1)[-1]
    if done >= most or extra_seconds >= cell_seconds:
        return []
    return [n for n in rounds(names, done + 1)[-1] if walls[n] and statistics.median(walls[n]) < short]


def worker(spec_path: str, out_path: str) -> None:
    """One launch: every cell of ``spec_path`` (JSON: cells, repeat, warmup, seed, rate) at this
    launch's link rate; rank 0 writes the results to ``out_path`` and a progress line per cell."""
    from ..attention import ring_attention
    from ..backends import get_backend
    from ..context import RingContext
    from ..parallel.comm import resolve_comm
    from ..parallel.cost_measure import machine as cost_machine
    from .measure import idle_barrier, timed_calls

    spec = json.loads(Path(spec_path).read_text())
    comm = resolve_comm(None)
    rank = comm.Get_rank()
    be = get_backend("numpy")
    cfg = dict(warmup=spec["warmup"], repeat=spec["repeat"])
    results = []
    for i, cell in enumerate(spec["cells"]):
        start = time.monotonic()
        q, k, v, kw, mine, seg, counts = _inputs(comm, cell, spec["seed"])
        calls = {name: (lambda stats, ctx=dict(comm=comm, layout=cell["layout"], backend=be.name, schedule=schedule,
                                               head_parallel=u): ring_attention(q, k, v, **kw,
                                                                                context=RingContext(**ctx, stats=stats)))
                 for name, schedule, u in RUNS}
        walls = {name: [] for name in calls}
        chosen = None
        for name, call in calls.items():  # each schedule's warm-up (and auto's decision, kept)
            timed_calls(comm, be, call, dict(warmup=cfg["warmup"], repeat=0), {}, "forward")
            idle_barrier(comm)
        done, extra, order = 0, 0.0, rounds(list(calls), 1)[0]
        while order:
            start_round = time.monotonic()
            for name in order:
                out: dict = {}
                timed_calls(comm, be, calls[name], dict(warmup=0, repeat=1), out, "forward")
                got = comm.gather(out["forward"]["walls"][0], root=0)
                if rank == 0:
                    walls[name].append(max(got))
                    if name == "auto" and chosen is None:
                        chosen = _chosen(out["forward"]["records"][0])
            idle_barrier(comm)
            extra += time.monotonic() - start_round if done >= spec["repeat"] else 0.0
            done += 1
            order = comm.bcast(next_round(walls, done, extra, spec["repeat"], spec.get("max_repeat", spec["repeat"]),
                                          spec.get("cell_seconds", 0.0)) if rank == 0 else None, root=0)
        measured = {name: statistics.median(w) for name, w in walls.items()} if rank == 0 else {}
        predictions = _predictions(comm, be, cell, q, k, v, kw, mine, seg, counts)
        predicted = {name: p.seconds for name, p in predictions.items()}
        parts = cost_machine(comm, be, k.dtype, cell["dim"], cell["dim"])  # what they were predicted on
        if rank == 0:
            predicted["auto"] = predicted.get(chosen)
            results.append(dict(rate=spec["rate"], cell=cell, measured=measured, predicted=predicted,
                                auto_chosen=chosen, machine=dict(rate=parts.rate, intra=vars(parts.intra),
                                                                 inter=vars(parts.inter),
                                                                 inter_pairs=(None if parts.inter_pairs is None
                                                                              else vars(parts.inter_pairs)),
                                                                 block_overhead=parts.block_overhead,
                                                                 segment_rate=parts.segment_rate,
                                                                 call_seconds={name: p.fixed for name, p
                                                                               in predictions.items()})))
            print(f"schedule_grid: {spec['rate']} cell {i + 1}/{len(spec['cells'])} {label(results[-1])} "
                  f"{time.monotonic() - start:.1f} s; auto chose {chosen}", flush=True)
            Path(out_path).write_text(json.dumps(results))  # what is done survives a later failure
        idle_barrier(comm)


# ---- outside MPI: the cluster, the launches, the report -------------------------------------------

def _cluster_module():
    """``tests/cluster/netns_cluster.py`` of this source checkout, imported by path."""
    import importlib.util

    root = next((d for d in Path(__file__).resolve().parents if (d / "tests" / "cluster").is_dir()), None)
    if root is None:
        raise SystemExit("schedule_grid: needs a source checkout (tests/cluster/netns_cluster.py)")
    path = root / "tests" / "cluster" / "netns_cluster.py"
    spec = importlib.util.spec_from_file_location("netns_cluster", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["netns_cluster"] = module
    spec.loader.exec_module(module)
    return module


def _launch(cluster, spec: dict, timeout: float) -> List[dict]:
    """One ``mpirun`` of :func:`worker` on the cluster (its lines echoed as they come); the results."""
    import ringmpi

    shared = cluster.shared
    spec_path, out_path = shared / f"grid-{spec['rate']}.json", shared / f"grid-{spec['rate']}-out.json"
    spec_path.write_text(json.dumps(spec))
    src = str(Path(ringmpi.__file__).resolve().parents[1])
    env = cluster.mpi_env(RINGMPI_CACHE=shared / "cache",
                          PYTHONPATH=os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p))
    cmd = cluster.mpirun_command(HOSTS * RANKS_PER_HOST, [sys.executable, "-m", "ringmpi.bench.schedule_grid",
                                                          "--worker", spec_path, out_path],
                                 hosts=HOSTS, slots=RANKS_PER_HOST)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    deadline, tail = time.monotonic() + timeout, []
    try:
        for line in proc.stdout:  # the worker flushes a line per cell
            tail = (tail + [line])[-40:]
            if line.startswith("schedule_grid:"):
                print(line.rstrip(), file=sys.stderr, flush=True)
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {spec['rate']} launch passed its {timeout:.0f} s deadline")
        rc = proc.wait(timeout=max(deadline - time.monotonic(), 1))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            cluster.kill_jobs()
            proc.wait()
    if rc != 0:
        raise RuntimeError(f"the {spec['rate']} launch failed (exit {rc}):\n{''.join(tail)}")
    return json.loads(out_path.read_text())


def run_grid(cluster, rates: Sequence[str], cells: Sequence[dict], repeat: int, warmup: int, seed: int = 0,
             timeout: float = 3600.0, most: Optional[int] = None, cell_seconds: float = 0.0) -> List[dict]:
    """Every cell at every link rate on a started ``cluster`` (``netns_cluster.NetnsCluster``: its
    first two hosts, two ranks each): one launch per rate, the links of those hosts shaped for it
    and unshaped again at the end; the rows (:func:`cell_row`).  Each cell times ``repeat`` rounds,
    then up to ``most`` of its short calls while those take under ``cell_seconds``
    (:func:`next_round`).  The block rates are cached in the
    cluster's shared directory: measured by this grid's first launch, not taken from ``~``."""
    hosts = cluster.names[:HOSTS]
    (cluster.shared / "cache").mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        for rate in rates:
            for host in hosts:
                cluster.shape(host, None if rate == "unshaped" else rate)
            spec = dict(rate=rate, cells=list(cells), repeat=repeat, warmup=warmup, seed=seed,
                        max_repeat=max(most or repeat, repeat), cell_seconds=cell_seconds)
            rows += [cell_row(r) for r in _launch(cluster, spec, timeout)]
    finally:
        for host in hosts:
            cluster.shape(host, None)
    return rows


def machine_notes(rows: Sequence[dict]) -> List[str]:
    """What the model measured, per link rate: the block rate per head dim (FLOP/s of one rank,
    every rank computing), each link level's latency and bandwidth."""
    out = []
    for rate in dict.fromkeys(r["rate"] for r in rows):
        mine = [r for r in rows if r["rate"] == rate and r.get("machine")]
        if not mine:
            continue
        rates = {r["cell"]["dim"]: r["machine"]["rate"] for r in mine}
        m = mine[0]["machine"]
        link = lambda x: f"{1e6 * x['latency']:.0f} us, {x['bandwidth'] / 1e6:.0f} MB/s"  # noqa: E731
        out.append(f"model's parts at {rate}: block rate " + ", ".join(f"D={d} {x / 1e9:.1f} GFLOP/s"
                                                                     for d, x in sorted(rates.items()))
                   + f" per rank; intra-host link {link(m['intra'])}; inter-host link {link(m['inter'])}"
                   + (f"; inter-host link with every rank crossing at once {link(m['inter_pairs'])} "
                      f"(all of a host's flows)" if m.get("inter_pairs") else "")
                   + _block_notes(mine))
    return out


def _block_notes(mine: Sequence[dict]) -> str:
    """The block op's other measured parts per head dim, where the results hold them: its
    overhead per visiting K/V row and head, its rate with segment ids."""
    parts = []
    for d, m in sorted({r["cell"]["dim"]: r["machine"] for r in mine}.items()):
        if m.get("block_overhead") is not None:
            parts.append(f"D={d} block overhead {1e9 * m['block_overhead']:.0f} ns per K/V row and head")
        if m.get("segment_rate"):
            parts.append(f"D={d} block rate with segment ids {m['segment_rate'] / 1e9:.1f} GFLOP/s")
    calls = mine[0]["machine"].get("call_seconds")
    if calls:
        parts.append("per call (a minimal call's time) " + ", ".join(f"{name} {1e3 * s:.0f} ms"
                                                                     for name, s in calls.items()))
    return "".join(f"; {p}" for p in parts)


def notes(cores: int, rates: Sequence[str], quick: bool, repeat: int, warmup: int, most: Optional[int] = None,
          cell_seconds: float = 0.0) -> List[str]:
    ranks = HOSTS * RANKS_PER_HOST
    more = (f" (up to {most} of a schedule whose calls take under {SHORT_CALL:g} s, while those take under "
            f"{cell_seconds:g} s a cell)"
            if most and most > repeat and cell_seconds > 0 else "")
    out = [f"P = {ranks}: {HOSTS} hosts (network namespaces of one machine) x {RANKS_PER_HOST} ranks, "
           f"float32, forward only; rates {', '.join(rates)}; {warmup} warm-up + {repeat}{more} timed calls per "
           f"schedule in rounds (median of the slowest rank's){'; --quick' if quick else ''}"]
    if ranks > cores:
        out.append(f"oversubscribed: {ranks} ranks share {cores} cores ({ranks / cores:.2g} ranks per core); the "
                   f"model's block rate is timed with every rank computing at once, so it is the shared rate")
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ringmpi.bench.schedule_grid", description=__doc__.split("\n")[0])
    parser.add_argument("--rates", default=",".join(RATES),
                        help="link rates, comma separated: unshaped or tc's spelling (1gbit, 100mbit)")
    parser.add_argument("--quick", action="store_true", help="N 4096 and 8192, H 4, D 64, 2 repeats: minutes")
    parser.add_argument("--n", help="global lengths N, comma separated (default 4096,16384)")
    parser.add_argument("--heads", help="query heads H, comma separated (default 4,8)")
    parser.add_argument("--dims", help="head dims D, comma separated (default 64,128)")
    parser.add_argument("--masks", help=f"masks, comma separated, of {', '.join(MASKS)} (default all)")
    parser.add_argument("--repeat", type=int, help="timed calls per schedule (default 3; --quick 2)")
    parser.add_argument("--most", type=int, help=f"timed calls of a schedule whose calls take under {SHORT_CALL:g} s "
                                                 "(default 9)")
    parser.add_argument("--cell-seconds", type=float,
                        help="a cell's extra rounds of short calls stop once they took this long (default 5)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per rate's launch")
    parser.add_argument("--json", help="also write every result to this JSON file")
    parser.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return 0
    base = QUICK if args.quick else FULL
    ints = lambda text, default: tuple(int(x) for x in text.split(",")) if text else default  # noqa: E731
    masks = tuple(args.masks.split(",")) if args.masks else base["masks"]
    if set(masks) - set(MASKS):
        parser.error(f"--masks: of {', '.join(MASKS)}")
    cells = grid_cells(ints(args.n, base["ns"]), ints(args.heads, base["heads"]), ints(args.dims, base["dims"]),
                       masks)
    repeat = args.repeat or base["repeat"]
    most = max(args.most or base["most"], repeat)
    cell_seconds = base["cell_seconds"] if args.cell_seconds is None else args.cell_seconds
    rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    nc = _cluster_module()
    reason = nc.unavailable()
    if reason is not None:
        print(f"schedule_grid: no namespace cluster here: {reason}", file=sys.stderr)
        return 2
    for sig in (signal.SIGTERM, signal.SIGHUP):  # end through the finally below, as Ctrl-C does
        signal.signal(sig, lambda signum, frame: sys.exit(128 + signum))
    cluster = nc.NetnsCluster(hosts=HOSTS, slots=RANKS_PER_HOST)
    started = time.monotonic()
    try:
        cluster.start()
        rows = run_grid(cluster, rates, cells, repeat, base["warmup"], args.seed, args.timeout, most, cell_seconds)
    finally:
        cluster.stop(check=False)
        left = cluster.leftovers()
        if left:
            print(f"schedule_grid: left behind: {'; '.join(left)}", file=sys.stderr)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    text = format_report(rows, notes(cores, rates, args.quick, repeat, base["warmup"], most, cell_seconds)
                         + machine_notes(rows) + [f"{len(rows)} cells in {time.monotonic() - started:.0f} s"])
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(rows=rows, summary=summarize(rows)), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
