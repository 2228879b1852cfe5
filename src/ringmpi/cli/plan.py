"""``ringmpi plan``: predict a run on a described cluster, no MPI and no GPU needed.

The model of ``schedule="auto"`` (:mod:`ringmpi.core.cost_model`) with the machine
described instead of measured: a preset of :mod:`ringmpi.core.machines` (every figure
overridable), the number of nodes, and the call's shape and mask.  Prints each
schedule's predicted time, its exposed communication, the bytes a rank receives and
the memory it holds, the recommendation (the fastest that fits), and the shard
length below which the ring cannot hide its transfers.
"""

from __future__ import annotations

import math
from dataclasses import replace

import click

from ..core.machines import PRESETS

DTYPE_SIZES = {"float16": (2, 4), "bfloat16": (2, 4), "float32": (4, 4), "float64": (8, 8)}


def _combine(fwd, bwd):
    """A forward and a backward prediction of one schedule as one (times and bytes summed)."""
    if bwd is None:
        return fwd
    return replace(fwd, seconds=fwd.seconds + bwd.seconds, compute=fwd.compute + bwd.compute,
                   bytes=fwd.bytes + bwd.bytes, memory=max(fwd.memory, bwd.memory), fits=fwd.fits and bwd.fits)


def predictions(shape, machine, ranks: int, head_parallel, backward: bool):
    """Every (schedule, U) of the plan, forward (+ backward) combined, fastest first."""
    from ..core.cost_model import predict_all

    fwd = predict_all(shape, machine, ranks, head_parallel=head_parallel)
    if not backward:
        return fwd
    bwd = {(p.schedule, p.head_parallel): p for p in
           predict_all(shape, machine, ranks, head_parallel=head_parallel, backward=True)}
    return sorted((_combine(p, bwd[(p.schedule, p.head_parallel)]) for p in fwd), key=lambda p: p.seconds)


def _size(nbytes: float) -> str:
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"


@click.command("plan")
@click.option("--preset", type=click.Choice(sorted(PRESETS)), default="h100-ib", show_default=True,
              help="The node and network described (figures in ringmpi.core.machines; each overridable).")
