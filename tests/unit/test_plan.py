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


# ``ringmpi plan`` against published measurements: docs/performance.md's section of that name holds
# each case's command, published figure and prediction; the model must still give what it prints.
PUBLISHED_SECTION = "## `ringmpi plan` against published measurements"
RFA = ("--n", "65536", "--heads", "32", "--kv-heads", "8", "--dim", "128", "--causal", "--head-parallel", "1")
V5P = ("--preset", "tpu-v5p", "--ranks-per-node", "16", "--torus", "4x4", "--n", "32768", "--batch", "16", "--heads", "32",
       "--dim", "128", "--causal", "--backward")
# FlashAttention-2 on one A100 in ring-flash-attention's table: the forward's rate, and the backward's
# from its forward + backward (94.7 iter/s) less the forward (373.4 iter/s) at 2.5x the forward's FLOPs
A100 = ("--preset", "a100-ib", "--rate", "205.3", "--backward-rate", "174.4")
MAXTEXT_ALLGATHER_STEP, MAXTEXT_LAYERS = 8.83, 32  # the published all-gather step (s); llama2-7b's layers


def _nemo(n, cp, per_node, heads):
    """Llama2-7B's context-parallel ring under NeMo: ``cp`` ranks, ``per_node`` of them a node (the
    rest of the node's GPUs are their tensor-parallel partners, holding the other heads)."""
    return ("--preset", "h100-ib", "--nodes", str(cp // per_node), "--ranks-per-node", str(per_node), "--n", str(n),
            "--heads", str(heads), "--dim", "128", "--causal", "--backward", "--head-parallel", "1")


NEMO_128K = _nemo(131072, 4, 2, 8)


def _times(*args):
    """``{schedule name: (time s, compute s)}`` of ``ringmpi plan`` run in process."""
    code, out = _run(*args)
    assert code == 0, out
    rows = {}
    for line in out.splitlines():
        m = re.match(r"^(\S.*?)\s{2,}([0-9.e+-]+)\s+([0-9.e+-]+)\s+[0-9.e+-]+\s+[0-9.]+%\s+.*\s(?:yes|NO)$", line)
        if m:
            rows[m.group(1)] = (float(m.group(2)), float(m.group(3)))
    return rows


def _iterations(*args):
    """Calls a second of the ring (ring-flash-attention's iter/s)."""
    return 1 / _times(*args)["ring"][0]


def _maxtext_step_ratio(schedule):
    """A schedule's training step over the all-gather's: the published all-gather step plus the
    predicted attention difference of every layer."""
    rows = _times(*V5P, "--head-parallel", "auto")
    extra = MAXTEXT_LAYERS * (rows[schedule][0] - rows["allgather"][0])
    return (MAXTEXT_ALLGATHER_STEP + extra) / MAXTEXT_ALLGATHER_STEP


def _nemo_throughput_ratio(args):
    """The ring's attention efficiency (compute / time) at ``args`` over the 128K run's."""
    (t, c), (t0, c0) = _times(*args)["ring"], _times(*NEMO_128K)["ring"]
    return (c / t) / (c0 / t0)


PUBLISHED = {  # case (the table's first cell): (published figure, the model's prediction of it)
    "ring-flash-attention zigzag, 8 x H800, forward": (63.0, lambda: _iterations("--preset", "h800-ib", *RFA)),
    "ring-flash-attention zigzag, 8 x H800, forward + backward":
        (17.4, lambda: _iterations("--preset", "h800-ib", *RFA, "--backward")),
    "ring-flash-attention zigzag, 8 x A100, forward":
        (38.2, lambda: _iterations(*A100, *RFA)),
    "ring-flash-attention zigzag, 8 x A100, forward + backward":
        (10.6, lambda: _iterations(*A100, *RFA, "--backward")),
    "MaxText, TPU v5p, cp = 16: ring step / all-gather step": (16.38 / 8.83, lambda: _maxtext_step_ratio("ring")),
    "MaxText, TPU v5p, cp = 16: Ulysses step / all-gather step":
        (8.90 / 8.83, lambda: _maxtext_step_ratio("head x ring, U=16")),
    "NeMo Llama2-7B, H100: TFLOPS/GPU at 256K / at 128K":
        (549 / 555, lambda: _nemo_throughput_ratio(_nemo(262144, 8, 2, 8))),
    "NeMo Llama2-7B, H100: TFLOPS/GPU at 512K / at 128K":
        (549 / 555, lambda: _nemo_throughput_ratio(_nemo(524288, 16, 1, 4))),
    "NeMo Llama2-7B, H100: TFLOPS/GPU at 1M / at 128K":
        (536 / 555, lambda: _nemo_throughput_ratio(_nemo(1048576, 32, 1, 4))),
}


def _published_table():
    """``{case: [cells]}`` of the results table in docs/performance.md's section."""
    from pathlib import Path

    root = next(d for d in Path(__file__).resolve().parents if (d / "docs" / "performance.md").is_file())
    text = (root / "docs" / "performance.md").read_text()
    assert PUBLISHED_SECTION in text, "docs/performance.md lost its section on published measurements"
    section = text.split(PUBLISHED_SECTION, 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] in PUBLISHED:
            rows[cells[0]] = cells
    return rows


@pytest.mark.parametrize("case", sorted(PUBLISHED))
def test_the_documented_comparison_with_published_measurements_is_the_models(case):
    """Each documented case: the prediction docs/performance.md prints is what the model gives
    now (to the printed digits), its ratio to the published figure and whether that is within
    25 % are as printed; so a changed model or preset cannot leave the page behind."""
    published, predict = PUBLISHED[case]
    row = _published_table().get(case)
    assert row is not None, f"docs/performance.md has no row for {case!r}"
    _, _, pub_cell, pred_cell, ratio_cell, within_cell = row[:6]
    predicted = predict()
    ratio = predicted / published
    assert pub_cell.split()[0] == f"{published:.3g}", (case, pub_cell)
    assert pred_cell == f"{predicted:.3g}", (case, pred_cell, predicted)
    assert ratio_cell == f"{ratio:.3f}", (case, ratio_cell, ratio)
    assert within_cell == ("yes" if abs(ratio - 1) <= 0.25 else "no"), (case, within_cell, ratio)


def test_what_closed_the_earlier_misses_is_the_backward_rate_and_the_torus():
    """The two described properties that closed the misses: run at the forward's rate, the A100's
    forward + backward is predicted over 25 % fast again (the backward's rate is measured below the
    forward's); with the v5p's 4 x 4 torus taken as one link a hop (``--torus none``), the all-gather's
    attention alone would exceed the whole measured step, and on the torus it fits in it, the ring
    still last."""
    pub, _ = PUBLISHED["ring-flash-attention zigzag, 8 x A100, forward + backward"]
    at_forward_rate = _iterations("--preset", "a100-ib", "--rate", "205.3", *RFA, "--backward")
    assert 1.25 < at_forward_rate / pub < 1.3
    one_link = [a if a != "4x4" else "none" for a in V5P]
    assert MAXTEXT_LAYERS * _times(*one_link, "--head-parallel", "1")["allgather"][0] > MAXTEXT_ALLGATHER_STEP
    rows = _times(*V5P, "--head-parallel", "auto")
    assert MAXTEXT_LAYERS * rows["allgather"][0] < MAXTEXT_ALLGATHER_STEP
    assert max(rows["allgather"][0], rows["head x ring, U=16"][0]) < rows["ring"][0]


def test_a_torus_must_hold_the_nodes_ranks():
    code, out = _run("--preset", "tpu-v5p", "--ranks-per-node", "16", "--n", "32768")
    assert code == 2 and "a torus of 2x2 holds 4 ranks, not the node's 16" in out, out
    code, out = _run("--preset", "tpu-v5p", "--ranks-per-node", "16", "--torus", "4x4", "--n", "32768")
    assert code == 0 and "a link of a 4x4 torus" in out, out
