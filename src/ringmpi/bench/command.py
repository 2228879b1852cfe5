"""The ``ringmpi bench`` command: its options, their checks, and which mode runs.

    mpirun -n 4 ringmpi bench --n 16384 --causal --layout zigzag --backward \\
        --json bench.json --plot timeline.png
    mpirun -n 4 ringmpi bench --sweep weak --n 4096 --json weak.json --plot weak.png
    mpirun -n 4 ringmpi bench --n 65536 --documents lognormal:2048:1.0 --causal --backward

Modes: the ring, one run or a strong/weak sweep (:mod:`ringmpi.bench.ring`);
``--sweep head-parallel`` (:mod:`ringmpi.bench.head_parallel`); ``--decode``
(:mod:`ringmpi.bench.decode`); ``--linear`` (:mod:`ringmpi.bench.linear`: the linear-attention
layers' scan); ``--documents`` (:mod:`ringmpi.bench.documents`: a
pack of documents, zigzag + ring against balanced + routed).  Every rank generates its own synthetic shard
(no file I/O); the figures are defined in :mod:`ringmpi.bench.summary`.
"""

from __future__ import annotations

import click

from ..core.layout import KINDS
from ..options import SCHEDULES
from ..cli.flags import attention_flags
from ..core.modifiers import FIELDS as MODIFIER_FIELDS

INSTALL_PLOT = "pip install 'ringmpi[plot]'"


@click.command("bench")
@click.option("--n", "n", type=click.IntRange(min=1), default=4096, show_default=True,
              help="Global sequence length (per-rank length S_local with --sweep weak).")
@click.option("--heads", type=click.IntRange(min=1), default=8, show_default=True, help="Query heads H.")
@click.option("--kv-heads", type=click.IntRange(min=1), default=None,
              help="Key/value heads (GQA/MQA); must divide --heads.  [default: --heads]")
@click.option("--dim", type=click.IntRange(min=1), default=64, show_default=True, help="Head dimension D.")
@click.option("--dim-v", type=click.IntRange(min=1), default=None,
              help="Value head dimension D_v of v, o, do [default: D].")
@click.option("--batch", type=click.IntRange(min=1), default=1, show_default=True, help="Batch size B.")
@click.option("--dtype", type=click.Choice(["float16", "bfloat16", "float32", "float64"]), default="float32",
              show_default=True)
@click.option("--layout", type=click.Choice(KINDS), default="contiguous", show_default=True,
              help="Token layout over ranks (zigzag/striped balance causal work).")
@click.option("--backward", is_flag=True, help="Also time ring_attention_backward.")
@click.option("--repeat", type=click.IntRange(min=1), default=5, show_default=True, help="Timed calls per phase.")
@click.option("--warmup", type=click.IntRange(min=0), default=1, show_default=True,
              help="Untimed calls before the timed ones.")
