"""``ringmpi verify``: compare a result file with a float64 dense reference.

The reference is recomputed on one process, per batch entry, per head and per
block of query rows (memory ``O(rows_block * N_kv)``), once in float64 and once
naively in the input dtype; DESIGN.md's rule then bounds every output:
``max err <= 2 x naive err + 1e-6`` for ``o``/``lse`` and ``3 x naive err +
1e-5`` for ``dq``/``dk``/``dv``.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Dict, Optional, Tuple

import click
import numpy as np

from .dtypes import resolve as resolve_dtype

ROW_BLOCK = 1024


class DenseReference:
    """Dense attention of one batch entry, computed in ``dtype`` block by block.

    ``q (N_q, H, D)``, ``k, v (N_kv, H_kv, D)``, ``do`` like ``q`` or None;
    ``seg_q (N_q,)``/``seg_kv (N_kv,)`` ints or None.  Masks as in
    :mod:`ringmpi.masks` (bottom-right aligned).
    """

    def __init__(self, causal: bool, window, scale: float, dtype):
        self.causal, self.window, self.scale = causal, window, scale
        self.dtype = resolve_dtype(dtype)

    def _visible(self, rows, n_q, n_kv, seg_q, seg_kv):
        i = rows[:, None] + (n_kv - n_q)
        j = np.arange(n_kv)[None, :]
        vis = np.ones((len(rows), n_kv), dtype=bool)
        if self.causal:
            vis &= j <= i
        if self.window is not None:
            left, right = self.window
            if left is not None:
                vis &= j >= i - left
            if right is not None:
                vis &= j <= i + right
        if seg_q is not None:
            vis &= seg_q[rows][:, None] == seg_kv[None, :]
        return vis

    def compute(self, q, k, v, do=None, seg_q=None, seg_kv=None):
        """``{"o", "lse", and with do "dq", "dk", "dv"}`` in ``dtype``; lse ``(H, N_q)``."""
        dt = self.dtype

        def mm(a, b):  # a GEMM in dt: bfloat16 operands give a float32 product, rounded back
            return (a @ b).astype(dt, copy=False)

        n_q, heads, dim = q.shape
        n_kv, kv_heads, _ = k.shape
        group = heads // kv_heads
        scale = dt.type(self.scale)
        out = {"o": np.zeros(q.shape, dt), "lse": np.full((heads, n_q), -np.inf, dt)}
        if do is not None:
            out.update(dq=np.zeros(q.shape, dt), dk=np.zeros(k.shape, dt), dv=np.zeros(v.shape, dt))
        for h in range(heads):
            g = h // group
            kh, vh = k[:, g, :].astype(dt), v[:, g, :].astype(dt)
            for r0 in range(0, n_q, ROW_BLOCK):
                rows = np.arange(r0, min(r0 + ROW_BLOCK, n_q))
                qb = q[rows, h, :].astype(dt)
                vis = self._visible(rows, n_q, n_kv, seg_q, seg_kv)
                s = np.where(vis, mm(qb, kh.T) * scale, dt.type(-np.inf))
                m = s.max(axis=-1, keepdims=True)
                m = np.where(np.isfinite(m), m, 0).astype(dt)
                p = np.exp(s - m)
                l = p.sum(axis=-1, keepdims=True)
                seen = l > 0
                l_safe = np.where(seen, l, 1).astype(dt)
                p = np.where(seen, p / l_safe, 0).astype(dt)
                out["o"][rows, h, :] = mm(p, vh)
                with np.errstate(divide="ignore"):
                    out["lse"][h, rows] = np.where(seen[:, 0], m[:, 0] + np.log(l_safe[:, 0]), -np.inf)
                if do is None:
                    continue
                dob = do[rows, h, :].astype(dt)
                out["dv"][:, g, :] += mm(p.T, dob)
                dp = mm(dob, vh.T)
                ds = (p * (dp - (dp * p).sum(axis=-1, keepdims=True))).astype(dt, copy=False)
                out["dq"][rows, h, :] = mm(ds, kh) * scale
                out["dk"][:, g, :] += mm(ds.T, qb) * scale
        return out


def max_err(x, ref) -> float:
    """Max abs error; equal infinities count as exact, NaN or mismatched infinities as inf."""
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    if np.isnan(x).any():
        return math.inf
    same_inf = np.isinf(ref) & (x == ref)
    if (np.isinf(ref) & ~same_inf).any() or (np.isinf(x) & ~np.isinf(ref)).any():
        return math.inf
    with np.errstate(invalid="ignore"):
        diff = np.where(same_inf, 0.0, np.abs(x - ref))
    return float(diff.max()) if diff.size else 0.0


def _window_from_attr(value) -> Optional[Tuple[Optional[int], Optional[int]]]:
    value = np.asarray(value).ravel()
    if value.size == 0:
        return None
    return tuple(None if int(w) < 0 else int(w) for w in value)


def _check(in_path: str, out_path: str, max_n: int):
    """Rank 0's work: ``(exit status, report text)``; raises ConfigError for unusable files."""
    import h5py

    from .errors import ConfigError
    from .io import _inspect_serial, _peek, read_float_dataset

    spec, problem = _inspect_serial(in_path, backward=False)
    if problem:
        raise ConfigError(problem)
    if not h5py.is_hdf5(out_path):
        raise ConfigError(f"{out_path}: missing or not an HDF5 file")
    n = max(spec.n_q, spec.n_kv)
    if n > max_n:
        raise ConfigError(f"{in_path}: N={n} is above --max-n {max_n}; the dense reference needs "
                          f"O(N^2) time (raise --max-n if you mean it)")
    with _peek(out_path) as fo, _peek(in_path) as fi:
        for key in ("causal", "softmax_scale", "input_shapes"):
            if key not in fo.attrs:
                raise ConfigError(f"{out_path}: attribute '{key}' missing: not written by ringmpi run")
        shapes = json.loads(fo.attrs["input_shapes"])
        if {k: tuple(v) for k, v in shapes.items()} != spec.shapes:
            raise ConfigError(f"{out_path}: was computed from inputs shaped {shapes}, but {in_path} holds {spec.shapes}")
        causal = bool(fo.attrs["causal"])
        window = _window_from_attr(fo.attrs.get("window", []))
        scale = float(fo.attrs["softmax_scale"])
        names = [n for n in ("o", "lse", "dq", "dk", "dv") if n in fo]
        for name in ("o", "lse"):
            if name not in fo:
                raise ConfigError(f"{out_path}: missing dataset '{name}'")
        backward = "dq" in names
        if backward and not spec.has_do:
            raise ConfigError(f"{in_path}: has no 'do', but {out_path} holds gradients")
        lift = (lambda x: x) if spec.rank4 else (lambda x: x[None])
        load = {name: lift(read_float_dataset(fi[name])) for name in ("q", "k", "v") + (("do",) if backward else ())}
        ours = {name: lift(read_float_dataset(fo[name])) for name in names}
        segs = [None, None]
        if spec.seg_q:
            for i, (name, n_) in enumerate(((spec.seg_q, spec.n_q), (spec.seg_kv, spec.n_kv))):
                ids = fi[name][()].astype(np.int64)
                segs[i] = np.broadcast_to(ids, (spec.batch, n_))
    refs: Dict[str, list] = {name: [] for name in names}
    naives: Dict[str, list] = {name: [] for name in names}
    for b in range(spec.batch):
        args = [load["q"][b], load["k"][b], load["v"][b], load["do"][b] if backward else None,
                None if segs[0] is None else segs[0][b], None if segs[1] is None else segs[1][b]]
        for dtype, into in ((np.float64, refs), (spec.dtype, naives)):
            result = DenseReference(causal, window, scale, dtype).compute(*args)
            for name in names:
                into[name].append(result[name])
    lines = [f"verify {out_path} against a float64 dense reference of {in_path} "
             f"({'causal' if causal else 'full'}{f', window {window}' if window else ''}, scale {scale:.6g})",
             f"  {'dataset':8s} {'max abs err':>12s} {'max rel err':>12s} {'bound':>12s} {'naive err':>12s}  ok"]
    status = 0
    for name in names:
        ref, naive = np.stack(refs[name]), np.stack(naives[name])
        mine = ours[name]
        if mine.shape != ref.shape:
            raise ConfigError(f"{out_path}: dataset '{name}' has shape {mine.shape}, expected {ref.shape}")
        gradient = name in ("dq", "dk", "dv")
        factor, floor = (3.0, 1e-5) if gradient else (2.0, 1e-6)
        err, base = max_err(mine, ref), max_err(naive, ref)
        base = base if math.isfinite(base) else 0.0
        bound = factor * base + floor
        finite = np.isfinite(ref)
        scale_ref = float(np.abs(ref[finite]).max()) if finite.any() else 0.0
        rel = err / scale_ref if scale_ref > 0 else err
        ok = err <= bound
        status = status if ok else 1
        lines.append(f"  {name:8s} {err:12.3e} {rel:12.3e} {bound:12.3e} {base:12.3e}  {'yes' if ok else 'NO'}")
    lines.append("PASS: every output within tolerance" if status == 0 else "FAIL: some output is outside tolerance")
    return status, "\n".join(lines)


@click.command("verify")
@click.argument("input_path", metavar="IN.h5", type=click.Path(dir_okay=False))
@click.argument("output_path", metavar="OUT.h5", type=click.Path(dir_okay=False))
@click.option("--max-n", type=click.IntRange(min=1), default=8192, show_default=True,
              help="Refuse inputs longer than this (the reference is dense).")
def verify(input_path, output_path, max_n):
    """Compare OUT.h5 (from `ringmpi run`) with a float64 dense reference of IN.h5.

    Exit status 0 when every output is within DESIGN.md's tolerance, 1 when
    not, 2 for unusable files.  Mask settings come from OUT.h5's attributes.
    Under mpirun only rank 0 computes.
    """
    from mpi4py import MPI

    from .errors import ConfigError, agree

    comm = MPI.COMM_WORLD
    status, text, problem = 0, "", None
    if comm.Get_rank() == 0:
        try:
            status, text = _check(input_path, output_path, max_n)
        except ConfigError as exc:
            problem = str(exc)
    problem, status = comm.bcast((problem, status), root=0)
    agree(comm, problem)
    if comm.Get_rank() == 0:
        click.echo(text)
    if status:
        sys.exit(status)
