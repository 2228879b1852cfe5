"""Launch planning of the GPU block kernels, checked on CPU against CUDA's limits.

No GPU needed: :mod:`ringmpi.kernels` plans grid, block and shared memory
without CuPy.  The device limits are those of compute capability 7.0, 7.5,
8.0, 8.6, 8.9, 9.0 and 10.0 (``cudaDevAttrMaxSharedMemoryPerBlockOptin``);
below 8.0 the planner picks no tensor-core kernel.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from ringmpi import kernels as K
from ringmpi.runtime.errors import ConfigError

SMEM_OPTIN = {"7.0": 98304, "7.5": 65536, "8.0": 166912, "8.6": 101376, "8.9": 101376, "9.0": 232448,
              "10.0": 232448}
# where the planner has no kernel: float64 at D > 192 on 7.5 (its 64 KB per block)
NO_KERNEL = {("7.5", K.F64, d) for d in range(193, K.MAX_HEAD_DIM + 1)}


def _cc(text: str) -> int:
    major, minor = text.split(".")
    return int(major) * 10 + int(minor)
KINDS = (K.F16, K.BF16, K.F32, K.F64)
ROWS = (1, 7, 65535, 65536, 2 * 65535 + 1, 1_000_003, 2 ** 20)


def _within_cuda_grid(grid):
    x, y, z = grid
    return 1 <= x <= 2 ** 31 - 1 and 1 <= y <= 65535 and 1 <= z <= 65535


@pytest.mark.parametrize("cc", sorted(SMEM_OPTIN))
def test_every_chosen_kernel_fits_the_device(cc):
    limit, arch = SMEM_OPTIN[cc], _cc(cc)
    compiled = set(K.instantiations(arch))
    refused = set()
    for kind, d in itertools.product(KINDS, range(1, K.MAX_HEAD_DIM + 1)):
        try:
            kernels = (K.forward_kernel(kind, d, limit, cc=arch), K.backward_kernel(kind, d, limit, cc=arch))
        except ConfigError as exc:
            assert f"compute capability {cc} GPU" in str(exc) and "RingContext(backend='numpy')" in str(exc)
            refused.add((cc, kind, d))
            continue
        for kernel in kernels:
            where = f"cc {cc}, kind {kind}, D={d}: {kernel.expr}"
            assert kernel.shared_mem_bytes() <= limit, where
            assert kernel.tensor_cores <= (arch >= K.TENSOR_CORE_CC), where
            assert len(kernel.block()) == 1 and 32 <= kernel.block()[0] <= 1024, where
            assert kernel.block()[0] % 32 == 0, where
            assert kernel.instantiation in compiled, where   # the NVRTC test compiles it
            for rows in ROWS:
                heads = 8 if rows % 8 == 0 else 1
                batch = rows // heads
                assert _within_cuda_grid(kernel.grid(batch, heads, heads, 4096, 4096)), (where, rows)
                assert _within_cuda_grid(kernel.grid(batch, heads, 1, 1, 1)), (where, rows)
    assert refused == {x for x in NO_KERNEL if x[0] == cc}


def test_sm70_and_sm75_run_16_bit_inputs_through_the_simt_kernels():
    for cc in ("7.0", "7.5"):
        limit, arch = SMEM_OPTIN[cc], _cc(cc)
        for kind, dp in itertools.product((K.F16, K.BF16), K.PADDED_DIMS):
            assert not any(k.tensor_cores for k in K.forward_kernels(kind, dp, cc=arch))
            assert not any(k.tensor_cores for k in K.backward_kernels(kind, dp, cc=arch))
            assert "_simt<" in K.forward_kernel(kind, dp, limit, cc=arch).expr
    assert K.forward_kernel(K.F16, 64, SMEM_OPTIN["7.5"], cc=75).expr == "ringmpi_forward_simt<64, 0, 32>"
    assert K.backward_kernel(K.BF16, 128, SMEM_OPTIN["7.0"], cc=70).expr == "ringmpi_backward_simt<128, 1, 32>"
    assert K.backward_kernel(K.BF16, 128, SMEM_OPTIN["7.5"], cc=75).expr == "ringmpi_backward_simt<128, 1, 16>"
    assert K.forward_kernel(K.BF16, 256, SMEM_OPTIN["7.0"], cc=70).tiles == (32, 16)
    assert K.forward_kernel(K.BF16, 256, SMEM_OPTIN["7.5"], cc=75).tiles == (32, 8)
    # float64 at D = 256: 4-key forward tiles on 7.0 (96 KB); on 7.5 (64 KB) nothing fits
    assert K.forward_kernel(K.F64, 256, SMEM_OPTIN["7.0"], cc=70).tiles == (32, 4)
    assert K.backward_kernel(K.F64, 256, SMEM_OPTIN["7.0"], cc=70).tiles == (8, 8)
    assert K.forward_kernel(K.F64, 192, SMEM_OPTIN["7.5"], cc=75).tiles == (32, 4)
    with pytest.raises(ConfigError, match=r"no forward \(float64, D=200, D_v=200\) kernel fits in the 65536 bytes"):
        K.forward_kernel(K.F64, 200, SMEM_OPTIN["7.5"], cc=75)
    # float32/float64 choose what sm_80+ chooses wherever that fits the device
    for kind, d in itertools.product((K.F32, K.F64), K.PADDED_DIMS):
        for cc in ("7.0", "7.5"):
            for plan in (K.forward_kernel, K.backward_kernel):
                wide = plan(kind, d, SMEM_OPTIN["8.6"])
                if wide.smem <= SMEM_OPTIN[cc]:
                    assert plan(kind, d, SMEM_OPTIN[cc], cc=_cc(cc)) == wide, (cc, kind, d)


def test_below_sm70_nothing_is_planned():
    for plan in (K.forward_kernel, K.backward_kernel):
        with pytest.raises(ConfigError, match=r"compute capability 6\.1 is below 7\.0"):
            plan(K.F32, 64, 49152, cc=61)
    with pytest.raises(ConfigError, match="below 7.0"):
        K.instantiations(60)


def test_the_fastest_kernel_is_kept_where_it_fits():
    # tensor cores wherever they fit; on 8.6/8.9 the 256-wide f16 forward (104448 B) does not
    assert K.forward_kernel(K.F16, 256).smem == 104448
    assert K.forward_kernel(K.BF16, 256, SMEM_OPTIN["9.0"]).tensor_cores
    assert K.forward_kernel(K.BF16, 256, SMEM_OPTIN["8.0"]).tensor_cores
    small = K.forward_kernel(K.BF16, 256, SMEM_OPTIN["8.6"])
    assert not small.tensor_cores and small.smem <= 101376
    assert K.forward_kernel(K.F16, 192, SMEM_OPTIN["8.6"]).tensor_cores
    assert K.backward_kernel(K.F16, 128, SMEM_OPTIN["8.6"]).tensor_cores
    # float64 at D = 256: 136 KB with 16-key tiles, so 8-key tiles on 8.6/8.9
    assert K.backward_kernel(K.F64, 256).smem > 101376
    f64 = K.backward_kernel(K.F64, 256, SMEM_OPTIN["8.9"])
    assert f64.tiles == (8, 8) and f64.threads == 64 and f64.smem <= 101376
    assert K.forward_kernel(K.F64, 256, SMEM_OPTIN["8.6"]).tiles == (32, 8)
    assert K.forward_kernel(K.F64, 256, SMEM_OPTIN["9.0"]).tiles == (32, 16)


def test_a_limit_nothing_fits_is_a_config_error_before_launch():
    with pytest.raises(ConfigError, match="shared memory"):
        K.backward_kernel(K.F64, 256, 32 * 1024)


def test_simt_tile_shapes_satisfy_the_kernel_templates():
    """Integer divisions the SIMT kernels rely on (TPR, ND, NC, NR >= 1), on both families."""
    for kind, dp, cc in itertools.product(KINDS, K.PADDED_DIMS, (75, 80)):
        for kernel in K.forward_kernels(kind, dp, cc=cc):
            if not kernel.tensor_cores:
                bm, bn = kernel.tiles
                assert kernel.threads == 4 * bm and bn % 4 == 0 and dp % 4 == 0
        for kernel in K.backward_kernels(kind, dp, cc=cc):
            if not kernel.tensor_cores:
                bn, nth = kernel.tiles[1], kernel.threads
                assert kernel.tiles[0] == bn and nth == min(256, bn * bn)   # BWD_SIMT_THREADS
                tpr = nth // bn
                assert nth % bn == 0 and dp % tpr == 0 and bn // tpr >= 1 and bn % tpr == 0


def _decode_rows(y_dim: int, z_dim: int, rows: int) -> np.ndarray:
    """``cta_row`` of common.cuh for every (blockIdx.y, blockIdx.z), padding CTAs dropped:
    row = blockIdx.z * gridDim.y + blockIdx.y; a CTA with row >= rows returns."""
    by, bz = np.meshgrid(np.arange(y_dim, dtype=np.int64), np.arange(z_dim, dtype=np.int64), indexing="ij")
    row = bz * y_dim + by
    return row[row < rows]


@pytest.mark.parametrize("rows", ROWS)
def test_grid_covers_every_batch_head_row_exactly_once(rows):
    y_dim, z_dim = K.split_rows(rows)
    assert y_dim <= 65535 and z_dim <= 65535
    assert y_dim * z_dim - rows < z_dim            # few padding CTAs
    decoded = np.sort(_decode_rows(y_dim, z_dim, rows))
    np.testing.assert_array_equal(decoded, np.arange(rows))
    assert (decoded < 2 ** 31 - 1).all()           # fits the kernels' int row


def test_every_tile_and_row_once_through_a_kernel_grid():
    """(batch, head, tile) of every CTA, as forward.cu decodes it, for B*H > 65535."""
    kernel = K.forward_kernel(K.F32, 64)
    batch, heads, sq = 3, 23_000, 2 * kernel.tiles[0] + 1
    tiles, y_dim, z_dim = kernel.grid(batch, heads, heads, sq, 5)
    assert tiles == 3 and y_dim <= 65535
    seen = np.zeros((batch, heads, tiles), dtype=np.int64)
    rows = _decode_rows(y_dim, z_dim, batch * heads)
    for qt in range(tiles):                        # blockIdx.x
        np.add.at(seen, (rows // heads, rows % heads, qt), 1)   # b = bh / H, h = bh % H
    assert (seen == 1).all()


def test_kernels_decode_the_same_formula():
    """The .cu files use the one decode the emulation above follows."""
    common = K.source("forward.cu")
    assert "return (int)(blockIdx.z * gridDim.y + blockIdx.y);" in common
    fwd = (K.KERNEL_DIR / "forward.cu").read_text()
    bwd = (K.KERNEL_DIR / "backward.cu").read_text()
    assert fwd.count("bh = cta_row();") == 2 and fwd.count("if (bh >= a.B * a.H) return;") == 2
    assert bwd.count("bhk = cta_row();") == 2 and bwd.count("if (bhk >= a.B * a.Hkv) return;") == 2
    assert "blockIdx.y" not in fwd and "blockIdx.y" not in bwd


def test_too_many_rows_or_tiles_are_refused():
    with pytest.raises(ValueError):
        K.split_rows(65535 * 65535 + 1)
    with pytest.raises(ValueError):
        K.split_rows(0)
    kernel = K.forward_kernel(K.F32, 64)
    with pytest.raises(ValueError, match="grid x"):
        kernel.grid(1, 1, 1, kernel.tiles[0] * (2 ** 31), 1)


def test_only_reachable_candidates_are_compiled():
    """Each candidate after the first is needed by some GPU of its family (sm_80+, or
    sm_70/75); the last fits them all, except where nothing fits 7.5."""
    assert K.SMALLEST_OPTIN == min(v for cc, v in SMEM_OPTIN.items() if _cc(cc) >= 80)
    assert K.SMALLEST_OPTIN_SIMT == min(v for cc, v in SMEM_OPTIN.items() if _cc(cc) < 80)
    fallbacks = {80: set(), 75: set()}
    for arch, floor in ((80, K.SMALLEST_OPTIN), (75, K.SMALLEST_OPTIN_SIMT)):
        for kind, dp in itertools.product(KINDS, K.PADDED_DIMS):
            for candidates in (K.forward_kernels(kind, dp, cc=arch), K.backward_kernels(kind, dp, cc=arch)):
                assert all(k.smem > floor for k in candidates[:-1])
                assert candidates[-1].smem <= floor or (arch, kind, dp) == (75, K.F64, 256)
                fallbacks[arch].update(k.expr for k in candidates[1:])
    assert fallbacks[80] == {"ringmpi_forward_simt<256, 0, 16>", "ringmpi_forward_simt<256, 1, 16>",
                             "ringmpi_forward_simt<192, 3, 8>", "ringmpi_forward_simt<256, 3, 8>",
                             "ringmpi_backward_simt<192, 3, 8>", "ringmpi_backward_simt<256, 3, 8>"}
    assert K.instantiations(70) == K.instantiations(75) and K.instantiations(90) == K.instantiations()
    assert not any("_mma<" in expr for _, expr in K.instantiations(75))


# ---------------------------------------------------------------- invariant=True (invariant.cu)
@pytest.mark.parametrize("acc", (K.F32, K.F64))
@pytest.mark.parametrize("name", K.INVARIANT_KERNELS)
def test_invariant_kernels_plan_within_every_device(name, acc):
    plan = K.InvariantLaunch(name, acc)
    for cc in SMEM_OPTIN:
        assert plan.instantiation in K.instantiations(_cc(cc))
    assert plan.block() == (K.INVARIANT_TILE,) and K.INVARIANT_TILE <= K.MAX_THREADS
    # the backward's tile and flags need no opt-in on any GPU; the others no shared memory
    assert plan.shared_mem_bytes() <= K.DEFAULT_SMEM
    assert (plan.shared_mem_bytes() > 0) == (name == "backward")
    for rows, tiles in itertools.product(ROWS, (1, 2, 4096, 2 ** 31 - 1)):
        grid = plan.grid(rows, 1, 1, tiles, tiles)
        assert _within_cuda_grid(grid) and grid[0] == tiles
        y, z = grid[1:]
        assert y * z >= rows and (z - 1) * y < rows
    q_tiles, k_tiles = 3, 5
    assert plan.grid(2, 8, 2, q_tiles, k_tiles)[:2] == ((k_tiles, 4) if name == "backward" else (q_tiles, 16))
    with pytest.raises(ValueError):
        plan.grid(1, 1, 1, 0, 0)
    with pytest.raises(ValueError):
        K.InvariantLaunch(name, K.F16)


def test_invariant_constants_have_one_home():
    """invariant.cu defines none of its tile constants: NVRTC gets them from Python as -D defines,
    the tile being global_tiles' (the compile test builds the program with these options)."""
    import re

    from ringmpi.core.global_tiles import TILE

    text = (K.KERNEL_DIR / K.INVARIANT_SOURCE).read_text()
    options = K.compile_options(K.INVARIANT_SOURCE)
    assert K.INVARIANT_DEFINES == {"INV_TILE": TILE, "INV_STRIDE": TILE + 1}
    for name, value in K.INVARIANT_DEFINES.items():
        assert f"-D{name}={value}" in options and name in text
        assert not re.search(rf"^\s*#\s*define\s+{name}\b", text, flags=re.M), name


