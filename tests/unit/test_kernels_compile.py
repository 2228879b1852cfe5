"""Every CUDA kernel instantiation compiles through NVRTC, without a GPU.

Compiles exactly what the runtime loader compiles: ``ringmpi.kernels.source``
(preamble + file with ``#line``), ``compile_options(filename)`` and every name
expression of ``ringmpi.kernels.instantiations(cc)`` for each architecture:
sm_70 and sm_75 (the SIMT kernels, bfloat16 converted in registers), sm_80,
sm_90 and sm_100 (tensor cores too), and asserts a compiler log without
warnings (but NVRTC's note that sm_70 is deprecated).  An architecture the
installed NVRTC does not know is skipped, with the reason shown.

One architecture's programs cost minutes of CPU (sm_100: 5.2 CPU-minutes, 172 s on two
idle AMD EPYC cores; ~7 to ~12 CPU-minutes measured under load), so the programs compile
in a process pool, one worker per core, at the lowest CPU priority, submitted as soon as
collection ends (``tests/conftest.py`` calls :func:`start_compiling`): the rest of the suite
leaves one of two cores idle most of the time (its MPI cases wait on each other), and the
compiles fill it instead of holding up the whole run when these tests come.  The
sources have two code paths (``__CUDA_ARCH__ >= 800`` in common.cuh: the SIMT kernels with
bfloat16 converted in registers below it, tensor cores and native bfloat16 from it) and
two instantiation lists (``instantiations(cc)``: below sm_80 and from it), so by default the
suite compiles one architecture for each, sm_70 and sm_80
(``test_default_architectures_cover_every_code_path`` checks that this still holds);
``RINGMPI_COMPILE_ARCHS=all`` (or a comma list) compiles sm_75, sm_90 and sm_100 too, and
they are skipped, visibly, otherwise.
"""

from __future__ import annotations

import collections
import concurrent.futures
import os

import pytest

from ringmpi import kernels as K

nvrtc = pytest.importorskip(
    "cupy_backends.cuda.libs.nvrtc",
    reason="CuPy (cupy-cuda12x) with NVRTC (nvidia-cuda-nvrtc-cu12) is not installed",
)

ARCHS = ("sm_70", "sm_75", "sm_80", "sm_90", "sm_100")
DEFAULT_ARCHS = ("sm_70", "sm_80")


def _selected_archs():
    wanted = os.environ.get("RINGMPI_COMPILE_ARCHS", "")
    if wanted.strip() == "all":
        return ARCHS
    return tuple(a.strip() for a in wanted.split(",") if a.strip()) or DEFAULT_ARCHS


def _by_file(arch="sm_80"):
    grouped = collections.defaultdict(list)
    for filename, expr in K.instantiations(int(arch[3:])):
        grouped[filename].append(expr)
    return dict(grouped)


# NVRTC 12 notes that sm_70 is deprecated (CUDA 13 drops Volta) and has no option to
# silence it; every other line of a log is a warning about our code
ARCH_DEPRECATED = "nvrtc: warning: Architectures prior to '<compute/sm>_75' are deprecated"


def _warnings(log: str):
    return [line for line in log.splitlines() if line.strip() and not line.startswith(ARCH_DEPRECATED)]


def _skip_unsupported(arch):
    try:
        supported = nvrtc.getSupportedArchs()
    except Exception:  # an NVRTC older than 11.2 cannot list them: try to compile
        return
    if int(arch[3:]) not in supported:
        version = ".".join(map(str, nvrtc.getVersion()))
        pytest.skip(f"NVRTC {version} does not compile for {arch} (it supports sm_{min(supported)} to "
                    f"sm_{max(supported)})")


def _compile(filename, exprs, arch):
    """(ok, log, lowered names) of one NVRTC program with all ``exprs``."""
    prog = nvrtc.createProgram(K.source(filename), filename, [], [])
    try:
        for expr in exprs:
            nvrtc.addNameExpression(prog, expr)
        try:
            nvrtc.compileProgram(prog, list(K.compile_options(filename)) + [f"--gpu-architecture={arch}"])
            ok = True
        except nvrtc.NVRTCError:
            ok = False
        log = nvrtc.getProgramLog(prog)
        lowered = [nvrtc.getLoweredName(prog, e) for e in exprs] if ok else []
        return ok, log, lowered
    finally:
        nvrtc.destroyProgram(prog)


def test_nvrtc_loads():
    try:
        major, _ = nvrtc.getVersion()
    except Exception as exc:  # libnvrtc missing: the wheel is not installed
        pytest.fail(f"libnvrtc cannot be loaded ({exc}); install nvidia-cuda-nvrtc-cu12")
    assert major >= 12