@click.option("--backend", type=click.Choice(["auto", "numpy", "cupy"]), default="auto", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the synthetic inputs.")
@click.option("--sweep", type=click.Choice(["strong", "weak", "head-parallel"]), default=None,
              help="Scaling sweep over P = 1, 2, 4, ... ranks of the job; head-parallel: every U "
                   "dividing P and H on all ranks (ringmpi.bench.head_parallel).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Write every figure and the environment to this JSON file.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help=f"Write a PNG: per-rank step timeline, or efficiency against P with --sweep ({INSTALL_PLOT}).")
@click.option("--decode", is_flag=True, help="Time decode_attention over a sharded cache against the ring "
              "(ringmpi.bench.decode; P = 1, 2, 4, ... of the job).")
@click.option("--cache", type=click.IntRange(min=1), default=16384, show_default=True,
              help="With --decode: cache length N.")
@click.option("--new", type=click.IntRange(min=1), default=1, show_default=True,
              help="With --decode: new tokens per call S_new.")
@click.option("--sinks", is_flag=True, help="Attention sinks: one random logit per query head (ring only).")
@click.option("--documents", default=None, metavar="lognormal:MEAN:SIGMA|FILE",
              help="A pack of documents (lengths drawn log-normal with that mean, or read from FILE, summing "
                   "to --n): zigzag + ring against balanced + routed, per rank visible pairs, bytes, time.")
@click.option("--linear", type=click.Choice(["gdn", "gla", "linear"]), default=None,
              help="Time a linear-attention layer on contiguous shards instead (ringmpi.bench.linear): gated "
                   "delta rule, scalar decay or plain; bytes per rank for N = --n/16 .. --n, strong and weak "
                   "scaling at --n/16 over P = 1, 2, 4, ... (--heads, --dim = K, --dim-v = V, float32/float64).")
@click.option("--quiet", "-q", is_flag=True, help="No progress report on rank 0 (the calls, their ring steps, "
              "the time left).")
@attention_flags("causal", "window", "softcap", *MODIFIER_FIELDS, "dropout_p", "head_parallel", "invariant",
                 "schedule", schedule=dict(type=click.Choice(SCHEDULES), help="How K/V move (ring, routed, "
                                           "allgather, or auto: the fastest predicted that fits memory; its "
                                           "choice and prediction are in the report) [default: ring]."),
                 causal=dict(help="Causal mask."), softcap=dict(help="Logit softcap C > 0 (ring only)."),
                 window=dict(help="Sliding window: query i sees keys i-L .. i+R (-1 = unbounded side; ring only)."),
                 dropout_p=dict(show_default=True, help="Dropout on the attention weights (0 <= P < 1), seeded "
                                "by --seed; the torch SDPA column runs without dropout."),
                 head_parallel=dict(help="Time the head x ring schedule with U ranks per group "
                                         "[default: RINGMPI_HEAD_PARALLEL, else 1]."))
def bench(n, heads, kv_heads, dim, dim_v, batch, dtype, layout, backward, repeat, warmup, backend, seed,
          sweep, json_path, plot_path, decode, cache, new, sinks, documents, linear, quiet, causal, window, softcap,
          dropout_p, head_parallel, invariant, schedule, **modifiers):
    """Time the ring: per-step timeline, exposed communication, balance, scaling.

    Launch under MPI (``mpirun -n P ringmpi bench ...``); rank 0 prints the
    report.  Figures are defined in ``ringmpi.bench.summary``'s module docstring.
    """
    from ..backends import get_backend
    from ..runtime.errors import agree
    from ..parallel.comm import resolve_comm

    kv_heads = heads if kv_heads is None else kv_heads
    dim_v = dim if dim_v is None else dim_v
    if decode:
        from .decode import run
        return run(dict(cache=cache, new=new, batch=batch, heads=heads, kv_heads=kv_heads, dim=dim, dtype=dtype,
                        layout=layout, repeat=repeat, warmup=warmup, backend=backend, seed=seed,
                        **({"dim_v": dim_v} if dim_v != dim else {})), json_path)
    comm = resolve_comm(None)
    if linear is not None:
        from .linear import run as run_linear
        agree(comm, None if dtype in ("float32", "float64") else "--linear runs in float32 or float64")
        return run_linear(comm, dict(linear=linear, n=n, batch=batch, heads=heads, dim=dim, dim_v=dim_v, dtype=dtype,
                                     backward=backward, repeat=repeat, warmup=warmup, seed=seed), json_path)
    dropout = dropout_p
    head_parallel, problem = _problem(heads, kv_heads, softcap, plot_path, dropout, seed, head_parallel, sweep,
                                      window=window, modifiers=modifiers)
    agree(comm, problem)
    if backend == "cupy":
        from ..runtime.device import require_gpu
        require_gpu(comm)
    be = get_backend(backend)
    cfg = dict(batch=batch, heads=heads, kv_heads=kv_heads, dim=dim, dtype=dtype, causal=causal,
               layout=layout, backward=backward, repeat=repeat, warmup=warmup, seed=seed)
    if dim_v != dim:
        cfg["dim_v"] = dim_v
    if head_parallel != 1:
        cfg["head_parallel"] = head_parallel
    if softcap is not None or sinks:  # only then: the report of a plain run keeps its keys
        cfg.update(softcap=softcap, sinks=bool(sinks))
    if window is not None:
        cfg["window"] = list(window)
    cfg.update({name: [float(x) for x in values] for name, values in modifiers.items() if values is not None})
    if dropout:
        cfg["dropout"] = float(dropout)
    if invariant:
        cfg["invariant"] = True
    if schedule is not None:
        cfg["schedule"] = schedule
    if documents is not None:
        from .documents import document_lengths, run as run_documents
        try:
            document_lengths(documents, n, seed)
            problem = None
        except ValueError as exc:
            problem = f"--documents: {exc}"
        used = any(values is not None for values in modifiers.values())
        if problem is None and (sweep or dim_v != dim or head_parallel != 1 or softcap is not None or sinks
                                or dropout or plot_path or used):
            problem = "--documents compares two placements on one problem: without --sweep, --dim-v, " \
                      "--head-parallel, --softcap, --sinks, score modifiers, --dropout or --plot"
        agree(comm, problem)
        return run_documents(comm, be, {k: cfg[k] for k in ("batch", "heads", "kv_heads", "dim", "dtype", "causal",
                                                            "backward", "repeat", "warmup", "seed")
                                        + (("window",) if window is not None else ())},
                             n, documents, json_path)
    from ..cli.progress import Progress
    from ..parallel.ring_schedule import observe_steps

    with observe_steps(Progress(comm.Get_rank(), quiet=quiet)) as progress:
        if sweep == "head-parallel":
            from .head_parallel import run as run_head_parallel
            return run_head_parallel(comm, be, cfg, n, json_path, plot_path, progress)
        from .ring import run as run_ring
        run_ring(comm, be, cfg, n, sweep, json_path, plot_path, progress)


def _problem(heads, kv_heads, softcap, plot_path, dropout, seed, head_parallel, sweep, window=None,
             modifiers=None):
    """``(U or "auto", the first problem of the options or None)``; the attention options'
    rules are :class:`ringmpi.options.AttentionOptions`'s."""
    from ..options import AttentionOptions, option_edge

    options = AttentionOptions(softcap=softcap, dropout_p=dropout, window=window, **(modifiers or {}),
                               dropout_seed=(seed if seed >= 0 else None) if dropout else None)
    found = options.field_problem(heads)
    problem = None
    flags = dict(softcap="--softcap", dropout="--dropout/--seed", window="--window",
                 **{name: option_edge(name)["flag"] for name in MODIFIER_FIELDS})
    if heads % kv_heads:
        problem = f"--heads ({heads}) must be a multiple of --kv-heads ({kv_heads})"
    elif found is not None:  # the only options given: softcap, dropout, window, ALiBi
        problem = f"{flags[found[0]]}: {found[1]}"
    elif plot_path and not _have_matplotlib():
        problem = f"--plot needs matplotlib: {INSTALL_PLOT}"
    else:
        return _head_parallel_option(head_parallel, sweep)
    return head_parallel, problem


def _head_parallel_option(value, sweep):
    """``(U or "auto", problem)`` of ``--head-parallel`` (default ``RINGMPI_HEAD_PARALLEL``, else 1)."""
    from ..parallel.topology import head_parallel_setting
    from ..runtime import env

    try:
        setting = head_parallel_setting(value if value is not None else env.head_parallel())
    except ValueError as exc:
        return 1, f"--head-parallel: {exc}"
    if sweep in ("strong", "weak") and setting != 1:
        return setting, f"--head-parallel {setting} with --sweep {sweep}: use --sweep head-parallel to compare U"
    if sweep == "head-parallel" and value is not None:
        return setting, "--sweep head-parallel runs every U: drop --head-parallel"
    return setting, None


def _have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True
