"""``ringmpi plan`` (issue 53): the cost model on a described cluster, with no MPI and no GPU."""

import re
import subprocess
import sys

import pytest
from click.testing import CliRunner

from ringmpi.cli.plan import plan, predictions
from ringmpi.core.cost_model import Shape, choose, mask_fractions
from ringmpi.core.machines import PRESETS


def _run(*args):
    result = CliRunner().invoke(plan, list(args))
    return result.exit_code, result.output


def _rows(out):
    """``{schedule name: (time s, fits)}`` of the printed table."""
    rows = {}
    for line in out.splitlines():
        m = re.match(r"^(\S.*?)\s{2,}([0-9.e+-]+)\s+[0-9.e+-]+\s+[0-9.e+-]+\s+[0-9.]+%\s+.*\s(yes|NO)$", line)
        if m:
            rows[m.group(1)] = (float(m.group(2)), m.group(3) == "yes")
    return rows


def test_every_schedule_is_predicted_and_the_fastest_that_fits_recommended():
    code, out = _run("--n", "262144", "--nodes", "4", "--heads", "16", "--kv-heads", "4", "--causal", "--backward")
    assert code == 0, out
    rows = _rows(out)
    assert {"ring", "routed", "allgather", "head x ring, U=2", "head x allgather, U=8"} <= set(rows)
    best = min((t, name) for name, (t, fits) in rows.items() if fits)[1]
    assert re.search(rf"^recommended: {re.escape(best)} \(", out, re.M), out
    assert re.search(r"^the ring hides its transfers above [0-9,]+ tokens per rank \(this plan: 8,192, "
                     r"(hidden|exposed)\)$", out, re.M), out


def test_the_printed_figures_are_the_models():
    machine = PRESETS["a100-ib"].machine
    code, out = _run("--preset", "a100-ib", "--nodes", "2", "--n", "100000", "--heads", "8", "--dim", "64",
                     "--head-parallel", "1")
    assert code == 0, out
    shape = Shape(n_q=100000, n_kv=100000, heads=8, kv_heads=8, dim=64, dim_v=64, itemsize=2, grad_itemsize=4)
    for p in predictions(shape, machine, 16, [1], backward=False):
        assert _rows(out)[p.name][0] == pytest.approx(p.seconds, rel=1e-3)
    assert choose(predictions(shape, machine, 16, [1], False))[0].name in out.split("recommended: ")[1]


def test_memory_rules_out_the_allgather_and_then_everything():
    code, out = _run("--n", "4194304", "--nodes", "8", "--heads", "8", "--memory", "4", "--head-parallel", "1")
    assert code == 0, out
    rows = _rows(out)
    assert rows["allgather"][1] is False and rows["ring"][1] is True
    assert "recommended: allgather" not in out
    code, out = _run("--n", "4194304", "--nodes", "8", "--heads", "8", "--memory", "0.001")
    assert code == 0 and "recommended: none -- no schedule fits" in out, out


def test_a_slower_network_exposes_the_ring():
    args = ("--n", "131072", "--nodes", "8", "--head-parallel", "1")
    fast = _rows(_run(*args)[1])["ring"][0]
    slow = _rows(_run(*args, "--inter-bw", "1", "--inter-latency", "50")[1])["ring"][0]
    assert slow > fast


def test_documents_and_windows_shrink_the_visible_pairs():
    density, seen = mask_fractions(1 << 16, 16, causal=True, documents=[1024] * 64)
    assert density == pytest.approx(0.5 / 64) and seen < 0.05
    density, seen = mask_fractions(1 << 16, 16, causal=True, window=(127, None))
    assert density == pytest.approx(128 / (1 << 16))
    code, out = _run("--n", "65536", "--nodes", "2", "--documents", "lognormal:1000:0.5", "--causal")
    assert code == 0 and "documents (visible pairs" in out, out
    code, out = _run("--n", "100", "--documents", "lognormal:0:1")
    assert code == 2 and "lognormal needs MEAN >= 1" in out, out


def test_tens_of_thousands_of_ranks():
    code, out = _run("--n", str(1 << 26), "--nodes", "4096", "--heads", "64", "--kv-heads", "8", "--causal")
    assert code == 0 and "P 32768" in out, out


def test_plan_needs_neither_mpi_nor_a_gpu():
    code = ("import sys; from click.testing import CliRunner; from ringmpi.cli import cli; "
            "r = CliRunner().invoke(cli, ['plan', '--n', '4096']); assert r.exit_code == 0, r.output; "
            "bad = [m for m in ('mpi4py', 'cupy', 'h5py', 'torch') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
