"""CUDA sources of the block kernels and their memoized per-device loader.

Each ``*.cu`` file is compiled with ``rules.h`` (the per-element rules, shared with the C
extension) and ``common.cuh`` prepended; ``#line``
directives make NVRTC report errors against the real files.  The sources
include no CUDA headers (16-bit conversions and ``mma.sync`` are inline PTX),
so compiling needs no CUDA toolkit, only NVRTC.  Templates are instantiated
through ``name_expressions``; :func:`instantiations` lists every one the CuPy
backend can request, and the compile test in CI builds exactly that list
from :func:`source`.

Nothing here imports CuPy at module level.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple

import numpy as np

from ..core import fixed_split
from ..core import masks
from ..core import philox
from ..core.global_tiles import TILE
from ..core.modifiers import MAX_KERNEL_MODIFIERS
from ..runtime.device import MIN_CC

KERNEL_DIR = Path(__file__).resolve().parent
RULES = "rules.h"  # masks, modifiers, Philox and dropout: the rules the C extension builds too
PREAMBLE = "common.cuh"
SOURCES = ("forward.cu", "backward.cu", "finalize.cu", "invariant.cu")
INVARIANT_SOURCE = "invariant.cu"  # invariant=True's kernels (ringmpi.backends.invariant_device)

# element kinds: common.cuh's KIND_* (KERNEL_DEFINES), stated here only
F16, BF16, F32, F64 = 0, 1, 2, 3
KIND_SIZE = {F16: 2, BF16: 2, F32: 4, F64: 8}
# The constants every kernel program shares with Python, stated here (or in core/) only:
# compile_options passes them to NVRTC as -D defines, and common.cuh #errors without them.
# MAX_HEAD_MODS: the per-head value slots of the score modifiers (ringmpi.core.modifiers);
# TILE_*: the tile classes (core.masks: classify_tile's values, and the host's pair classes
# that invariant.cu reads).
KERNEL_DEFINES = {"KIND_F16": F16, "KIND_BF16": BF16, "KIND_F32": F32, "KIND_F64": F64,
                  "MAX_HEAD_MODS": MAX_KERNEL_MODIFIERS,
                  "TILE_SKIP": masks.SKIP, "TILE_PARTIAL": masks.PARTIAL, "TILE_FULL": masks.FULL}
# Philox's constants (rules.h's PHILOX_*), stated in core.philox only; setup.py gives _ext the same
DROPOUT_DEFINES = philox.cuda_defines()

# Head dims are padded (with zeros, in shared memory) to one of these; the
# kernels take the true D at run time.
PADDED_DIMS = (32, 64, 96, 128, 192, 256)
MAX_HEAD_DIM = PADDED_DIMS[-1]
MMA_BACKWARD_MAX_DIM = 128   # larger f16/bf16 head dims use the SIMT backward
# A value head dim D_v != D: a pair whose padded buckets are equal runs the
# D == D_v kernels (D_v is a run-time argument); these (D bucket, D_v bucket)
# pairs are compiled too (template argument DVP): DeepSeek MLA's 192 / 128.
VALUE_DIM_BUCKETS = ((192, 128),)

# The block kernels' tile sizes, stated here only: forward.cu and backward.cu get them as -D
# defines (TILE_DEFINES, through compile_options; they #error without them), and the launch
# planning below sizes grids and shared memory with the same numbers.
FWD_MMA_BM, FWD_MMA_BN = 64, 64  # tensor-core forward: query rows, keys per CTA step
FWD_SIMT_BM = 32                 # SIMT forward: query rows per CTA (key tiles: _simt_bns)
BWD_MMA_BN = 64                  # tensor-core backward: keys per CTA
BWD_SIMT_MAX_THREADS = 256       # SIMT backward: min(this, BN * BN) threads per CTA
TILE_DEFINES = {"FWD_MMA_BM": FWD_MMA_BM, "FWD_MMA_BN": FWD_MMA_BN, "FWD_SIMT_BM": FWD_SIMT_BM,
                "BWD_MMA_BN": BWD_MMA_BN, "BWD_SIMT_MAX_THREADS": BWD_SIMT_MAX_THREADS}
TILE_SOURCES = ("forward.cu", "backward.cu")  # the programs that take TILE_DEFINES


def bwd_mma_rows(dp: int) -> int:
    """Query rows per inner step of the tensor-core backward at padded head dim ``dp``: 64 up to
    64, else 32 (its shared memory).  The kernel takes it as its template argument ``BM``."""
    return 64 if dp <= 64 else 32


def padded_dim(d: int) -> int:
    """The compiled head-dim bucket for a head dim ``d`` (1 <= d <= 256)."""
    for dp in PADDED_DIMS:
        if d <= dp:
            return dp
    raise ValueError(f"head dim {d} is larger than the supported maximum {MAX_HEAD_DIM}")


# CUDA launch limits (every compute capability): grid x, grid y/z, threads per block
GRID_X_MAX = 2 ** 31 - 1
GRID_YZ_MAX = 65535
MAX_THREADS = 1024
DEFAULT_SMEM = 48 * 1024     # dynamic shared memory per block without the opt-in attribute

# Compute capabilities, as major * 10 + minor (75 for 7.5).  The kernels run
# from sm_70 (Volta: MIN_CC, the GPU binding's, which refuses older devices); the
# tensor-core kernels (mma.sync m16n8k16, f16 and bf16) from sm_80 (Ampere).  On
# sm_70/75 the SIMT kernels run every dtype (bfloat16 as bits converted in
# registers: those GPUs have no bfloat16 instructions).
TENSOR_CORE_CC = 80
# The smallest opt-in shared memory per block of the GPUs of each kernel family:
# sm_80 and newer (8.6/8.9 allow 101376 bytes; 8.0 166912; 9.0 232448), and
# sm_70/75 (7.5 allows 65536; 7.0 98304).  A candidate after one that fits its
# family's smallest is never chosen, so it is not listed.
SMALLEST_OPTIN = 101376
SMALLEST_OPTIN_SIMT = 65536


def _check_cc(cc: Optional[int]) -> int:
    """``cc`` (major * 10 + minor; None: sm_80 and newer) as an int >= :data:`MIN_CC`
    (a ConfigError below: CUDA arrays on such a GPU are refused before any compute)."""
    cc = TENSOR_CORE_CC if cc is None else int(cc)
    if cc < MIN_CC:
        from ..runtime.errors import ConfigError
        raise ConfigError(f"compute capability {cc // 10}.{cc % 10} is below {MIN_CC // 10}.{MIN_CC % 10}: "
                          f"no ringmpi CUDA kernel runs there; RingContext(backend='numpy') runs it")
    return cc


def _tensor_cores(cc: Optional[int]) -> bool:
    return _check_cc(cc) >= TENSOR_CORE_CC


def _acc_size(kind: int) -> int:
    """Bytes of the compute (accumulator) type: float64 for F64, else float32."""
    return 8 if kind == F64 else 4


def _simt_bns(dp: int, kind: int, smallest: int = 8) -> Tuple[int, ...]:
    """Key tiles of the SIMT kernels, preferred first (smaller ones use less shared
    memory), down to ``smallest`` (the forward goes to 4: float64 at D > 192 on sm_70)."""
    first = 32 if dp * _acc_size(kind) <= 512 else 16
    return tuple(bn for bn in (32, 16, 8, 4) if smallest <= bn <= first)


def split_rows(rows: int) -> Tuple[int, int]:
    """``(Y, Z)`` grid dims covering ``rows`` (batch x head) rows, each <= 65535.

    The kernels decode ``row = blockIdx.z * gridDim.y + blockIdx.y`` (``cta_row``
    in common.cuh) and return at once when ``row >= rows``; ``Y * Z >= rows``
    and fewer than ``Z`` CTAs per tile are such padding.
    """
    rows = int(rows)
    if rows < 1:
        raise ValueError(f"a launch needs at least one (batch, head) row, got {rows}")
    z = -(-rows // GRID_YZ_MAX)
    if z > GRID_YZ_MAX:
        raise ValueError(f"{rows} (batch, head) rows exceed the CUDA grid ({GRID_YZ_MAX}**2)")
    return -(-rows // z), z


@functools.lru_cache(maxsize=None)
def source(filename: str) -> str:
    """The full NVRTC source of ``filename``: rules.h, common.cuh, then the file, with ``#line``."""
    parts = []
    for name in (RULES, PREAMBLE, filename):
        path = KERNEL_DIR / name
        parts.append(f'#line 1 "{path.as_posix()}"\n{path.read_text()}')
    return "\n".join(parts)


