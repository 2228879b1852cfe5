"""The per-element rules of ``kernels/rules.h`` as the C compiler builds them (``_ext/_fused``), against
the Python references: ``core.masks`` (visibility, tile classes), ``core.philox`` / ``core.dropout``
(Philox 4x32-10, the keep rule), ``core.modifiers`` (ALiBi) and the softcap's formula.  NVRTC
builds the same header into every kernel program (``test_kernels_compile``), so these cases run
the GPU kernels' rule code on the CPU.  See docs/design.md (the per-element rules)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import numpy as np
import pytest

from ringmpi import kernels as K
from ringmpi.backends import tile_pass
from ringmpi.core import masks, philox
from ringmpi.core.dropout import Dropout
from ringmpi.core.masks import ScoreSpec
from ringmpi.core.modifiers import Alibi

try:
    from ringmpi._ext import _fused as F
except ImportError:  # no C compiler at install: the NumPy fallback runs; only the one-home test applies
    F = None
compiled = pytest.mark.skipif(F is None, reason="ringmpi._ext._fused was not built (no C compiler)")

ROOT = Path(K.__file__).resolve().parents[3]
SRC = ROOT / "src" / "ringmpi"

WINDOWS = (None, (0, 0), (3, None), (None, 5), (2, 7), (0, None), (None, 0), (40, 40))


def _positions(rng, n, kind):
    if kind == "contiguous":
        return np.arange(n, dtype=np.int64) + int(rng.integers(0, 50))
    if kind == "explicit":  # any placement: unsorted, gaps, shared by no layout
        return rng.choice(200, size=n, replace=False).astype(np.int64)
    return (np.arange(n, dtype=np.int64) * 3 + (1 << 40))  # strided, past 2^32


def _cases(seed=0):
    rng = np.random.default_rng(seed)
    for causal in (False, True):
        for window in WINDOWS:
            for kind in ("contiguous", "explicit", "far"):
                nq, nk = int(rng.integers(0, 40)), int(rng.integers(0, 40))
                spec = ScoreSpec(causal=causal, window=window, offset=int(rng.integers(-5, 20)))
                q, k = _positions(rng, nq, kind), _positions(rng, nk, kind)
                segs = (None, None)
                if rng.random() < 0.5:
                    segs = (np.sort(rng.integers(0, 3, nq)), np.sort(rng.integers(0, 3, nk)))
                yield spec, q, k, segs


@compiled
def test_visible_is_the_masks_rule():
    for spec, q, k, (sq, sk) in _cases():
        want = spec.visible(q, k, sq, sk)
        got = np.empty((len(q), len(k)), dtype=bool)
        has_lo, lo, has_hi, hi = (int(x) for x in masks.kernel_scalars(spec))
        F.visible(q, k, None if sq is None else sq.astype(np.int64), None if sk is None else sk.astype(np.int64),
                  has_lo, lo, has_hi, hi, got)
        np.testing.assert_array_equal(got, want, err_msg=f"{spec} {q} {k}")
        np.testing.assert_array_equal(tile_pass.visible(spec, q, k, sq, sk), want)


@compiled
@pytest.mark.parametrize("tile", [1, 4, 16])
def test_classify_tile_is_classify_tiles(tile):
    rng = np.random.default_rng(tile)
    for spec, q, k, (sq, sk) in _cases(tile):
        if not len(q) or not len(k):
            continue
        batch = 2
        seg_q = None if sq is None else np.stack([sq, rng.integers(0, 2, len(q))])
        seg_k = None if sk is None else np.stack([sk, rng.integers(0, 2, len(k))])
        qb, kb = masks.tile_bounds(q, seg_q, tile), masks.tile_bounds(k, seg_k, tile)
        nqt, nkt = -(-len(q) // tile), -(-len(k) // tile)
        want = masks.classify_tiles(spec, qb, kb, nqt, nkt, batch, seg_q is not None)
        got = np.empty(want.shape, dtype=np.int8)
        has_lo, lo, has_hi, hi = (int(x) for x in masks.kernel_scalars(spec))
        F.classify(qb, kb, nqt, nkt, batch, int(seg_q is not None), has_lo, lo, has_hi, hi, got)
        np.testing.assert_array_equal(got, want)
        # conservative against the exact per-tile classes: SKIP and FULL only where they hold
        for qt in range(nqt):
            for kt in range(nkt):
                rows, cols = slice(qt * tile, (qt + 1) * tile), slice(kt * tile, (kt + 1) * tile)
                vis = spec.visible(q[rows], k[cols], None if seg_q is None else seg_q[0, rows],
                                   None if seg_k is None else seg_k[0, cols])
                if got[0, qt, kt] == masks.SKIP:
                    assert not vis.any()
                if got[0, qt, kt] == masks.FULL:
                    assert vis.all()


@compiled
@pytest.mark.parametrize("counter, key, expected", [
    ((0, 0, 0, 0), (0, 0), 0x6627E8D5),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, 0x408F276D),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0), 0xD16CFE09),
])
def test_philox_known_answers(counter, key, expected):
    assert F.philox_word0(*counter, *key) == expected


@compiled
def test_philox_is_core_philox():
    rng = np.random.default_rng(3)
    words = rng.integers(0, 2 ** 32, size=(6, 200), dtype=np.uint64)
    want = philox.philox4x32(*words[:4], 0, 0)[0]
    assert all(F.philox_word0(*(int(w[n]) for w in words[:4]), 0, 0) == int(want[n]) for n in range(200))
    for n in range(50):
        c, key = [int(w[n]) for w in words[:4]], [int(w[n]) for w in words[4:]]
        assert F.philox_word0(*c, *key) == int(philox.philox4x32(*c, *key)[0])


@compiled
@pytest.mark.parametrize("p", [1e-9, 2.0 ** -32, 0.1, 0.5, 0.999999, 1 - 2.0 ** -30])
def test_dropout_keep_is_core_dropout(p):
    rng = np.random.default_rng(int(p * 1e6))
    seed = int(rng.integers(0, 2 ** 63)) * 2 + 1
    drop = Dropout(p, seed, heads=6, batch_offset=3, head_offset=2)
    top = (1 << 48) - 1
    q = np.concatenate([rng.integers(0, top, 30), [0, 1, (1 << 32) - 1, 1 << 32, top]]).astype(np.int64)
    k = np.concatenate([rng.integers(0, top, 25), [0, (1 << 32) + 7, top]]).astype(np.int64)
    for b, h in ((0, 0), (1, 3)):
        want = drop.keep(b, h, q, k)
        got = np.empty(want.shape, dtype=bool)
        F.dropout_keep(q, k, *drop.key(), drop.threshold, drop.heads, drop.batch_offset, drop.head_offset, b, h, got)
        np.testing.assert_array_equal(got, want)
        for dtype in (np.float32, np.float64):
            np.testing.assert_array_equal(tile_pass.dropout_multiplier(drop, b, h, q, k, dtype),
                                          drop.multiplier(b, h, q, k, dtype))


@compiled
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_alibi_terms_are_the_modifiers_bits(dtype):
    rng = np.random.default_rng(5)
    slopes = np.array([0.5, 2.0 ** -8, 0.0, -0.0, -0.25, 3.0e-3], dtype=np.float32)
    alibi = Alibi.of(slopes)
    for offset in (0, 7, -3):
        q = rng.choice(5000, 33, replace=False).astype(np.int64) + (1 << 33) * (offset == 7)
        k = rng.choice(5000, 29, replace=False).astype(np.int64) + (1 << 33) * (offset == 7)
        spec = ScoreSpec(offset=offset, modifiers=(alibi,))
        want, got = spec.modifier_terms(q, k, dtype), tile_pass.modifier_terms(spec, q, k, dtype)
        for h in range(len(slopes)):
            # bit for bit, signed zeros included (scores add the term)
            np.testing.assert_array_equal(got(h).view(np.uint8), want(h).view(np.uint8))
            s = rng.standard_normal((len(q), len(k))).astype(dtype)
            assert got(h).dtype == dtype
            np.testing.assert_array_equal((s + got(h)).view(np.uint8), (s + want(h)).view(np.uint8))


@compiled
@pytest.mark.parametrize("dtype, rtol", [(np.float32, 4e-7), (np.float64, 1e-15)])
def test_softcap_is_the_formula(dtype, rtol):
    rng = np.random.default_rng(7)
    s = np.concatenate([rng.standard_normal(500) * 40, [0.0, -0.0, 1e-30, 1e4, -1e4, np.inf, -np.inf]]).astype(dtype)
    for cap in (0.5, 30.0, 50.0):
        got, slope = s.copy(), np.empty_like(s)
        F.softcap(got, cap, slope)
        t = np.tanh(s.astype(np.float64) / dtype(cap))
        np.testing.assert_allclose(got, cap * t, rtol=2 * rtol, atol=0)
        np.testing.assert_allclose(slope, 1 - t * t, rtol=0, atol=4 * rtol)
    nan = np.array([np.nan], dtype=dtype)
    F.softcap(nan, 1.0, None)
    assert np.isnan(nan).all()


def _setup_macros():
    """setup.py's ``rules_macros()``, run from its source (setup.py calls setup() when imported)."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    keep = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))
            or (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name))
            or (isinstance(node, ast.FunctionDef) and node.name in ("_literals", "rules_macros"))]
    namespace = {"__file__": str(ROOT / "setup.py")}
    exec(compile(ast.Module(body=keep, type_ignores=[]), "setup.py", "exec"), namespace)
    return dict(namespace["rules_macros"]())


