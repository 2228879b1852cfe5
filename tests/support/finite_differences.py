"""Finite differences through the ring: the one gradient check of the MPI case drivers.

The loss is the global ``sum(o * do)`` (each rank's share, summed with ``allreduce``), so its
gradients are what ``ring_attention_backward`` returns for ``do``; run in float64.
"""

import numpy as np

import ringmpi


def ring_fd_worst(comm, lay_q, lay_kv, q, k, v, do, kw, converters, rng, probes, eps, sinks=None,
                  directions=False):
    """The worst relative error ``|numeric - analytic| / max(1, |numeric|)`` of central differences
    of the loss through ``ringmpi.ring_attention(**kw)`` against the gathered gradients of
    ``ringmpi.ring_attention_backward(**kw)`` (``kw``: the calls' keywords, ``context`` among them): ``dq, dk, dv`` and, given ``sinks`` (replicated,
    passed as ``sinks=``), ``dsinks``.

    ``q, k, v, do`` are global arrays, placed by ``lay_q`` / ``lay_kv``; ``converters`` is the
    driver's ``(to backend, to host)``.  Each input is probed ``probes`` times in turn, from
    ``rng``: at a random entry (``eps`` on it), or with ``directions`` along a random
    standard-normal direction of its shape (``eps`` times it, against the gradient's dot product
    with the direction)."""
    rank = comm.Get_rank()
    to_backend, to_host = converters

    def shards(qg, kg, vg):
        return [to_backend(lay.shard(x, rank)) for lay, x in ((lay_q, qg), (lay_kv, kg), (lay_kv, vg))]

    def extra(sg):
        return {} if sg is None else {"sinks": to_backend(sg)}

    def loss(qg, kg, vg, sg=None):
        o = ringmpi.ring_attention(*shards(qg, kg, vg), **extra(sg), **kw).o
        return comm.allreduce(float(np.sum(to_host(o) * lay_q.shard(do, rank))))

    out = ringmpi.ring_attention(*shards(q, k, v), **extra(sinks), **kw)
    grads = ringmpi.ring_attention_backward(to_backend(lay_q.shard(do, rank)), *shards(q, k, v), out,
                                            **extra(sinks), **kw)
    full = [lay.unshard(comm.allgather(to_host(g)), axis=1) for lay, g in zip((lay_q, lay_kv, lay_kv), grads)]
    base = [q, k, v]
    if sinks is not None:
        full.append(to_host(grads[3]))
        base.append(sinks)
    worst = 0.0
    for which in range(len(base)):
        for _ in range(probes):
            plus, minus = list(base), list(base)
            if directions:
                direction = rng.standard_normal(base[which].shape)
                plus[which] = base[which] + eps * direction
                minus[which] = base[which] - eps * direction
                analytic = float(np.sum(full[which] * direction))
            else:
                idx = tuple(int(rng.integers(0, s)) for s in base[which].shape)
                plus[which], minus[which] = base[which].copy(), base[which].copy()
                plus[which][idx] += eps
                minus[which][idx] -= eps
                analytic = full[which][idx]
            numeric = (loss(*plus) - loss(*minus)) / (2 * eps)
            worst = max(worst, abs(numeric - analytic) / max(1.0, abs(numeric)))
    return worst