def test_tile_sizes_have_one_home():
    """The block kernels' tile sizes are Python's: forward.cu and backward.cu define none of them
    and #error without them, NVRTC gets them as -D defines, the launch planning sizes its tiles
    and threads with the same numbers, and the tensor-core backward's query rows (64 up to
    D = 64, else 32) are stated once, in ``bwd_mma_rows``, and reach the kernel as its template
    argument."""
    import re

    assert K.TILE_DEFINES == {"FWD_MMA_BM": 64, "FWD_MMA_BN": 64, "FWD_SIMT_BM": 32, "BWD_MMA_BN": 64,
                              "BWD_SIMT_MAX_THREADS": 256}
    assert set(K.TILE_SOURCES) == {"forward.cu", "backward.cu"}
    for filename in K.SOURCES:
        options = K.compile_options(filename)
        text = (K.KERNEL_DIR / filename).read_text()
        for name, value in K.TILE_DEFINES.items():
            assert (f"-D{name}={value}" in options) == (filename in K.TILE_SOURCES), (filename, name)
            assert not re.search(rf"^\s*#\s*define\s+{name}\b", text, flags=re.M), (filename, name)
        if filename in K.TILE_SOURCES:
            assert "#error" in text and all(f"defined({name})" in text for name in K.TILE_DEFINES
                                            if name in text), filename
    used = {name for filename in K.TILE_SOURCES for name in K.TILE_DEFINES
            if re.search(rf"\b{name}\b", (K.KERNEL_DIR / filename).read_text())}
    assert used == set(K.TILE_DEFINES)
    backward = (K.KERNEL_DIR / "backward.cu").read_text()
    assert not re.search(r"DP\s*<=\s*64", backward)  # the row rule is bwd_mma_rows' alone
    assert [K.bwd_mma_rows(dp) for dp in K.PADDED_DIMS if dp <= K.MMA_BACKWARD_MAX_DIM] == [64, 64, 32, 32]
    for kind in (K.F16, K.BF16):
        for d in (32, 64, 96, 128):
            dp = K.padded_dim(d)
            fwd, bwd = K.forward_kernels(kind, d)[0], K.backward_kernels(kind, d)[0]
            assert fwd.tiles == (K.FWD_MMA_BM, K.FWD_MMA_BN)
            assert bwd.tiles == (K.bwd_mma_rows(dp), K.BWD_MMA_BN)
            assert bwd.expr.endswith(f", {K.bwd_mma_rows(dp)}>")
    for kind in (K.F32, K.F64):
        for fwd in K.forward_kernels(kind, 64):
            assert fwd.tiles[0] == K.FWD_SIMT_BM
        for bwd in K.backward_kernels(kind, 64):
            assert bwd.threads == min(K.BWD_SIMT_MAX_THREADS, bwd.tiles[1] ** 2)


