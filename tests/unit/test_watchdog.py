"""ringmpi.runtime.watchdog in a child process without MPI: a phase past its deadline ends the process
naming the phase, runs the abort cleanups; a phase that keeps the GIL is ended by faulthandler."""

import subprocess
import sys
import time

from ringmpi.runtime import watchdog


def run(code, timeout=60):
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", "import re, time\nfrom ringmpi.runtime import watchdog\n" + code],
                          capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - start


def test_no_deadline_no_thread(monkeypatch):
    monkeypatch.delenv("RINGMPI_TIMEOUT", raising=False)
    watchdog.set_default(None)
    with watchdog.phase("nothing to watch"):
        assert watchdog.deadline() is None and not watchdog._phases
    assert watchdog.deadline(3.0) == 3.0
    monkeypatch.setenv("RINGMPI_TIMEOUT", "7")
    assert watchdog.deadline() == 7.0


def test_a_phase_past_its_deadline_ends_the_process_naming_it(tmp_path):
    marker = tmp_path / "partial"
    marker.write_text("x")
    proc, seconds = run(f"import os\nwatchdog.on_abort(lambda: os.unlink({str(marker)!r}))\n"
                        "with watchdog.phase('HDF5 create demo.h5', 0.5):\n    time.sleep(60)\n")
    assert proc.returncode == 1 and seconds < 20, (proc.returncode, seconds, proc.stderr)
    assert "ringmpi: HDF5 create demo.h5 did not finish within 0.5 s (host " in proc.stderr, proc.stderr
    assert not marker.exists()  # the cleanup ran before the abort


def test_phases_that_end_in_time_do_not_fire():
    proc, _ = run("for i in range(20):\n    with watchdog.phase('short', 0.3):\n        time.sleep(0.02)\n"
                  "time.sleep(1.0)\nprint('done')\n")
    assert proc.returncode == 0 and proc.stdout.strip() == "done", proc.stderr


def test_a_call_holding_the_gil_is_ended_by_the_backstop():
    """A C call that never releases the GIL (as h5py's file open does): faulthandler's thread,
    which needs no GIL, dumps the stacks and ends the process ABORT_GRACE_S past the deadline."""
    proc, seconds = run("with watchdog.phase('stuck', 0.5):\n    re.match(r'(a+)+$', 'a' * 64 + 'b')\n")
    assert proc.returncode == 1 and seconds < 0.5 + watchdog.ABORT_GRACE_S + 10, (seconds, proc.stderr)
    assert "Timeout" in proc.stderr and "in match" in proc.stderr, proc.stderr