RULE_FUNCTIONS = ("pos_visible", "classify_tile", "elem_visible", "pair_visible", "alibi_distance",
                  "alibi_score_f", "alibi_score_d", "softcap_score_f", "softcap_score_d",
                  "philox4x32_10_word0", "dropout_keep")


def test_rules_have_one_home():
    """The rules are written once, in kernels/rules.h, which NVRTC (first in every program) and the
    C compiler (``_ext/fused.c``) build with the same constants, Python's (``core.philox``,
    ``core.masks``); no other C, CUDA or Python source writes Philox's numbers, and no other C or
    CUDA source defines a rule or the structs they read."""
    rules = (K.KERNEL_DIR / K.RULES).read_text()
    for filename in K.SOURCES:
        assert K.source(filename).startswith(f'#line 1 "{(K.KERNEL_DIR / K.RULES).as_posix()}"')
    assert '#include "rules.h"' in (SRC / "_ext" / "fused.c").read_text()
    # the C build gets exactly the defines NVRTC gets
    nvrtc = {k: str(v) for k, v in K.defines().items() if k.startswith(("PHILOX_", "TILE_"))}
    assert _setup_macros() == nvrtc and len(nvrtc) == 8
    assert K.DROPOUT_DEFINES == philox.cuda_defines()
    # no Philox constant outside core/philox.py, in any spelling of the hex literal
    numbers = set(philox.MULTIPLIERS) | set(philox.WEYL)
    for path in sorted(SRC.rglob("*")):
        if path.suffix not in (".py", ".c", ".h", ".cu", ".cuh") or path == SRC / "core" / "philox.py":
            continue
        literals = {int(x, 16) for x in re.findall(r"\b0x([0-9a-fA-F]{8})", path.read_text())}
        assert not literals & numbers, path
    # each rule is defined in rules.h and nowhere else
    for name in RULE_FUNCTIONS:
        assert re.search(rf"^RULES_FN \w[\w ]*\b{name}\(", rules, flags=re.M), name
    others = [p for p in sorted(SRC.rglob("*")) if p.suffix in (".c", ".h", ".cu", ".cuh") and p.name != K.RULES]
    for path in others:
        text = path.read_text()
        for name in RULE_FUNCTIONS + ("MaskArgs", "DropoutArgs"):
            assert not re.search(rf"(?:\b(?:bool|int|unsigned int|long long|float|double|T)\s+{name}\s*\(|"
                                 rf"struct\s+{name}\b|}}\s*{name}\s*;)", text), (path.name, name)


def test_numpy_fallback_is_the_reference(monkeypatch):
    """Without the extension (not built, ``RINGMPI_CPU_KERNEL=numpy``) the tiles' rules are the
    Python references themselves."""
    monkeypatch.setattr(tile_pass, "compiled", None)
    spec, q, k, (sq, sk) = next(c for c in _cases(1) if c[3][0] is not None and len(c[1]) and len(c[2]))
    np.testing.assert_array_equal(tile_pass.visible(spec, q, k, sq, sk), spec.visible(q, k, sq, sk))
    drop = Dropout(0.25, 99, heads=2)
    np.testing.assert_array_equal(tile_pass.dropout_multiplier(drop, 0, 1, q, k, np.float32),
                                  drop.multiplier(0, 1, q, k, np.float32))
    spec = ScoreSpec(offset=2, modifiers=(Alibi.of(np.array([0.5, 0.125], dtype=np.float32)),))
    np.testing.assert_array_equal(tile_pass.modifier_terms(spec, q, k, np.float32)(1),
                                  spec.modifier_terms(q, k, np.float32)(1))