def test_instantiation_list_covers_the_backend():
    items = K.instantiations()
    exprs = {e for _, e in items}
    # tensor cores for f16/bf16 at the common head dims, in both directions
    for bf in ("false", "true"):
        for dp in (64, 128):
            assert f"ringmpi_forward_mma<{dp}, {bf}>" in exprs
            assert f"ringmpi_backward_mma<{dp}, {bf}, {K.bwd_mma_rows(dp)}>" in exprs
    # every head dim up to the maximum maps to a compiled bucket for every kind and family
    simt = K.instantiations(75)
    for d in range(1, K.MAX_HEAD_DIM + 1):
        for kind in (K.F16, K.BF16, K.F32, K.F64):
            assert K.forward_kernel(kind, d).instantiation in items
            assert K.backward_kernel(kind, d).instantiation in items
            assert K.forward_kernel(kind, d, cc=75).instantiation in simt
            assert K.backward_kernel(kind, d, cc=70).instantiation in simt
    with pytest.raises(ValueError):
        K.padded_dim(K.MAX_HEAD_DIM + 1)


def test_default_architectures_cover_every_code_path():
    """Each architecture compiles what one of the defaults compiles: the same instantiations,
    and the sources branch on the architecture only at ``__CUDA_ARCH__ >= 800``."""
    import re

    def default_for(arch):
        return "sm_80" if int(arch[3:]) >= 80 else "sm_70"

    for arch in ARCHS:
        assert set(K.instantiations(int(arch[3:]))) == set(K.instantiations(int(default_for(arch)[3:]))), arch
    branches = set()
    for path in sorted(K.KERNEL_DIR.iterdir()):
        if path.suffix in (".cu", ".cuh", ".h"):
            branches |= set(re.findall(r"__CUDA_ARCH__[^\n]*", path.read_text()))
    assert branches == {"__CUDA_ARCH__ >= 800"}, branches


def test_sources_carry_line_directives():
    for filename in _by_file():
        src = K.source(filename)
        assert f'#line 1 "{(K.KERNEL_DIR / filename).as_posix()}"' in src
        assert f'#line 1 "{(K.KERNEL_DIR / K.PREAMBLE).as_posix()}"' in src
        assert f'#line 1 "{(K.KERNEL_DIR / K.RULES).as_posix()}"' in src
        assert src.index(K.RULES) < src.index(K.PREAMBLE) < src.index(filename)


def _compile_listed(filename, arch):
    return _compile(filename, _by_file(arch)[filename], arch)


_started = {}  # "pool": the executor, "futures": {(filename, arch): future of ``_compile``}


def _lowest_priority():
    """The compiles take only the CPU the rest of the suite leaves idle: SCHED_IDLE, which any
    waking process preempts at once (the MPI cases' ranks wake each other constantly; under
    ``nice 19`` alone they waited behind the compiles: 13:19 for the suite against 14:53
    without the early start, with 1.5 min of that gain lost to the cases slowing down)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux, or not permitted: the lowest nice value
        os.nice(19)


def start_compiling(items=None):
    """Submit every selected (file, architecture) program to a pool of idle-priority workers,
    once; given the session's selected ``items``, only if they include the compile tests."""
    if "pool" in _started:
        return
    if items is not None and not any(getattr(item, "originalname", None) == "test_kernels_compile"
                                     for item in items):
        return
    pairs = [(f, a) for a in _selected_archs() if a in ARCHS for f in sorted(_by_file(a))]
    pool = concurrent.futures.ProcessPoolExecutor(max_workers=os.cpu_count() or 1,
                                                  initializer=_lowest_priority)
    _started["pool"] = pool
    _started["futures"] = {pair: pool.submit(_compile_listed, *pair) for pair in pairs}


def stop_compiling():
    """End the pool: a -k selection or a failed run waits only for the programs already compiling."""
    pool = _started.pop("pool", None)
    if pool is not None:
        pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="module")
def compiled():
    """{(filename, arch): future of ``_compile``} for every selected, supported pair."""
    start_compiling()  # already started by conftest unless this module was imported otherwise
    try:
        yield _started["futures"]
    finally:
        stop_compiling()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("filename", sorted(_by_file()))
