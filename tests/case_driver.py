"""The rank side of a shared launch: run every case, rank 0 prints one ``CASE <json>`` line each.

Used by the drivers that ``mpi_util.run_cases`` starts (``ring_cases.py``,
``decode_cases.py``, ``torch_cases.py``): a case is ``call(case) -> (ok, msg)``;
an exception is reported as that case's failure and the launch goes on, so one
broken case cannot hide the others.
"""

import json
import sys
import traceback


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