def value_dim_problem(d: int, d_v: int) -> Optional[str]:
    """Why the CUDA kernels cannot run head dim ``d`` with value head dim ``d_v``, or None."""
    if d_v <= MAX_HEAD_DIM and d <= MAX_HEAD_DIM:
        dp, dvp = padded_dim(d), padded_dim(d_v)
        if dp == dvp or (dp, dvp) in VALUE_DIM_BUCKETS:
            return None
    pairs = ", ".join(f"D in ({_bucket_floor(a)}, {a}] with D_v in ({_bucket_floor(b)}, {b}]"
                      for a, b in VALUE_DIM_BUCKETS)
    return (f"the CUDA kernels do not run head dim D={d} with value head dim D_v={d_v}: they take "
            f"D_v in the same head-dim bucket as D (buckets {PADDED_DIMS}) or {pairs}; "
            f"RingContext(backend='numpy') runs any pair")


def _bucket_floor(dp: int) -> int:
    i = PADDED_DIMS.index(dp)
    return PADDED_DIMS[i - 1] if i else 0


def _value_bucket(dp: int, d_v) -> Tuple[int, str]:
    """``(DVP, name-expression tail)`` of value head dim ``d_v`` next to head-dim bucket ``dp``."""
    dvp = dp if d_v is None else padded_dim(d_v)
    return dvp, ("" if dvp == dp else f", {dvp}")


