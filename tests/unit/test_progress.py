"""Rank 0's progress report (ringmpi.cli.progress) on a clock the test moves: the line's
format, the share done, rate and time left it computes, its throttle in a batch log, the
in-place redraw on a terminal, silence under ``quiet`` and on other ranks, and the ring
schedule feeding it (observe_steps) with no cost when nobody observes.  The multi-rank
report (``ringmpi run``) is checked in tests/mpi/test_file_io.py."""

import io
import re

import numpy as np
import pytest
from mpi4py import MPI

import ringmpi
from ringmpi.cli.progress import Progress, duration, rate
from ringmpi.parallel import ring_schedule

LINE = re.compile(r"^\[ringmpi\] (?P<label>.+), step (?P<step>\d+)/(?P<steps>\d+): (?P<share>\d+\.\d)% done"
                  r"(?:, (?P<rate>[\d.]+(?:e[+-]?\d+)? [MGT]?FLOP/s))?, (?P<elapsed>\S+) elapsed(?:, ~(?P<left>\S+) left)?$")


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


class Terminal(io.StringIO):
    def isatty(self):
        return True


def progress(stream=None, **kw):
    clock = Clock()
    return Progress(stream=io.StringIO() if stream is None else stream, clock=clock, **kw), clock


def test_batch_log_lines_say_the_unit_the_step_the_share_the_rate_and_the_time_left(monkeypatch):
    monkeypatch.setenv("RINGMPI_PROGRESS_S", "5")
    p, clock = progress()
    p.start(4e12, units=2)  # two units: 1e12 and 3e12 FLOPs
    p.begin("forward batch 0:1 kv heads 0:1", 1e12)
    p.tick("fwd", 0, 4)  # the first step: nothing known of its length yet
    clock.now += 4
    p.tick("fwd", 0, 4, 0.3)  # throttled, but a block op's share counts: 0.3 of step 1 of 4
    assert p.fraction() == pytest.approx(0.3 / 4 / 4)
    clock.now += 6
    p.step_done("fwd", 0, 4)  # 10 s a step
    clock.now += 5
    p.tick("fwd", 1, 4)  # half of step 2 by the step before's length
    p.tick("fwd", 1, 4)  # throttled: no time has passed
    clock.now += 1
    p.tick("fwd", 1, 4)  # throttled: 1 s < 5 s
    lines = p.stream.getvalue().splitlines()
    assert len(lines) == 3, lines
    first, second, third = (LINE.match(x) for x in lines)
    assert first and second and third, lines
    assert first["label"] == "forward batch 0:1 kv heads 0:1" and first["step"] == "1" and first["steps"] == "4"
    assert first["share"] == "0.0" and first["left"] is None and first["rate"] is None
    # after step 1 of 4 of a 1e12 unit out of 4e12: 6.25% in 10 s
    assert second["step"] == "2" and second["share"] == "6.2" and second["elapsed"] == "10s"
    assert second["rate"] == "25 GFLOP/s" and second["left"] == "2m30s"
    # 5 s into step 2, which the step before says takes 10 s: (1 + 0.5) / 4 of the unit
    assert third["share"] == "9.4" and third["elapsed"] == "15s" and third["left"] == "2m25s"
    p.advance("forward batch 0:1 kv heads 0:1 (15.00 s)")
    assert p.stream.getvalue().splitlines()[-1] == "[ringmpi] 1/2 forward batch 0:1 kv heads 0:1 (15.00 s)"
    assert p.fraction() == pytest.approx(0.25)
    p.begin("backward batch 0:1 kv heads 0:1", 3e12)
    clock.now += 100  # the first step of a later unit: the step before's 10 s bound it (0.99)
    p.tick("bwd", 0, 4)
    last = LINE.match(p.stream.getvalue().splitlines()[-1])
    assert last["label"].startswith("backward") and last["share"] == pytest.approx(f"{100 * (1 + 3 * 0.99 / 4) / 4:.1f}")


def test_a_step_longer_than_the_one_before_never_passes_it():
    p, clock = progress()
    p.start(1.0)
    p.begin("unit", 1.0)
    clock.now += 2
    p.step_done("fwd", 0, 2)
    clock.now += 50
    assert p.fraction() == pytest.approx((1 + 0.99) / 2)
    p.step_done("fwd", 1, 2)
    assert p.fraction() == 1.0


