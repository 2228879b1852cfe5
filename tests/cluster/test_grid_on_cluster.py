"""Issue 53's schedule grid (``python -m ringmpi.bench.schedule_grid``) on the namespace cluster: one
tiny cell, every schedule measured and predicted, the table and the summary made of them.  The
figures themselves are the full grid's (docs/performance.md), not checked here."""

import pytest

from ringmpi.bench import schedule_grid as grid

pytestmark = pytest.mark.mpi


def test_one_tiny_cell_measures_and_predicts_every_schedule(netns):
    cells = grid.grid_cells((512,), (2,), (16,), ("documents",))
    rows = grid.run_grid(netns, ["unshaped"], cells, repeat=1, warmup=1, timeout=240)
    assert len(rows) == 1
    row = rows[0]
    names = [name for name, _, _ in grid.RUNS]
    assert all(row["measured"][n] > 0 for n in names), row["measured"]
    assert all(row["predicted"][n] > 0 for n in names), row["predicted"]  # auto's: that of its choice
    assert row["auto_chosen"] in row["predicted"] and row["fastest"] in grid.EXPLICIT
    assert row["machine"]["rate"] > 0 and row["machine"]["inter"]["bandwidth"] > 0
    text = grid.format_report(rows, grid.machine_notes(rows))
    assert "| unshaped | 512 | 2 | 16 | documents |" in text
    assert "auto within 10 % of the fastest measured:" in text and "predictions within 25 %" in text
    # the links are left unshaped for the next test
    assert "tbf" not in netns.run("h1", ["tc", "qdisc", "show", "dev", "eth0"]).stdout