# ------------------------------------------------------------ kernel choice
@dataclass(frozen=True)
class BlockKernel:
    """One compiled block kernel and how to launch it (no CuPy needed to plan).

    ``direction`` is ``"forward"`` (one CTA per query tile and (batch, head))
    or ``"backward"`` (one CTA per key tile and (batch, kv head)).  ``tiles`` is
    (query rows, keys) per CTA step; ``threads`` the CTA size; ``smem`` the
    dynamic shared memory in bytes.
    """

    direction: str
    filename: str
    expr: str
    tiles: Tuple[int, int]
    threads: int
    smem: int

    @property
    def tensor_cores(self) -> bool:
        """Whether this is an ``mma.sync`` kernel (q/do rounded to the K/V 16-bit type)."""
        return "_mma<" in self.expr

    @property
    def instantiation(self) -> Tuple[str, str]:
        """``(filename, name_expression)``, as :func:`instantiations` lists it."""
        return self.filename, self.expr

    def tile_counts(self, sq: int, skv: int) -> Tuple[int, int]:
        """``(query tiles, key tiles)`` of an ``sq x skv`` block."""
        bm, bn = self.tiles
        return -(-int(sq) // bm), -(-int(skv) // bn)

    def grid(self, batch: int, heads: int, kv_heads: int, sq: int, skv: int) -> Tuple[int, int, int]:
        """The launch grid ``(tiles, Y, Z)`` of one block: x is the query tile (forward) or
        the key tile, the last at x = 0 (backward: backward.cu's dq turns); ``(Y, Z) =
        split_rows(rows)`` with rows = ``batch * heads`` (forward) or ``batch * kv_heads``
        (backward)."""
        nqt, nkt = self.tile_counts(sq, skv)
        tiles, rows = (nqt, batch * heads) if self.direction == "forward" else (nkt, batch * kv_heads)
        if tiles > GRID_X_MAX:
            raise ValueError(f"{tiles} tiles exceed the CUDA grid x limit {GRID_X_MAX}")
        return (tiles,) + split_rows(rows)

    def block(self) -> Tuple[int]:
        return (self.threads,)

    def shared_mem_bytes(self) -> int:
        return self.smem

    def dq_turns(self, batch: int, heads: int, sq: int, skv: int, xp):
        """The backward's turn counters (zeros, int32, one per batch entry, query head and
        query tile): the key tiles add to dq in a fixed order, the last first (backward.cu), so
        that dq is bitwise repeatable."""
        nqt, _ = self.tile_counts(sq, skv)
        return xp.zeros(batch * heads * nqt, dtype=np.int32)

    def args(self, tensors: tuple, scale, mask_args: tuple, batch: int, heads: int, kv_heads: int,
             sq: int, skv: int, d: int, d_v: Optional[int] = None) -> tuple:
        """The kernel's argument tuple: ``tensors`` (forward: ``qh, kh, vh, o_acc, m, l``;
        backward: ``qh, doh, lse, dvec, kh, vh, dq, dk, dv, dq_turns``: :meth:`dq_turns`), the
        typed ``scale``,
        the ``MASK_PARAMS``, ``MOD_PARAMS`` then ``DROPOUT_PARAMS`` values (``mask_args``),
        then the int32 shape scalars (the value head dim ``d_v``, default ``d``, last)."""
        nqt, nkt = self.tile_counts(sq, skv)
        d_v = d if d_v is None else d_v
        shape = tuple(np.int32(x) for x in (batch, heads, kv_heads, sq, skv, d, nqt, nkt, d_v))
        return tuple(tensors) + (scale,) + tuple(mask_args) + shape


def forward_kernels(kind: int, d: int, d_v: Optional[int] = None, cc: Optional[int] = None
                    ) -> Tuple[BlockKernel, ...]:
    """Every forward kernel for K/V kind ``kind``, head dim ``d`` and value head
    dim ``d_v`` (default ``d``; see :func:`value_dim_problem`) on a GPU of compute
    capability ``cc`` (major * 10 + minor; None: sm_80 and newer), preferred first.

    f16/bf16: tensor cores (from sm_80), then the SIMT kernel; f32/f64: the
    exact SIMT kernel.  SIMT key tiles shrink (32, 16, 8, 4) to save shared
    memory; the list ends with the first kernel that fits its family's
    smallest opt-in limit (``SMALLEST_OPTIN``, ``SMALLEST_OPTIN_SIMT``).
    """
    dp = padded_dim(d)
    dvp, tail = _value_bucket(dp, d_v)
    out = []
    if kind in (F16, BF16) and _tensor_cores(cc):
        bm, bn = FWD_MMA_BM, FWD_MMA_BN
        smem = 2 * (bm * (dp + 8) + bn * (dp + 8) + dvp * (bn + 8))
        expr = f"ringmpi_forward_mma<{dp}, {'true' if kind == BF16 else 'false'}{tail}>"
        out.append(BlockKernel("forward", "forward.cu", expr, (bm, bn), 128, smem))
    bm, t = FWD_SIMT_BM, _acc_size(kind)
    for bn in _simt_bns(max(dp, dvp), kind, smallest=4):
        smem = t * (bm * (dp + 1) + bn * (dp + 1) + bn * (dvp + 1) + bm * (bn + 1))
        out.append(BlockKernel("forward", "forward.cu", f"ringmpi_forward_simt<{dp}, {kind}, {bn}{tail}>",
                               (bm, bn), 128, smem))
    return _reachable(out, cc)


def backward_kernels(kind: int, d: int, d_v: Optional[int] = None, cc: Optional[int] = None
                     ) -> Tuple[BlockKernel, ...]:
    """Every backward kernel for K/V kind ``kind``, head dim ``d`` and value head
    dim ``d_v`` (default ``d``) on compute capability ``cc`` (as for
    :func:`forward_kernels`), preferred first.  The tensor-core kernel (from
    sm_80) takes ``d_v`` only in ``d``'s bucket."""
    dp = padded_dim(d)
    dvp, tail = _value_bucket(dp, d_v)
    out = []
    if kind in (F16, BF16) and dp <= MMA_BACKWARD_MAX_DIM and dvp == dp and _tensor_cores(cc):
        bn, bm = BWD_MMA_BN, bwd_mma_rows(dp)
        smem = 4 * 2 * bm + 2 * (2 * bn * (dp + 8) + dp * (bn + 8) + 2 * bm * (dp + 8)
                                 + 2 * dp * (bm + 8) + bm * (bn + 8))
        expr = f"ringmpi_backward_mma<{dp}, {'true' if kind == BF16 else 'false'}, {bm}>"
        out.append(BlockKernel("backward", "backward.cu", expr, (bm, bn), 128, smem))
    t = _acc_size(kind)
    for bn in _simt_bns(max(dp, dvp), kind):
        smem = t * (2 * bn * (dp + 1) + 2 * bn * (dvp + 1) + 2 * bn * (bn + 1) + 2 * bn)
        threads = min(BWD_SIMT_MAX_THREADS, bn * bn)   # BWD_SIMT_THREADS in backward.cu
        out.append(BlockKernel("backward", "backward.cu",
                               f"ringmpi_backward_simt<{dp}, {kind}, {bn}{tail}>", (bn, bn), threads, smem))
    return _reachable(out, cc)


def _reachable(candidates, cc: Optional[int]) -> Tuple[BlockKernel, ...]:
    """``candidates`` up to the first that fits every GPU of ``cc``'s family
    (``SMALLEST_OPTIN`` from sm_80, ``SMALLEST_OPTIN_SIMT`` below); all of
    them when none does (float64 at D > 192 on sm_75 then has no kernel)."""
    floor = SMALLEST_OPTIN if _tensor_cores(cc) else SMALLEST_OPTIN_SIMT
    for i, kernel in enumerate(candidates):
        if kernel.smem <= floor:
            return tuple(candidates[:i + 1])
    return tuple(candidates)


KIND_NAMES = {F16: "float16", BF16: "bfloat16", F32: "float32", F64: "float64"}


def _fitting(candidates, smem_limit, what: str, cc: Optional[int]) -> BlockKernel:
    if smem_limit is None:
        return candidates[0]
    for kernel in candidates:
        if kernel.smem <= smem_limit:
            return kernel
    from ..runtime.errors import ConfigError
    where = "" if cc is None else f" of this compute capability {cc // 10}.{cc % 10} GPU"
    raise ConfigError(f"no {what} kernel fits in the {smem_limit} bytes of shared memory per block{where} "
                      f"(the smallest needs {min(k.smem for k in candidates)}); RingContext(backend='numpy') runs it")


def _what(direction: str, kind: int, d: int, d_v: Optional[int]) -> str:
    return f"{direction} ({KIND_NAMES[kind]}, D={d}, D_v={d_v or d})"


def forward_kernel(kind: int, d: int, smem_limit=None, d_v: Optional[int] = None,
                   cc: Optional[int] = None) -> BlockKernel:
    """The first of :func:`forward_kernels` (for compute capability ``cc``) whose
    dynamic shared memory fits ``smem_limit`` bytes (the device's opt-in limit;
    ``None``: no limit)."""
    return _fitting(forward_kernels(kind, d, d_v, cc), smem_limit, _what("forward", kind, d, d_v), cc)


def backward_kernel(kind: int, d: int, smem_limit=None, d_v: Optional[int] = None,
                    cc: Optional[int] = None) -> BlockKernel:
    """The first of :func:`backward_kernels` (for ``cc``) that fits ``smem_limit`` bytes."""
    return _fitting(backward_kernels(kind, d, d_v, cc), smem_limit, _what("backward", kind, d, d_v), cc)


# ------------------------------------------------------------ invariant=True
INVARIANT_KERNELS = ("max", "forward", "backward")
INVARIANT_TILE = TILE    # global positions per tile; threads per CTA
INVARIANT_STRIDE = TILE + 1  # the backward's shared tile row stride (no bank conflicts)
# invariant.cu's constants, stated here only: compile_options passes them as -D defines, with the
# fixed-point split's (core.fixed_split.cuda_defines: FIXED_LIMIT_1, ..., as in _ext/fixed.c)
INVARIANT_DEFINES = {"INV_TILE": INVARIANT_TILE, "INV_STRIDE": INVARIANT_STRIDE}


@dataclass(frozen=True)
class InvariantLaunch:
    """One of invariant.cu's kernels (``name`` in :data:`INVARIANT_KERNELS`) for the compute
    kind ``acc`` (F32: float math, for float16, bfloat16 and float32 inputs; F64) and how to
    launch it: one CTA of 64 threads per tile (a query tile for ``max`` and ``forward``, a key
    tile for ``backward``) and (batch, head) row."""

    name: str
    acc: int

    def __post_init__(self):
        if self.name not in INVARIANT_KERNELS or self.acc not in (F32, F64):
            raise ValueError(f"no invariant kernel {self.name!r} for kind {self.acc}")

    @property
    def instantiation(self) -> Tuple[str, str]:
        return INVARIANT_SOURCE, f"ringmpi_inv_{self.name}<{'double' if self.acc == F64 else 'float'}>"

    def grid(self, batch: int, heads: int, kv_heads: int, q_tiles: int, k_tiles: int) -> Tuple[int, int, int]:
        """``(tiles, Y, Z)``: x the query tile (``max``, ``forward``) or the key tile
        (``backward``), ``(Y, Z) = split_rows`` of ``batch * heads`` (``batch * kv_heads``)."""
        tiles, rows = ((k_tiles, batch * kv_heads) if self.name == "backward" else (q_tiles, batch * heads))
        if not 1 <= tiles <= GRID_X_MAX:
            raise ValueError(f"{tiles} tiles: a launch needs 1 to {GRID_X_MAX}")
        return (int(tiles),) + split_rows(rows)

    def block(self) -> Tuple[int]:
        return (INVARIANT_TILE,)

    def shared_mem_bytes(self) -> int:
        """The backward's 64 x 65 tile of the compute type and 64 int flags; 0 for the others
        (within the 48 KiB every GPU gives without the opt-in)."""
        if self.name != "backward":
            return 0
        return INVARIANT_TILE * INVARIANT_STRIDE * _acc_size(self.acc) + 4 * INVARIANT_TILE


def finalize_kernel(acc_kind: int, out_kind: int):
    return "finalize.cu", f"ringmpi_finalize<{acc_kind}, {out_kind}>"


def rowdot_kernel(acc_kind: int):
    return "finalize.cu", f"ringmpi_rowdot<{acc_kind}>"


def convert_kernel(in_kind: int, out_kind: int):
    return "finalize.cu", f"ringmpi_convert<{in_kind}, {out_kind}>"


def instantiations(cc: Optional[int] = None):
    """Every ``(filename, name_expression)`` the CuPy backend can request on a
    GPU of compute capability ``cc`` (major * 10 + minor; None: sm_80 and newer)."""
    out = []
    for kind in (F16, BF16, F32, F64):
        for dp in PADDED_DIMS:
            out.extend(k.instantiation for k in forward_kernels(kind, dp, cc=cc))
            out.extend(k.instantiation for k in backward_kernels(kind, dp, cc=cc))
        for dp, dvp in VALUE_DIM_BUCKETS:
            out.extend(k.instantiation for k in forward_kernels(kind, dp, dvp, cc))
            out.extend(k.instantiation for k in backward_kernels(kind, dp, dvp, cc))
    for acc in (F32, F64):
        for name in INVARIANT_KERNELS:
            out.append(InvariantLaunch(name, acc).instantiation)
        for o in (F16, BF16, F32, F64):
            out.append(finalize_kernel(acc, o))
        out.append(rowdot_kernel(acc))
    for other in (F16, F32, F64):
        out.append(convert_kernel(other, BF16))
        out.append(convert_kernel(BF16, other))
    seen, unique = set(), []
    for item in out:
        if item not in seen:
            seen.add(item)
            unique.append(item)
    return unique


def defines(filename: Optional[str] = None) -> dict:
    """The ``-D`` defines of ``filename``'s program: :data:`KERNEL_DEFINES` and
    :data:`DROPOUT_DEFINES` for every file; the block kernels' :data:`TILE_DEFINES` for
    forward.cu and backward.cu; invariant.cu's :data:`INVARIANT_DEFINES` and the fixed-point
    split's (:func:`ringmpi.core.fixed_split.cuda_defines`) for it."""
    out = dict(KERNEL_DEFINES)
    out.update(DROPOUT_DEFINES)
    if filename in TILE_SOURCES:
        out.update(TILE_DEFINES)
    if filename == INVARIANT_SOURCE:
        out.update(INVARIANT_DEFINES)
        out.update(fixed_split.cuda_defines())
    return out


def compile_options(filename: Optional[str] = None):
    """NVRTC options of ``filename``'s program, shared by the runtime loader and the compile
    test: its constants (:func:`defines`) as ``-D`` defines, and invariant.cu without
    contraction into FMA (``--fmad=false``: its passes must form a score the same bits in every
    kernel that forms it)."""
    fmad = ("--fmad=false",) if filename == INVARIANT_SOURCE else ()
    return ("--std=c++14",) + fmad + tuple(f"-D{name}={value}" for name, value in defines(filename).items())


@functools.lru_cache(maxsize=None)
def _module(filename: str, name_expr: str, device_id: int):
    import cupy
    with cupy.cuda.Device(device_id):
        return cupy.RawModule(code=source(filename), options=compile_options(filename),
                              name_expressions=(name_expr,))


@functools.lru_cache(maxsize=None)
def get_kernel(filename: str, name_expr: str, device_id: int, smem: int = 0):
    """The compiled ``cupy.RawKernel`` for one instantiation on one device,
    with its dynamic shared-memory limit raised to ``smem`` bytes."""
    import cupy
    with cupy.cuda.Device(device_id):
        kernel = _module(filename, name_expr, device_id).get_function(name_expr)
        if smem > 48 * 1024:
            kernel.max_dynamic_shared_size_bytes = smem
    return kernel