def test_terminal_redraws_one_line_in_place_and_notes_replace_it():
    p, clock = progress(Terminal())
    assert p.tty and p.interval == 0.5
    p.start(1e9, units=1)
    p.begin("forward", 1e9)
    for step in range(3):
        clock.now += 1
        p.tick("fwd", step, 3)
        clock.now += 1
        p.step_done("fwd", step, 3)
    text = p.stream.getvalue()
    assert "\n" not in text and text.count("\r") == 6, repr(text)
    draws = text.split("\r")[1:]
    assert all(LINE.match(d.rstrip()) for d in draws), draws
    assert LINE.match(draws[-1].rstrip())["share"] == "100.0"
    for before, after in zip(draws, draws[1:]):  # a shorter line pads over the longer one before it
        assert len(after) >= len(before.rstrip())
    note = "[ringmpi] --resume: 0 of 1 pass(es) already complete"
    p.note(note[len("[ringmpi] "):])
    assert p.stream.getvalue() == text + "\r" + note + " " * max(0, len(draws[-1]) - len(note)) + "\n"
    p.close()  # nothing open: no stray newline
    assert p.stream.getvalue().count("\n") == 1


@pytest.mark.parametrize("kw", [dict(quiet=True), dict(rank=1)], ids=["quiet", "rank-1"])
def test_quiet_and_other_ranks_show_no_progress(kw, monkeypatch):
    monkeypatch.setenv("RINGMPI_PROGRESS_S", "0")
    p, clock = progress(**kw)
    p.start(1e9, units=1)
    p.begin("forward", 1e9)
    for step in range(2):
        p.tick("fwd", step, 2)
        clock.now += 1
        p.step_done("fwd", step, 2)
    p.advance("forward batch 0:1 kv heads 0:1 (2.00 s)")
    p.note("a note")
    p.close()
    assert p.stream.getvalue() == ("[ringmpi] a note\n" if kw.get("quiet") else "")


def test_units():
    assert [duration(s) for s in (0, 44.6, 60, 187, 3600 * 2 + 5 * 60 + 1)] == ["0s", "45s", "1m00s", "3m07s",
                                                                               "2h05m"]
    assert [rate(r) for r in (12, 8.12e8, 1.844e9, 3.1e12)] == ["12 FLOP/s", "812 MFLOP/s", "1.84 GFLOP/s",
                                                             "3.1 TFLOP/s"]


class Recorder:
    def __init__(self):
        self.events, self.shares = [], []

    def tick(self, phase, step, steps, done=None):
        self.events.append(("tick", phase, step, steps))
        self.shares.append((phase, done))

    def step_done(self, phase, step, steps):
        self.events.append(("done", phase, step, steps))


def test_ring_schedule_reports_its_steps_to_observers_only_while_observed():
    rng = np.random.default_rng(3)
    q, k, v, do = (rng.standard_normal((1, 300, 2, 8)).astype(np.float32) for _ in range(4))
    recorder = Recorder()
    self_ring = ringmpi.RingContext(MPI.COMM_SELF)
    with ring_schedule.observe_steps(recorder) as observed:
        assert observed is recorder
        o, lse, _ = ringmpi.ring_attention(q, k, v, causal=True, context=self_ring)
        ringmpi.ring_attention_backward(do, q, k, v, (o, lse), causal=True, context=self_ring)
    done = [e for e in recorder.events if e[0] == "done"]
    assert done == [("done", "fwd", 0, 1), ("done", "bwd", 0, 1)]
    ticks = [e for e in recorder.events if e[0] == "tick"]
    assert {e[1:] for e in ticks} == {("fwd", 0, 1), ("bwd", 0, 1)} and len(ticks) >= 4
    fwd_ticks = [i for i, e in enumerate(recorder.events) if e[:2] == ("tick", "fwd")]
    assert max(fwd_ticks) < recorder.events.index(("done", "fwd", 0, 1))
    for phase in ("fwd", "bwd"):  # the NumPy block ops say how far they are
        shares = [d for ph, d in recorder.shares if ph == phase]
        assert shares == sorted(shares) and 0 < shares[0] and shares[-1] == 1.0, shares
    # unobserved, the same calls give the same bits
    o2, lse2, _ = ringmpi.ring_attention(q, k, v, causal=True, context=self_ring)
    assert o.tobytes() == o2.tobytes() and lse.tobytes() == lse2.tobytes()
    assert len(recorder.events) == len(done) + len(ticks)


def test_the_first_step_counts_the_block_ops_share_and_later_ones_too():
    p, clock = progress()
    p.start(8.0)
    p.begin("unit", 8.0)
    p.tick("fwd", 0, 2, 0.5)
    assert p.fraction() == pytest.approx(0.25)
    clock.now += 10
    p.step_done("fwd", 0, 2)
    assert p.fraction() == pytest.approx(0.5)
    clock.now += 1  # 1 s of a 10 s step by time, but the op says 0.75: its word counts
    p.tick("fwd", 1, 2, 0.75)
    assert p.fraction() == pytest.approx(0.875)
