"""The schedule grid's table and its summary against issue 53's targets (pure functions, no MPI):
``ringmpi.bench.schedule_grid``."""

import pytest

from ringmpi.bench import schedule_grid as grid


def result(rate="1gbit", mask="causal", measured=None, predicted=None, chosen="ring"):
    names = [name for name, _, _ in grid.RUNS]
    measured = dict(zip(names, (1.0, 2.0, 3.0, 1.5, 1.05))) if measured is None else measured
    predicted = dict(measured) if predicted is None else predicted
    return dict(rate=rate, cell=dict(n=4096, heads=4, dim=64, mask=mask, layout=grid.LAYOUT_OF[mask]),
                measured=measured, predicted=predicted, auto_chosen=chosen,
                machine=dict(rate=5e10, intra=dict(latency=2e-6, bandwidth=5e9),
                             inter=dict(latency=1e-4, bandwidth=1.2e8)))


def test_grid_cells_every_combination_with_its_layout():
    cells = grid.grid_cells((16384, 4096), (4,), (64, 128), grid.MASKS)
    assert len(cells) == 2 * 2 * 3
    assert cells[0] == dict(n=4096, heads=4, dim=64, mask="causal", layout="zigzag")
    assert {c["layout"] for c in cells if c["mask"] != "causal"} == {"contiguous"}


def test_a_cell_times_its_short_calls_more_rounds_up_to_the_most():
    walls = {"ring": [2.0, 2.1, 2.2], "routed": [0.09, 0.1, 0.12], "auto": [0.1, 0.12, 0.3]}
    assert grid.next_round(walls, 1, 0.0, 3, 9, 5.0) == ["routed", "auto", "ring"]  # every schedule, to 3
    assert grid.next_round(walls, 3, 0.0, 3, 9, 5.0) == ["routed", "auto"]  # then the short ones alone
    assert grid.next_round(walls, 3, 5.0, 3, 9, 5.0) == []  # their extra rounds took their time
    assert grid.next_round(walls, 9, 0.0, 3, 9, 5.0) == []  # never past the most
    assert grid.next_round(walls, 3, 0.0, 3, 3, 5.0) == []  # most = repeat: no more
    assert grid.next_round({"ring": [1.0] * 3}, 3, 0.0, 3, 9, 5.0) == []  # no short call


def test_rounds_time_every_schedule_once_a_round_each_round_starting_one_later():
    names = [name for name, _, _ in grid.RUNS]
    order = grid.rounds(names, 7)
    assert len(order) == 7 and all(sorted(r) == sorted(names) for r in order)
    assert [r[0] for r in order] == names + names[:2]
    assert grid.rounds(names, 0) == []


def test_cell_row_fastest_auto_slowdown_and_ratios():
    row = grid.cell_row(result(predicted=dict(ring=1.2, routed=2.0, allgather=3.0, **{"head x ring, U=2": 1.5},
                                              auto=1.2)))
    assert row["fastest"] == "ring"
    assert row["auto_slowdown"] == pytest.approx(1.05)
    assert row["ratio"]["ring"] == pytest.approx(1.2)
    assert row["ratio"]["auto"] == pytest.approx(1.2 / 1.05)


def test_cell_row_missing_prediction_is_none():
    row = grid.cell_row(result(predicted=dict(ring=1.0)))
    assert row["ratio"]["routed"] is None and row["ratio"]["ring"] == 1.0


def test_summary_meets_targets_when_auto_is_near_and_predictions_close():
    rows = [grid.cell_row(result()) for _ in range(10)]
    s = grid.summarize(rows)
    assert s["auto_within"] == 10 and s["auto_share"] == 1.0 and s["auto_ok"]
    assert s["predictions"] == 50 and s["predictions_within"] == 50 and s["predictions_ok"]


def test_summary_counts_slow_auto_and_far_predictions():
    rows = [grid.cell_row(result()) for _ in range(8)]
    slow = dict(result()["measured"], auto=1.2)  # within 1.25x but not 10 %
    rows.append(grid.cell_row(result(measured=slow, predicted=dict(slow, routed=0.5))))  # routed: 0.25x
    rows.append(grid.cell_row(result(mask="window")))
    s = grid.summarize(rows)
    assert s["auto_within"] == 9 and s["auto_share"] == pytest.approx(0.9) and s["auto_worst"] == pytest.approx(1.2)
    assert s["auto_ok"]  # 90 % and never past 1.25x
    assert s["predictions_within"] == 49 and not s["predictions_ok"]
    assert s["prediction_worst"] == pytest.approx(0.25) and s["prediction_worst_at"].endswith("causal routed")
    rows.append(grid.cell_row(result(measured=dict(slow, auto=1.3))))
    assert not grid.summarize(rows)["auto_ok"]  # 1.3x: past the worst allowed


def test_prediction_worst_is_farthest_from_one_either_way():
    over = dict(result()["measured"], ring=1.0)
    rows = [grid.cell_row(result(predicted=dict(over, ring=3.0))),        # 3x over
            grid.cell_row(result(predicted=dict(over, ring=0.5)))]        # 2x under
    assert grid.summarize(rows)["prediction_worst"] == 3.0


def test_format_report_has_a_row_per_cell_and_the_summary():
    rows = [grid.cell_row(result()), grid.cell_row(result(rate="100mbit", mask="documents", chosen="routed"))]
    text = grid.format_report(rows, grid.notes(2, ["1gbit", "100mbit"], True, 2, 1) + grid.machine_notes(rows))
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + len(rows)  # header and one per cell
    assert all(line.count("|") == table[0].count("|") for line in table)
    assert "| 100mbit | 4096 | 4 | 64 | documents | 1 / 1 (1.00) |" in text
    assert "oversubscribed: 4 ranks share 2 cores" in text
    assert "model's parts at 1gbit: block rate D=64 50.0 GFLOP/s per rank" in text
    assert "auto within 10 % of the fastest measured: 2/2 cells (100%" in text and "NOT met" not in text
    assert len(grid.notes(8, ["1gbit"], False, 3, 1)) == 1  # enough cores: no oversubscription line


def test_empty_grid_reports_not_met():
    s = grid.summarize([])
    assert not s["auto_ok"] and not s["predictions_ok"] and s["auto_worst"] is None
    assert "NOT met" in grid.summary_lines(s)