def test_kernels_compile(compiled, filename, arch):
    if arch not in _selected_archs():
        pytest.skip(f"{arch}: not in this run's architectures {_selected_archs()} "
                    "(RINGMPI_COMPILE_ARCHS=all compiles every one: minutes of CPU each)")
    _skip_unsupported(arch)
    exprs = _by_file(arch)[filename]
    ok, log, lowered = compiled[(filename, arch)].result()
    assert ok, f"NVRTC failed for {filename} ({arch}):\n{log}"
    assert not _warnings(log), f"NVRTC warnings for {filename} ({arch}):\n{log}"
    assert len(lowered) == len(exprs) and all(lowered)
    for name in lowered:
        assert "ringmpi_" in name


def test_compile_errors_name_the_real_file(tmp_path, monkeypatch):
    bad = tmp_path / "broken.cu"
    bad.write_text("__global__ void ringmpi_broken() { undefined_symbol(); }\n")
    monkeypatch.setattr(K, "KERNEL_DIR", tmp_path)
    for preamble in (K.RULES, K.PREAMBLE):
        (tmp_path / preamble).write_text("")
    K.source.cache_clear()
    try:
        ok, log, _ = _compile("broken.cu", [], "sm_80")
    finally:
        K.source.cache_clear()
    assert not ok
    assert str(bad.as_posix()) in log


def test_block_kernels_plan_their_launch():
    """Grid, block, shared memory and argument packing of the typed kernel choices (CPU only)."""
    import numpy as np

    fwd = K.forward_kernel(K.F16, 64)
    assert (fwd.direction, fwd.tiles, fwd.threads) == ("forward", (64, 64), 128)
    assert fwd.shared_mem_bytes() == 2 * (64 * 72 + 64 * 72 + 64 * 72)
    assert fwd.tile_counts(130, 64) == (3, 1)
    assert fwd.grid(batch=2, heads=8, kv_heads=2, sq=130, skv=64) == (3, 16, 1)
    assert fwd.block() == (128,)
    bwd = K.backward_kernel(K.F32, 100)
    assert bwd.direction == "backward" and bwd.tiles[0] == bwd.tiles[1] and bwd.threads == 256
    bn = bwd.tiles[1]
    assert bwd.grid(batch=2, heads=8, kv_heads=2, sq=5, skv=3 * bn + 1) == (4, 4, 1)
    assert bwd.shared_mem_bytes() == 4 * (4 * bn * 129 + 2 * bn * (bn + 1) + 2 * bn)
    args = fwd.args(("q", "k", "v", "o", "m", "l"), np.float32(0.5), ("mask",) * 11,
                    batch=2, heads=8, kv_heads=2, sq=130, skv=64, d=60)
    assert args[:6] == ("q", "k", "v", "o", "m", "l") and args[6] == np.float32(0.5)
    assert args[7:18] == ("mask",) * 11
    assert args[18:] == (2, 8, 2, 130, 64, 60, 3, 1, 60) and all(a.dtype == np.int32 for a in args[18:])
    # every instantiation a BlockKernel names is in the compiled list
    assert K.backward_kernel(K.BF16, 256).instantiation in K.instantiations()


def test_bfloat16_rounding_without_bf16_instructions():
    """The bit arithmetic of ``float_to_bf16_bits`` below sm_80 (common.cuh, ``#else``),
    written out in NumPy, rounds as ml_dtypes does: nearest even, overflow to Inf,
    subnormals, NaN kept NaN with its sign."""
    import ml_dtypes
    import numpy as np

    src = (K.KERNEL_DIR / K.PREAMBLE).read_text()
    assert "if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);" in src
    assert "return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);" in src
    rng = np.random.default_rng(0)
    u = np.concatenate([rng.integers(0, 2 ** 32, 200_000, dtype=np.uint64).astype(np.uint32),
                        np.array([0, 0x8000, 0x7fff, 0x18000, 0x28000, 0x7f7f7fff, 0x7f7f8000, 0x7f7fffff,
                                  0x7f800000, 0xff800000, 0x7f800001, 0xffc00000, 0x7fc00000, 0x807fffff,
                                  0x00008000, 0x80018000], dtype=np.uint32)])
    nan = (u & 0x7fffffff) > 0x7f800000
    bits = np.where(nan, (u >> 16) | 0x40, (u.astype(np.uint64) + 0x7fff + ((u >> 16) & 1)) >> 16)
    bits = bits.astype(np.uint16)
    with np.errstate(invalid="ignore"):  # NaN inputs
        want = u.view(np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
    np.testing.assert_array_equal(bits[~nan], want[~nan])
    got = bits[nan].view(ml_dtypes.bfloat16).astype(np.float32)
    assert np.isnan(got).all() and ((bits[nan] >> 15) == (u[nan] >> 31)).all()