def test_shared_constants_have_one_home():
    """No CUDA or C source writes a constant it shares with Python.  The kernels get
    ``KERNEL_DEFINES`` (element kinds, ``MAX_HEAD_MODS``, tile classes) and ``DROPOUT_DEFINES``
    (Philox's, ``core.philox``) in every program, and invariant.cu also the fixed-point split
    (``core.fixed_split``), as ``-D`` defines of Python's values; common.cuh, rules.h and
    invariant.cu ``#error`` without them; ``_ext/fixed.c`` takes the split from setup.py the same
    way (``test_fixed_add`` holds the built module to it), ``_ext/fused.c`` rules.h's
    (``test_rules`` holds it to Python's rules).  No source
    holds one of the split's numbers as a literal (hexadecimal float or IEEE bits)."""
    import re
    import struct
    from pathlib import Path

    from ringmpi.core import fixed_split, masks, philox
    from ringmpi.core.modifiers import MAX_KERNEL_MODIFIERS

    assert K.KERNEL_DEFINES == {"KIND_F16": K.F16, "KIND_BF16": K.BF16, "KIND_F32": K.F32, "KIND_F64": K.F64,
                                "MAX_HEAD_MODS": MAX_KERNEL_MODIFIERS, "TILE_SKIP": masks.SKIP,
                                "TILE_PARTIAL": masks.PARTIAL, "TILE_FULL": masks.FULL}
    assert K.DROPOUT_DEFINES == philox.cuda_defines()
    assert {k: int(v.rstrip("u"), 0) for k, v in K.DROPOUT_DEFINES.items()} == philox.constants()
    assert len(set(K.KIND_SIZE)) == 4 and set(K.KIND_SIZE) == {K.F16, K.BF16, K.F32, K.F64}
    split = fixed_split.constants()
    assert split == {"FIXED_LIMIT_1": 2.0 ** 62, "FIXED_LIMIT_2": 2.0 ** 92, "FIXED_LIMB": 2.0 ** 30,
                     "FIXED_LIMB_INV": 2.0 ** -30}
    for filename in K.SOURCES:
        want = dict(K.KERNEL_DEFINES, **K.DROPOUT_DEFINES)
        if filename == K.INVARIANT_SOURCE:
            want.update(K.INVARIANT_DEFINES, **fixed_split.cuda_defines())
        if filename in K.TILE_SOURCES:
            want.update(K.TILE_DEFINES)
        assert K.defines(filename) == want
        options = K.compile_options(filename)
        for name, value in want.items():
            assert f"-D{name}={value}" in options, (filename, name)
    # the rendered literals are exactly Python's values
    for name, value in split.items():
        assert float.fromhex(fixed_split.c_defines()[name]) == value
        bits = re.fullmatch(r"__longlong_as_double\((0x[0-9a-f]+)LL\)", fixed_split.cuda_defines()[name])
        assert struct.unpack("<d", struct.pack("<Q", int(bits.group(1), 16)))[0] == value
    assert fixed_split.c_defines()["FIXED_LIMB_BITS"] == str(fixed_split.LIMB_BITS)

    fixed_c = Path(fixed_split.__file__).resolve().parents[1] / "_ext" / "fixed.c"
    fused_c = fixed_c.with_name("fused.c")
    texts = {path: path.read_text() for path in sorted(K.KERNEL_DIR.iterdir()) if path.suffix in (".cu", ".cuh", ".h")}
    texts[fixed_c] = fixed_c.read_text()
    texts[fused_c] = fused_c.read_text()
    names = set(K.KERNEL_DEFINES) | set(K.DROPOUT_DEFINES) | set(K.INVARIANT_DEFINES) | set(fixed_split.c_defines())
    for path, text in texts.items():
        defined = set(re.findall(r"^\s*#\s*define\s+(\w+)", text, flags=re.M))
        assert not defined & names, (path.name, defined & names)
        hexfloats = {float.fromhex(h) for h in re.findall(r"\b0x[0-9a-fA-F.]+p[+-]?\d+", text)}
        ieee = {struct.unpack("<d", struct.pack("<Q", int(b, 16)))[0] for b in re.findall(r"\b0x([0-9a-fA-F]{16})", text)}
        assert not (hexfloats | ieee) & set(split.values()), path.name
    # each source refuses to compile without its defines, and uses each (outside comments and #if)
    code = {path: re.sub(r"//[^\n]*|/\*.*?\*/|^\s*#\s*(?:if|error)[^\n]*(?:\\\n[^\n]*)*", "", text, flags=re.S | re.M)
            for path, text in texts.items()}
    kernels = "\n".join(c for path, c in code.items() if path not in (fixed_c, fused_c))
    tiles = {k: v for k, v in K.KERNEL_DEFINES.items() if k.startswith("TILE_")}
    kinds = {k: v for k, v in K.KERNEL_DEFINES.items() if k not in tiles}
    for path, wanted in ((K.KERNEL_DIR / K.PREAMBLE, kinds), (K.KERNEL_DIR / K.RULES, {**tiles, **K.DROPOUT_DEFINES}),
                         (K.KERNEL_DIR / K.INVARIANT_SOURCE, split),
                         (fixed_c, fixed_split.c_defines())):
        for name in wanted:
            assert f"!defined({name})" in texts[path], (path.name, name)
            assert re.search(rf"\b{name}\b", kernels if path != fixed_c else code[fixed_c]), (path.name, name)


def test_invariant_slot_maps_name_each_tile_slots_local_row():
    from ringmpi.backends.invariant_device import slot_map
    from ringmpi.core.global_tiles import TILE, Tiling
    from ringmpi.core.layout import Layout

    rng = np.random.default_rng(37)
    shards = [Layout("zigzag", 1024, 4).indices(1), np.arange(1000 - 232, 1000),  # a short last tile
              rng.permutation(np.concatenate([np.arange(128, 192), np.arange(640, 704)]))]
    for pos in shards:
        tiling = Tiling.of(pos)
        slots = slot_map(tiling)
        assert slots.dtype == np.int32 and slots.shape == (tiling.count * TILE,)
        held = slots >= 0
        assert np.array_equal(held, tiling.valid.ravel())
        # a held slot's local row holds that slot's global position; every local row once
        assert np.array_equal(pos[slots[held]], tiling.pos.ravel()[held])
        assert sorted(slots[held].tolist()) == list(range(len(pos)))
