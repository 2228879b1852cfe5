"""Launch planning of the GPU block kernels, checked on CPU against CUDA's limits.

No GPU needed: :mod:`ringmpi.kernels` plans grid, block and shared memory
without CuPy.  The device limits are those of compute capability 8.0, 8.6,
8.9 and 9.0 (``cudaDevAttrMaxSharedMemoryPerBlockOptin``).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from ringmpi import kernels as K
from ringmpi.errors import ConfigError

SMEM_OPTIN = {"8.0": 166912, "8.6": 101376, "8.9": 101376, "9.0": 232448}
KINDS = (K.F16, K.BF16, K.F32, K.F64)
ROWS = (1, 7, 65535, 65536, 2 * 65535 + 1, 1_000_003, 2 ** 20)


def _within_cuda_grid(grid):
    x, y, z = grid
    return 1 <= x <= 2 ** 31 - 1 and 1 <= y <= 65535 and 1 <= z <= 65535


@pytest.mark.parametrize("cc", sorted(SMEM_OPTIN))
def test_every_chosen_kernel_fits_the_device(cc):
    limit = SMEM_OPTIN[cc]
    compiled = set(K.instantiations())
    for kind, d in itertools.product(KINDS, range(1, K.MAX_HEAD_DIM + 1)):
        for kernel in (K.forward_kernel(kind, d, limit), K.backward_kernel(kind, d, limit)):
            where = f"cc {cc}, kind {kind}, D={d}: {kernel.expr}"
            assert kernel.shared_mem_bytes() <= limit, where
            assert len(kernel.block()) == 1 and 32 <= kernel.block()[0] <= 1024, where
            assert kernel.block()[0] % 32 == 0, where
            assert kernel.instantiation in compiled, where   # the NVRTC test compiles it
            for rows in ROWS:
                heads = 8 if rows % 8 == 0 else 1
                batch = rows // heads
                assert _within_cuda_grid(kernel.grid(batch, heads, heads, 4096, 4096)), (where, rows)
                assert _within_cuda_grid(kernel.grid(batch, heads, 1, 1, 1)), (where, rows)


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
    """Integer divisions the SIMT kernels rely on (TPR, ND, NC, NR >= 1)."""
    for kind, dp in itertools.product(KINDS, K.PADDED_DIMS):
        for kernel in K.forward_kernels(kind, dp):
            if not kernel.tensor_cores:
                bm, bn = kernel.tiles
                assert kernel.threads == 4 * bm and bn % 4 == 0 and dp % 4 == 0
        for kernel in K.backward_kernels(kind, dp):
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
    """Each candidate after the first is needed by some sm_80+ GPU; the last fits them all."""
    assert K.SMALLEST_OPTIN == min(SMEM_OPTIN.values())
    fallbacks = set()
    for kind, dp in itertools.product(KINDS, K.PADDED_DIMS):
        for candidates in (K.forward_kernels(kind, dp), K.backward_kernels(kind, dp)):
            assert candidates[-1].smem <= K.SMALLEST_OPTIN
            assert all(k.smem > K.SMALLEST_OPTIN for k in candidates[:-1])
            fallbacks.update(k.expr for k in candidates[1:])
    assert fallbacks == {"ringmpi_forward_simt<256, 0, 16>", "ringmpi_forward_simt<256, 1, 16>",
                         "ringmpi_forward_simt<192, 3, 8>", "ringmpi_forward_simt<256, 3, 8>",
                         "ringmpi_backward_simt<192, 3, 8>", "ringmpi_backward_simt<256, 3, 8>"}
