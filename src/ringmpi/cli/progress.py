"""Rank 0's progress report of long work (``ringmpi run``, ``ringmpi bench``).

The work is a sequence of units -- a pass's forward or backward in ``run``, a timed
call in ``bench`` -- each one ring of ``steps`` steps, weighed by its FLOPs.  The
command says when a unit begins (:meth:`Progress.begin`); the ring schedule reports
rank 0's own steps as they happen
(:func:`ringmpi.parallel.ring_schedule.observe_steps`: a call between tiles and after
each step, in this process; no message, no collective).  The line shows the unit,
the ring step, the share of the work done, the rate so far and an estimate of the
time left::

    [ringmpi] forward batch 0:1 kv heads 0:1, step 3/4: 41.2% done, 1.84 GFLOP/s, 2m10s elapsed, ~3m06s left

redrawn in place on a terminal (at most every ``TTY_INTERVAL_S``), else printed as
a plain line at most every ``RINGMPI_PROGRESS_S`` seconds (default
``LOG_INTERVAL_S``) and once when a unit's last step ends, for a batch log.  The share
done counts the finished units, the current unit's finished steps and, of the step
under way the share of its tiles the block op has reached when it says so (the NumPy
backend), else the share of the time the step before took (capped below 1; none yet:
not begun): rank 0's own steps stand for the job's, which the layout balances.
``quiet``, or any rank but 0, prints no progress.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Optional

import click

TTY_INTERVAL_S = 0.5
LOG_INTERVAL_S = 10.0
PREFIX = "[ringmpi] "


def log_interval() -> float:
    """Seconds between two plain progress lines: ``RINGMPI_PROGRESS_S`` (>= 0), else ``LOG_INTERVAL_S``."""
    value = os.environ.get("RINGMPI_PROGRESS_S", "").strip()
    try:
        return max(0.0, float(value)) if value else LOG_INTERVAL_S
    except ValueError:
        return LOG_INTERVAL_S


def duration(seconds: float) -> str:
    """``45s``, ``3m07s``, ``2h05m``."""
    s = int(round(max(0.0, seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def rate(flops_per_s: float) -> str:
    """``812 MFLOP/s``, ``1.84 GFLOP/s``, ``3.1 TFLOP/s``."""
    for unit, size in (("TFLOP/s", 1e12), ("GFLOP/s", 1e9), ("MFLOP/s", 1e6)):
        if flops_per_s >= size:
            value = flops_per_s / size
            return f"{value:.3g} {unit}"
    return f"{flops_per_s:.3g} FLOP/s"


class Progress:
    """The progress line of rank 0 (see the module docstring); an observer of ring steps.

    ``stream``: where to print (stderr); ``clock``: seconds (``time.monotonic``), for tests.
    """

    def __init__(self, rank: int = 0, quiet: bool = False, stream=None, clock=time.monotonic):
        self.rank0 = rank == 0
        self.active = self.rank0 and not quiet
        self.stream = sys.stderr if stream is None else stream
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval = TTY_INTERVAL_S if self.tty else log_interval()
        self.clock = clock
        self.total = self.done = 0.0  # FLOPs: all units, finished units
        self.started: Optional[float] = None
        self.label, self.work = None, 0.0  # the unit under way
        self.units = self.finished = 0  # units of advance()
        self.steps, self.steps_done = 1, 0
        self.step_started, self.step_seconds = 0.0, 0.0  # the step under way; the step before
        self.step_share: Optional[float] = None  # of the step under way, as its block op says
        self.shown = -float("inf")
        self.open_line = 0  # width of the line being redrawn on a terminal (0: none)

    # ----------------------------------------------------------- the command's calls
    def note(self, text: str) -> None:
        """A line of its own on rank 0, also under ``quiet`` (on a terminal it replaces the
        line being redrawn)."""
        if self.rank0:
            self._write_line(PREFIX + text)

    def report(self, text: str) -> None:
        """A line of its own on rank 0 unless ``quiet`` (a unit's summary)."""
        if self.active:
            self._write_line(PREFIX + text)

    def start(self, total_flops: float, units: int = 0) -> None:
        """The work ahead, in FLOPs, and its count of units for :meth:`advance`; the clock starts."""
        self.total, self.done, self.started = float(total_flops), 0.0, self.clock()
        self.units, self.finished = units, 0

    def begin(self, label: str, flops: float) -> None:
        """A unit (one ring) begins: ``label`` names it, ``flops`` weighs it."""
        if self.label is not None:
            self.end()
        self.label, self.work = label, float(flops)
        self.steps, self.steps_done, self.step_started, self.step_share = 1, 0, self.clock(), None

    def end(self) -> None:
        """The unit under way is done (also when it ran no ring step)."""
        if self.label is not None:
            self.done += self.work
            self.label = None

    def advance(self, what: str, units: int = 1) -> None:
        """``units`` units are done (or, after ``--resume``, were done before): the unit under
        way ends and a line ``finished/units what`` says so."""
        self.end()
        self.finished += units
        self.report(f"{self.finished}/{self.units} {what}")

    def close(self) -> None:
        self.end()
        if self.open_line:
            self.stream.write("\n")
            self.stream.flush()
            self.open_line = 0

    # ------------------------------------------------------- the ring schedule's calls
    def tick(self, phase: str, step: int, steps: int, done: Optional[float] = None) -> None:
        """Between two tiles of ``step`` (of ``steps``), ``done`` of its tiles reached (or None)."""
        self.steps, self.steps_done, self.step_share = steps, step, done
        if self.active and self.clock() - self.shown >= self.interval:
            self._show(step, steps)

    def step_done(self, phase: str, step: int, steps: int) -> None:
        """``step`` (of ``steps``) has ended, its next block received."""
        now = self.clock()
        self.step_seconds, self.step_started = now - self.step_started, now
        self.steps, self.steps_done, self.step_share = steps, step + 1, None
        if self.active and self.clock() - self.shown >= self.interval:
            self._show(step + 1, steps)

    # ------------------------------------------------------------------ the line
    def fraction(self) -> float:
        """The share of the work done (0 .. 1)."""
        if self.total <= 0:
            return 0.0
        within = 0.0
        if self.label is not None and self.steps > 0:
            if self.step_share is not None:
                part = min(self.step_share, 0.99)
            else:
                part = min((self.clock() - self.step_started) / self.step_seconds, 0.99) if self.step_seconds else 0.0
            within = self.work * min((self.steps_done + part) / self.steps, 1.0)
        return min((self.done + within) / self.total, 1.0)

    def line(self, step: int, steps: int) -> str:
        """The progress line with ``step`` (0-based; ``steps``: the ring has ended) under way."""
        now = self.clock()
        elapsed = now - (self.started if self.started is not None else now)
        share = self.fraction()
        parts = [f"{100 * share:.1f}% done"]
        if elapsed > 0 and share > 0:
            parts.append(rate(share * self.total / elapsed))
        parts.append(f"{duration(elapsed)} elapsed")
        if share > 0:
            parts.append(f"~{duration(elapsed * (1 - share) / share)} left")
        return f"{PREFIX}{self.label or 'ring'}, step {min(step + 1, steps)}/{steps}: " + ", ".join(parts)

    def _show(self, step: int, steps: int) -> None:
        self.shown = self.clock()
        text = self.line(step, steps)
        if self.tty:
            self.stream.write("\r" + text + " " * max(0, self.open_line - len(text)))
            self.stream.flush()
            self.open_line = len(text)
        else:
            click.echo(text, file=self.stream)

    def _write_line(self, text: str) -> None:
        if self.open_line:  # over the line being redrawn
            text = "\r" + text + " " * max(0, self.open_line - len(text))
            self.open_line = 0
        click.echo(text, file=self.stream)
