"""The rank side of a shared launch: run every case, rank 0 prints one ``CASE <json>`` line each.

Used by the drivers that ``mpi_util.run_cases`` starts (``ring_cases.py``,
``decode_cases.py``, ``torch_cases.py``, ...): a case is ``call(case) -> (ok, msg)``;
an exception is reported as that case's failure and the launch goes on, so one
broken case cannot hide the others.

A driver runs as a script (``mpirun python tests/mpi/ring_cases.py cases.json``), so its own
folder is on the path and the drivers import each other by name; importing this module first
puts ``tests/support`` beside it, as pyproject's ``pythonpath`` does under pytest: the one
place a driver's path is set.
"""

import json
import sys
import traceback
from pathlib import Path

SUPPORT = str(Path(__file__).resolve().parent.parent / "support")
if SUPPORT not in sys.path:
    sys.path.insert(1, SUPPORT)


def run_all(comm, cases, call):
    for case in cases:
        try:
            result = call(case)
        except Exception as exc:  # report and go on: one broken case must not hide the others
            result = (False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            if comm.Get_rank() != 0:
                print(f"[rank {comm.Get_rank()}] case {case['id']}: {result[1]}", file=sys.stderr, flush=True)
        if comm.Get_rank() == 0:
            ok, msg = result
            print("CASE " + json.dumps({"id": case["id"], "ok": bool(ok), "msg": msg}), flush=True)


def run_file(comm, kinds, default):
    """Run the cases of the JSON file ``sys.argv[1]``: ``kinds[case["kind"]]`` (else
    ``default``) called as ``(comm, case)``."""
    with open(sys.argv[1]) as fh:
        cases = json.load(fh)
    run_all(comm, cases, lambda case: kinds.get(case.get("kind"), default)(comm, case))


def agreed_error(comm, call, want):
    """Collective: None when ``call()`` raises a ConfigError containing ``want`` with
    the same message on every rank of ``comm``, else what went wrong."""
    from ringmpi.runtime.errors import ConfigError

    try:
        call()
        got = None
    except ConfigError as exc:
        got = str(exc)
    every = comm.allgather(got)
    if got is None or want not in got or len(set(every)) != 1:
        return f"wanted one ConfigError containing {want!r}, ranks got {every}"
    return None
