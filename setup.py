"""The compiled CPU tile pass (``ringmpi._ext._fused``) and the fixed-point sums of
``invariant=True`` (``ringmpi._ext._fixed``), built by ``pip install`` of the checkout; the
rest of the package is in pyproject.toml.  If no C compiler can build them, the install
goes on and the NumPy backend uses its NumPy-only paths (the same bits for the sums)."""

import ast
import importlib.util
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

FIXED_SPLIT = "src/ringmpi/core/fixed_split.py"
PHILOX = "src/ringmpi/core/philox.py"
MASKS = "src/ringmpi/core/masks.py"
KERNELS = "src/ringmpi/kernels"  # rules.h: the per-element rules NVRTC builds too


def fixed_split_macros():
    """``_fixed``'s ``-D`` defines, ``ringmpi.core.fixed_split.c_defines()``: the split of a partial
    into int64 words, stated there once (the file is loaded by its path: it needs no NumPy)."""
    spec = importlib.util.spec_from_file_location("ringmpi_fixed_split", Path(__file__).parent / FIXED_SPLIT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return sorted(module.c_defines().items())


def _literals(path):
    """``{name: value}`` of the module-level assignments of literals in ``path``'s source (read with
    ast: those modules import NumPy, which setup.py cannot)."""
    out = {}
    for node in ast.parse((Path(__file__).parent / path).read_text()).body:
        if isinstance(node, ast.Assign):
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                continue
            for target in node.targets:
                if isinstance(target, ast.Name):
                    out[target.id] = value
                elif isinstance(target, ast.Tuple) and isinstance(value, tuple):
                    out.update((t.id, v) for t, v in zip(target.elts, value) if isinstance(t, ast.Name))
    return out


def rules_macros():
    """``kernels/rules.h``'s ``-D`` defines for ``_fused``, as NVRTC gets them
    (``ringmpi.kernels.DROPOUT_DEFINES`` and the ``TILE_*`` of ``KERNEL_DEFINES``): Philox's
    constants from core/philox.py, the tile classes from core/masks.py."""
    philox, masks = _literals(PHILOX), _literals(MASKS)
    words = {"PHILOX_M0": philox["MULTIPLIERS"][0], "PHILOX_M1": philox["MULTIPLIERS"][1],
             "PHILOX_W0": philox["WEYL"][0], "PHILOX_W1": philox["WEYL"][1]}
    return sorted([("PHILOX_ROUNDS", str(philox["ROUNDS"]))] + [(k, f"0x{v:08X}u") for k, v in words.items()]
                  + [(f"TILE_{k}", str(masks[k])) for k in ("SKIP", "PARTIAL", "FULL")])


class OptionalBuildExt(build_ext):
    def run(self):
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - any compiler failure: fall back to NumPy
            print(f"ringmpi: the compiled tile pass did not build ({exc}); NumPy path only")

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            print(f"ringmpi: the compiled tile pass did not build ({exc}); NumPy path only")


setup(
    ext_modules=[Extension("ringmpi._ext._fused", ["src/ringmpi/_ext/fused.c"],
                           depends=["src/ringmpi/_ext/exp_rows.h", "src/ringmpi/_ext/block_rows.h",
                                    "src/ringmpi/_ext/chunk_mask.h", "src/ringmpi/_ext/path_end.h",
                                    "src/ringmpi/_ext/vector_paths.h",
                                    f"{KERNELS}/rules.h", PHILOX, MASKS],
                           include_dirs=[KERNELS], define_macros=rules_macros(),
                           extra_compile_args=["-O3", "-ffp-contract=off", "-fno-math-errno", "-Wno-psabi"]),
                 Extension("ringmpi._ext._fixed", ["src/ringmpi/_ext/fixed.c"],
                           depends=["src/ringmpi/_ext/vector_paths.h", FIXED_SPLIT],
                           define_macros=fixed_split_macros(),
                           extra_compile_args=["-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math",
                                               "-fno-wrapv"])],
    cmdclass={"build_ext": OptionalBuildExt},
)
