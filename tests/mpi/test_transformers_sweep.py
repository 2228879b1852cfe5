"""Every decoder-only causal LM of the installed transformers under ringmpi.transformers at P = 2.

One launch of ``transformers_sweep_cases.py`` runs every architecture that
``hf_architectures.decoder_types()`` enumerates from the library (plus the
length-dependent rotary variants) on the contiguous, zigzag and balanced layouts:
forward logits, the loss with labels (router losses on) and one backward's
gradients against one process, exact or refused on every rank before compute.
``scripts/transformers_table.py`` writes the README's table from the same run.
"""

import pytest

from mpi_util import CaseLaunches

pytest.importorskip("torch", reason="ringmpi.transformers needs PyTorch")
pytest.importorskip("transformers", reason="ringmpi.transformers needs transformers (the 'transformers' extra)")
import hf_architectures  # noqa: E402


def cases_for(p):
    cases = [dict(id=t, type=t) for t in hf_architectures.decoder_types()]
    cases += [dict(id=name, **spec) for name, spec in hf_architectures.VARIANTS.items()]
    return cases


SWEEP = CaseLaunches("transformers_sweep_cases.py", (2,), cases_for, timeout=500)
results = SWEEP.fixture()


@pytest.mark.mpi
@pytest.mark.parametrize("p,case", SWEEP.params())
def test_architecture(results, p, case):
    ok, msg = results(p)[case["id"]]
    assert ok, msg
