"""The non-finite and determinism cases under every vector path this CPU can take.

What the CPU backend computes goes through three pieces of code that pick their
instructions from the CPU: the compiled tile pass (``ringmpi._ext._fused``: AVX-512, AVX2
or plain), NumPy's OpenBLAS (its kernels per core: SkylakeX, Haswell, Nehalem, ...) and
NumPy's own loops (dispatched per CPU feature).  The rest of the suite runs what this CPU
picks by itself.  Here each other level runs the cases whose promise is bitwise (a bad
value reaches nothing it cannot reach, repeats and reorderings give the same bits) in a
pytest of its own, with all three pinned: ``RINGMPI_CPU_VECTOR`` for the tile pass,
``OPENBLAS_CORETYPE`` for OpenBLAS and ``NPY_DISABLE_CPU_FEATURES`` for NumPy, so a
difference between CPUs (issue 34: OpenBLAS's AVX-512 gemv on an Intel Xeon) shows on
any machine that has the instructions.
"""

import ast
import os
import sys
from pathlib import Path

import pytest

from mpi_util import ROOT, run_deadline
from ringmpi.bench.kernel import CORE_FLAGS, PINS, cpu_flags

HERE = Path(__file__).resolve().parent

# the cases run again under each pinned level (a few seconds to a minute each)
BITWISE_CASES = (
    "tests/unit/test_tile_pass.py",
    "tests/mpi/test_speed_paths.py",
    "tests/mpi/test_nonfinite.py",
    "tests/mpi/test_nonfinite_dtypes.py",
    "tests/mpi/test_dropout.py::test_nonfinite_row_leaves_the_others_bitwise",
    "tests/unit/test_schedule.py::test_forward_loop_over_the_schedule_equals_ring_attention_bitwise",
    "tests/mpi/test_invariant.py",  # invariant=True's bitwise matrix: the fixed-point loop's paths too
)
DEADLINE = 600

# each tile-pass path with the OpenBLAS core of the same instructions, and the CPU flags that core needs
# (the pins of python -m ringmpi.bench.kernel --paths)
OPENBLAS_CORE = {path: (pins["OPENBLAS_CORETYPE"], CORE_FLAGS[pins["OPENBLAS_CORETYPE"]]) for path, pins in PINS.items()}


def openblas_core():
    """The OpenBLAS core NumPy runs (None where NumPy's BLAS is not OpenBLAS)."""
    import numpy  # noqa: F401 - loads the BLAS that threadpoolctl then finds
    import threadpoolctl

    for info in threadpoolctl.threadpool_info():
        if info.get("internal_api") == "openblas":
            return info.get("architecture")
    return None


def _umath():
    try:
        from numpy._core import _multiarray_umath
    except ImportError:  # NumPy 1.x
        from numpy.core import _multiarray_umath
    return _multiarray_umath


def numpy_targets_above(path):
    """NumPy's dispatch targets (``__cpu_dispatch__``) that use more than ``path``'s instructions."""
    targets = _umath().__cpu_dispatch__
    if path == "avx512":
        return []
    if path == "avx2":
        return [t for t in targets if "AVX512" in t or t == "X86_V4"]
    return list(targets)  # plain: NumPy's baseline only


def numpy_runs_above(path):
    """Those of :func:`numpy_targets_above` this process runs (``NPY_DISABLE_CPU_FEATURES``
    turns them off)."""
    return [t for t in numpy_targets_above(path) if _umath().__cpu_features__.get(t)]


def tile_paths():
    """(the paths this CPU runs, best first; the one this process runs), or ((), None)."""
    from ringmpi.backends import tile_pass

    return tile_pass.vector_paths(), tile_pass.vector_path()


def levels():
    """``(path, OpenBLAS core or None)`` for each tile-pass path this CPU runs, but the pair this
    process already runs (the rest of the suite covers it)."""
    paths, current = tile_paths()
    auto = openblas_core()
    flags = cpu_flags()
    out = []
    for path in paths:
        core, needs = OPENBLAS_CORE[path]
        pinned = core if auto is not None and needs <= flags else None
        if path == current and pinned in (None, auto):
            continue
        out.append((path, pinned))
    return out


LEVELS = levels()


def test_levels_cover_every_tile_path():
    """Every path of the compiled pass runs in this process or in a pinned level."""
    paths, current = tile_paths()
    if not paths:
        pytest.skip("ringmpi._ext._fused was not built (or RINGMPI_CPU_KERNEL=numpy): no vector paths")
    assert {p for p, _ in LEVELS} | {current} == set(paths)
    assert paths[-1] == "plain"


def test_the_switch_pins_each_path_and_refuses_others():
    paths, _ = tile_paths()
    if not paths:
        pytest.skip("ringmpi._ext._fused was not built (or RINGMPI_CPU_KERNEL=numpy): no vector paths")
    probe = "from ringmpi.backends import tile_pass; print(tile_pass.vector_path())"
    for path in paths:
        rc, out = _run([sys.executable, "-c", probe], dict(os.environ, RINGMPI_CPU_VECTOR=path), 120)
        assert (rc, out.strip()) == (0, path)
    rc, out = _run([sys.executable, "-c", probe], dict(os.environ, RINGMPI_CPU_VECTOR="sse9"), 120)
    assert rc != 0 and f"RINGMPI_CPU_VECTOR must be a path this CPU runs ({', '.join(paths)}), got 'sse9'" in out