@click.option("--nodes", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--ranks-per-node", type=click.IntRange(min=1), default=None, help="[default: the preset's]")
@click.option("--rate", type=click.FloatRange(min=0, min_open=True), default=None, metavar="TFLOPS",
              help="One rank's attention rate, TFLOP/s (FlashAttention's count).")
@click.option("--backward-rate", type=click.FloatRange(min=0, min_open=True), default=None, metavar="TFLOPS",
              help="The backward's rate, TFLOP/s (2.5x the forward's FLOPs). [default: the preset's, else --rate]")
@click.option("--torus", default=None, metavar="AxB[xC]",
              help="A node's ranks wired as a torus with wraparound (a TPU slice's ICI; --intra-bw then one "
                   "link's), its dimensions multiplying to --ranks-per-node; none: a switch.")
@click.option("--intra-bw", type=click.FloatRange(min=0, min_open=True), default=None, metavar="GB/S",
              help="Bandwidth between ranks of a node, GB/s one direction.")
@click.option("--intra-latency", type=click.FloatRange(min=0), default=None, metavar="US")
@click.option("--inter-bw", type=click.FloatRange(min=0, min_open=True), default=None, metavar="GB/S",
              help="Bandwidth of one inter-node port, GB/s one direction.")
@click.option("--inter-latency", type=click.FloatRange(min=0), default=None, metavar="US")
@click.option("--ranks-per-nic", type=click.IntRange(min=1), default=None,
              help="Ranks of a node sharing one inter-node port.")
@click.option("--memory", type=click.FloatRange(min=0, min_open=True), default=None, metavar="GIB",
              help="Memory a rank may use for attention, GiB.")
@click.option("--n", "n", type=click.IntRange(min=1), required=True, help="Global sequence length N.")
@click.option("--heads", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--kv-heads", type=click.IntRange(min=1), default=None, help="[default: --heads]")
@click.option("--dim", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--dim-v", type=click.IntRange(min=1), default=None, help="[default: --dim]")
@click.option("--batch", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--dtype", type=click.Choice(sorted(DTYPE_SIZES)), default="bfloat16", show_default=True)
@click.option("--causal", is_flag=True)
@click.option("--window", type=(int, int), default=None, metavar="L R",
              help="Sliding window: query i sees keys i-L .. i+R (-1 = unbounded side).")
@click.option("--documents", default=None, metavar="lognormal:MEAN:SIGMA|FILE",
              help="Packed documents (lengths drawn log-normal, or read from FILE, summing to --n).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the drawn documents.")
@click.option("--backward", is_flag=True, help="Forward and backward (a training step's attention).")
@click.option("--head-parallel", default="auto", show_default=True, metavar="U|auto",
              help="U ranks per head x ring group; auto: every U that divides the node's ranks and the heads.")
def plan(preset, nodes, ranks_per_node, rate, backward_rate, torus, intra_bw, intra_latency, inter_bw, inter_latency, ranks_per_nic,
         memory, n, heads, kv_heads, dim, dim_v, batch, dtype, causal, window, documents, seed, backward,
         head_parallel):
    """Predict each schedule's time on a described cluster, and recommend one.

    No MPI and no GPU: the cost model of schedule="auto" with the machine described
    (a preset, its figures overridable) instead of measured.
    """
    from ..core.cost_model import Link, Shape, choose, hiding_length, mask_fractions
    from ..core.masks import window_sides

    m = PRESETS[preset].machine
    rpn = ranks_per_node or m.ranks_per_node
    if torus is None:
        dims = m.torus
    elif torus.lower() == "none":
        dims = None
    else:
        try:
            dims = tuple(int(d) for d in torus.lower().split("x"))
        except ValueError:
            dims = ()
        if not dims or min(dims) < 1:
            raise click.BadParameter(f"expected dimensions like 4x4 or none, got {torus!r}", param_hint="--torus")
    if dims is not None and math.prod(dims) != rpn:
        raise click.BadParameter(f"a torus of {'x'.join(map(str, dims))} holds {math.prod(dims)} ranks, not the "
                                 f"node's {rpn}: give the node's --torus (or none)", param_hint="--torus")
    machine = replace(
        m, ranks_per_node=rpn, torus=dims,
        rate=m.rate if rate is None else rate * 1e12,
        backward_rate=m.backward_rate if backward_rate is None else backward_rate * 1e12,
        intra=Link(m.intra.latency if intra_latency is None else intra_latency * 1e-6,
                   m.intra.bandwidth if intra_bw is None else intra_bw * 1e9),
        inter=Link(m.inter.latency if inter_latency is None else inter_latency * 1e-6,
                   m.inter.bandwidth if inter_bw is None else inter_bw * 1e9),
        ranks_per_nic=min(ranks_per_nic or m.nic_sharing, rpn),
        memory=m.memory if memory is None else memory * 2 ** 30)
    ranks = nodes * rpn
    kv_heads = heads if kv_heads is None else kv_heads
    if heads % kv_heads:
        raise click.BadParameter(f"--heads {heads} is not a multiple of --kv-heads {kv_heads}")
    lengths = None
    if documents is not None:
        from ..bench.documents import document_lengths

        try:
            lengths = document_lengths(documents, n, seed)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--documents") from None
    try:
        sides = window_sides(window)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--window") from None
    density, seen = mask_fractions(n, ranks, causal=causal, window=sides, documents=lengths)
    itemsize, grad = DTYPE_SIZES[dtype]
    shape = Shape(n_q=n, n_kv=n, batch=batch, heads=heads, kv_heads=kv_heads, dim=dim, dim_v=dim_v or dim,
                  itemsize=itemsize, grad_itemsize=grad, density=density, seen=seen)
    if head_parallel == "auto":
        us = [u for u in range(1, rpn + 1) if rpn % u == 0]
    else:
        try:
            us = [int(head_parallel)]
        except ValueError:
            raise click.BadParameter(f"expected a positive integer or auto, got {head_parallel!r}",
                                     param_hint="--head-parallel") from None
    found = predictions(shape, machine, ranks, us, backward)
    if not found:
        raise click.BadParameter(f"no U of {us} divides both P={ranks} and H={heads}", param_hint="--head-parallel")
    mask = "causal" if causal else "full"
    if window is not None:
        mask += f", window {window[0]} {window[1]}"
    if lengths is not None:
        mask += f", {len(lengths)} documents"
    click.echo(f"ringmpi plan: N={n} B={batch} H={heads} H_kv={kv_heads} D={dim}"
               + (f" D_v={dim_v}" if dim_v and dim_v != dim else "") + f" {dtype}, {mask} "
               f"(visible pairs {100 * density:.3g}%), {'forward + backward' if backward else 'forward'}")
    wiring = f" a link of a {'x'.join(map(str, machine.torus))} torus" if machine.torus else ""
    backward_rate = f" (backward {machine.backward_rate / 1e12:g})" if machine.backward_rate else ""
    click.echo(f"machine: {preset} x {nodes} node(s) x {rpn} ranks = P {ranks}; {machine.rate / 1e12:g} TFLOP/s"
               f"{backward_rate} a rank; intra {machine.intra.bandwidth / 1e9:g} GB/s "
               f"{machine.intra.latency * 1e6:g} us{wiring}, inter {machine.inter.bandwidth / 1e9:g} GB/s "
               f"{machine.inter.latency * 1e6:g} us ({machine.nic_sharing} rank(s) a port)"
               + (f"; {_size(machine.memory)} a rank" if machine.memory else ""))
    click.echo(f"{'schedule':<24} {'time s':>10} {'compute s':>10} {'exposed s':>10} {'exposed':>8} "
               f"{'recv/rank':>10} {'memory/rank':>12}  fits")
    for p in found:
        click.echo(f"{p.name:<24} {p.seconds:>10.4g} {p.compute:>10.4g} {p.exposed:>10.4g} "
                   f"{100 * p.exposed / p.seconds if p.seconds else 0:>7.1f}% {_size(p.bytes):>10} "
                   f"{_size(p.memory):>12}  {'yes' if p.fits else 'NO'}")
    best, runner = choose(found)
    if best is None:
        click.echo("recommended: none -- no schedule fits a rank's memory; more ranks or less per rank")
    else:
        click.echo(f"recommended: {best.name} ({best.seconds:.4g} s"
                   + (f"; runner-up {runner.name} {runner.seconds:.4g} s, {runner.seconds / best.seconds:.2f}x"
                      if runner else "") + ")")
    hide = hiding_length(shape, machine, ranks, backward=False)
    click.echo(f"the ring hides its transfers above {hide:,.0f} tokens per rank (this plan: {n / ranks:,.0f}, "
               + ("hidden" if n / ranks >= hide else "exposed") + ")")
