"""``ringmpi make-data``: a reproducible random input file, written in parallel.

Values are standard normal, drawn per block of ``CHUNK_ROWS`` tokens from a
generator seeded by ``(seed, dataset, batch entry, block)``, so the file's
bytes depend on the seed and the shape only, never on the number of ranks.
Blocks are dealt to ranks round-robin and each round is one collective write.
"""

from __future__ import annotations

import math

import click
import numpy as np

from .. import __version__
from ..core.dtypes import resolve as resolve_dtype
from ..core.dtypes import to_dtype

CHUNK_ROWS = 2048
_STREAMS = {"q": 0, "k": 1, "v": 2, "do": 3}


def block(name: str, seed: int, b: int, c: int, n: int, heads: int, dim: int, dtype) -> np.ndarray:
    """Rows ``[c*CHUNK_ROWS, ...)`` of batch entry ``b`` of dataset ``name``: ``(rows, heads, dim)``."""
    rows = min(CHUNK_ROWS, n - c * CHUNK_ROWS)
    rng = np.random.default_rng([seed, _STREAMS[name], b, c])
    return to_dtype(rng.standard_normal((rows, heads, dim)), dtype)  # rounded once, also to bfloat16


def segment_ids(seed: int, stream: int, b: int, n: int, segments: int) -> np.ndarray:
    """Packed-document ids ``(n,)`` int32: ``segments`` documents with random boundaries."""
    count = min(segments, n) - 1
    rng = np.random.default_rng([seed, 100 + stream, b])
    cuts = np.sort(rng.choice(np.arange(1, n), size=count, replace=False)) if count > 0 else np.array([], int)
    return np.searchsorted(cuts, np.arange(n), side="right").astype(np.int32)


@click.command("make-data")
@click.argument("output_path", metavar="OUT.h5", type=click.Path(dir_okay=False))
@click.option("--n", "n", type=click.IntRange(min=1), required=True, help="Query length N.")
@click.option("--heads", type=click.IntRange(min=1), required=True, help="Query heads H.")
@click.option("--kv-heads", type=click.IntRange(min=1), default=None, help="K/V heads H_kv [default: H].")
@click.option("--dim", type=click.IntRange(min=1), required=True, help="Head dim D.")
@click.option("--dim-v", type=click.IntRange(min=1), default=None,
              help="Value head dim D_v of 'v' and 'do' [default: D].")
@click.option("--batch", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--n-kv", type=click.IntRange(min=1), default=None, help="K/V length [default: N].")
@click.option("--dtype", type=click.Choice(["float16", "bfloat16", "float32", "float64"]), default="float32",
              show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--with-do", is_flag=True, help="Also write 'do' (for --backward).")
@click.option("--segments", type=click.IntRange(min=0), default=0,
              help="Write segment ids with this many packed documents per batch entry.")
@click.option("--no-batch-axis", is_flag=True, help="Write 3-D (N, H, D) datasets (needs --batch 1).")
@click.option("--overwrite", is_flag=True, help="Replace an existing file.")
def make_data(output_path, n, heads, kv_heads, dim, dim_v, batch, n_kv, dtype, seed, with_do, segments,
              no_batch_axis, overwrite):
    """Write a reproducible random input file (same bytes for any number of ranks).

    \b
      mpirun -n 4 ringmpi make-data in.h5 --n 65536 --heads 8 --dim 64 --with-do
    """
    from ..runtime.errors import ConfigError
    from ..filejob.hdf5 import AtomicOutput, ShardIO, create_float_dataset
    from ..parallel.comm import dup_world

    comm = dup_world()
    rank, size = comm.Get_rank(), comm.Get_size()
    kv_heads = kv_heads or heads
    n_kv = n_kv or n
    if heads % kv_heads:
        raise ConfigError(f"--heads {heads} must be a multiple of --kv-heads {kv_heads}")
    if no_batch_axis and batch != 1:
        raise ConfigError("--no-batch-axis needs --batch 1")
    out = AtomicOutput(output_path, comm, overwrite=overwrite)
    dim_v = dim_v or dim
    names = [("q", n, heads, dim), ("k", n_kv, kv_heads, dim), ("v", n_kv, kv_heads, dim_v)]
    if with_do:
        names.append(("do", n, heads, dim_v))
    try:
        f = out.open()
        for name, length, h, width in names:
            shape = (length, h, width) if no_batch_axis else (batch, length, h, width)
            dset = create_float_dataset(f, name, shape, dtype, fill_time="never")
            row_axis = 0 if no_batch_axis else 1
            for b in range(batch):
                for first in range(0, math.ceil(length / CHUNK_ROWS), size):  # one round per `size` blocks
                    c = first + rank
                    rows = np.arange(c * CHUNK_ROWS, min((c + 1) * CHUNK_ROWS, length), dtype=np.int64)
                    data = (block(name, seed, b, c, length, h, width, dtype) if len(rows)
                            else np.empty((0, h, width), dtype=resolve_dtype(dtype)))
                    if no_batch_axis:
                        ShardIO(comm, rows).write(dset, row_axis, data)
                    else:
                        ShardIO(comm, rows).write(dset, row_axis, data[None], [(b, b + 1), (0, 0), (0, h), (0, width)])
        if segments:
            seg_names = [("segment_ids", n, 0)] if n == n_kv else [("segment_ids_q", n, 0), ("segment_ids_kv", n_kv, 1)]
            for name, length, stream in seg_names:
                ids = np.stack([segment_ids(seed, stream, b, length, segments) for b in range(batch)])
                dset = f.create_dataset(name, shape=(length,) if no_batch_axis else (batch, length), dtype="int32",
                                        fill_time="never")
                lo, hi = (rank * length) // size, ((rank + 1) * length) // size
                rows = np.arange(lo, hi, dtype=np.int64)
                if no_batch_axis:
                    ShardIO(comm, rows).write(dset, 0, ids[0, lo:hi])
                else:
                    ShardIO(comm, rows).write(dset, 1, ids[:, lo:hi])
        f.attrs.update({"ringmpi_version": __version__, "generator": "ringmpi make-data", "seed": seed,
                        "distribution": "standard normal per CHUNK_ROWS block, numpy default_rng"
                                        "([seed, dataset, batch, block])",
                        "chunk_rows": CHUNK_ROWS, "segments": segments})
        out.commit()
    except ConfigError:
        out.discard(collective=True)
        raise
    except BaseException:
        out.discard(collective=False)
        raise
    if rank == 0:
        shape = (n, heads, dim) if no_batch_axis else (batch, n, heads, dim)
        click.echo(f"wrote {out.path}: q {shape}, k/v N_kv={n_kv} H_kv={kv_heads}"
                   + (f" D_v={dim_v}" if dim_v != dim else "") + f", {dtype}, seed {seed}"
                   + (", with do" if with_do else "") + (f", {segments} segments" if segments else "")
                   + f" ({size} rank(s))")
    comm.Free()