def test_unpinned_import_takes_the_fastest_path():
    """Without ``RINGMPI_CPU_VECTOR`` the import times every path this CPU runs and takes the
    fastest (not the widest)."""
    paths, _ = tile_paths()
    if not paths:
        pytest.skip("ringmpi._ext._fused was not built (or RINGMPI_CPU_KERNEL=numpy): no vector paths")
    probe = "from ringmpi.backends import tile_pass as tp; print(tp.vector_path(), repr(tp.calibration()))"
    env = dict(os.environ)
    env.pop("RINGMPI_CPU_VECTOR", None)
    rc, out = _run([sys.executable, "-c", probe], env, 120)
    assert rc == 0, out
    chosen, rates = out.split(" ", 1)
    rates = ast.literal_eval(rates)
    if len(paths) == 1:
        assert (chosen, rates) == (paths[0], {})
        return
    assert set(rates) == set(paths) and all(rate > 0 for rate in rates.values())
    assert chosen == max(rates, key=rates.get), f"chose {chosen} from {rates}"


def test_the_avx512_width_gives_the_same_bits(tmp_path):
    """``exp_rows.h`` built with the avx512 path's width and block (16 lanes, 4 vectors) but AVX2
    instructions gives the plain and avx2 paths' bits (``tests/mpi/exp_rows_widths.c``): the
    vector width is the paths' only difference, so this checks the avx512 path's arithmetic
    on a CPU without AVX-512 (where the pinned levels cannot run it)."""
    import shlex
    import shutil
    import sysconfig

    if "avx2" not in cpu_flags():
        pytest.skip("the check builds an AVX2 program: this CPU has no AVX2")
    cc = shlex.split(sysconfig.get_config_var("CC") or "cc")
    if shutil.which(cc[0]) is None:
        pytest.skip(f"no C compiler ({cc[0]})")
    exe = tmp_path / "exp_rows_widths"
    cmd = cc + ["-O3", "-ffp-contract=off", "-fno-math-errno", "-Wno-psabi",
                f"-I{ROOT / 'src' / 'ringmpi' / '_ext'}", f"-I{sysconfig.get_paths()['include']}",
                str(HERE / "exp_rows_widths.c"), "-o", str(exe), "-lm"]
    rc, out = _run(cmd, dict(os.environ), 300)
    assert rc == 0, out
    rc, out = _run([str(exe)], dict(os.environ), 120)
    assert (rc, out.strip()) == (0, "SAME BITS"), out


def test_kernel_bench_measures_every_path():
    """``python -m ringmpi.bench.kernel --paths`` prints every path's exp rate beside np.exp's,
    and a table row per path and shape (tiny shapes, torch hidden so that no child imports it:
    the command, not the figures)."""
    paths, _ = tile_paths()
    if not paths:
        pytest.skip("ringmpi._ext._fused was not built (or RINGMPI_CPU_KERNEL=numpy): no vector paths")
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    env.pop("RINGMPI_CPU_VECTOR", None)
    bench = ("import sys; sys.modules['torch'] = None; from ringmpi.bench.kernel import main; "
             "main(['--paths', '--seq', '128', '--dims', '16', '--repeat', '1'])")
    rc, out = _run([sys.executable, "-c", bench], env, 300)
    assert rc == 0, out
    assert "np.exp" in out, out
    if len(paths) > 1:
        assert "the fastest in the import's calibration" in out, out
    for path in paths:
        assert f"compiled pass, {path:>6}:" in out, out
        rows = [line.split() for line in out.splitlines() if line.split()[:2] == [path, "16"]]
        assert [row[2] for row in rows] == ["False", "True"], out

def _pinned_env(path, core):
    env = dict(os.environ, RINGMPI_CPU_VECTOR=path, OPENBLAS_NUM_THREADS="1",
               NPY_DISABLE_CPU_FEATURES=" ".join(numpy_targets_above(path)),
               RINGMPI_TEST_INVARIANT_SIZES="1,2,3")  # see test_invariant.WORLD_SIZES
    env.pop("OPENBLAS_CORETYPE", None)
    if core is not None:
        env["OPENBLAS_CORETYPE"] = core
    return env


def _run(cmd, env, timeout):
    """(returncode, stdout and stderr) of ``cmd`` under a deadline."""
    rc, out, err, _ = run_deadline(cmd, timeout, env=env)
    return rc, out + err


@pytest.mark.mpi
@pytest.mark.parametrize("path,core", LEVELS, ids=[f"{p}-{c or 'own-blas'}" for p, c in LEVELS])
def test_bitwise_cases_under_pinned_level(path, core):
    env = _pinned_env(path, core)
    probe = ("from ringmpi.backends import tile_pass as tp; import test_vector_paths as t; "
             "print(tp.vector_path(), t.openblas_core(), t.numpy_runs_above(tp.vector_path()))")
    rc, out = _run([sys.executable, "-c", probe], dict(env, PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent / "support")])), 120)
    assert rc == 0, out
    assert out.split() == [path, str(core if core is not None else openblas_core()), "[]"], \
        f"pinned {path} with OpenBLAS {core} and NumPy below it, the process runs: {out}"
    rc, out = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-rfE",
                    *BITWISE_CASES], env, DEADLINE)
    summary = [line for line in out.splitlines() if line.startswith(("FAILED", "ERROR"))]
    assert rc == 0, (f"RINGMPI_CPU_VECTOR={path} OPENBLAS_CORETYPE={core}: pytest exit {rc}\n"
                     + "\n".join(summary[:40]) + "\n" + out[-3000:])
