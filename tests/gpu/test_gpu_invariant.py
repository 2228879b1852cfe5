"""RingContext(invariant=True) on the GPU (invariant.cu, ringmpi.backends.invariant_device): the bitwise
matrix of ``tests/mpi/test_invariant.py`` with ``backend="cupy"``.  Needs a CUDA GPU; skipped,
with the reason shown, where none is visible.

One launch of ``tests/mpi/invariant_cases.py`` per world size P = 1, 2, 3, 4, every rank on
the one GPU: per case, every placement that applies at P (contiguous, zigzag, striped where
its shards are whole tiles, a random placement of whole tiles by explicit positions, head x
ring U = 2 over it at even P) gives
one sha256 per output (``o, lse, max_logit, dq, dk, dv, dsinks``), and all must be equal
across placements and launches.  The P = 1 launch holds each case to the float64 dense
reference under the tolerance rule (and the NaN/Inf case to its rows), and
``decode_attention`` with ``invariant=True`` in its context must give its new tokens the ring's bits.  The bits are
the GPU's own, not the CPU's.
"""

from __future__ import annotations

import json

import pytest

from ringmpi.backends import gpu_available
from ringmpi.runtime.device import gpu_unavailable_reason

pytestmark = pytest.mark.skipif(not gpu_available(), reason=f"no usable CUDA GPU: {gpu_unavailable_reason()}")

WORLD_SIZES = (1, 2, 3, 4)


def cases_for(p):
    from test_invariant import cases_for as cpu_cases

    out = []
    for case in cpu_cases(p):
        if case.get("kind") == "errors":
            continue
        case = {k: v for k, v in case.items() if k not in ("torch", "file")}
        out.append(dict(case, backend="cupy"))
    return out


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    from test_invariant import launches_of

    return launches_of(cases_for, tmp_path_factory, "invariant_gpu")


@pytest.mark.mpi
@pytest.mark.parametrize("case_id", [c["id"] for c in cases_for(2)])
def test_same_bits_for_every_P_and_layout_on_the_gpu(launches, case_id):
    seen = {}
    for p in WORLD_SIZES:
        ok, msg = launches(p)[case_id]
        assert ok, f"P={p}: {msg}"
        for placement, hashes in json.loads(msg)["hashes"].items():
            seen[f"P{p}:{placement}"] = hashes
    reference = next(iter(seen.values()))
    differ = {where: sorted(k for k in reference if hashes.get(k) != reference[k])
              for where, hashes in seen.items() if hashes != reference}
    assert not differ, f"{case_id}: outputs differ from {next(iter(seen))}: {differ}"
    assert {"contiguous", "tiles", "tiles-U2"} <= {w.split(":")[1] for w in seen}
