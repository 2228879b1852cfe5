"""Rank-side driver: ``ringmpi verify`` of many result files in one mpirun launch.

    mpirun -n P python tests/mpi/verify_files.py CASES.json DIR [verify options...]

For each case id of CASES.json every rank runs the real click command in process,
``verify DIR/<id>.in.h5 DIR/<id>.out.h5 <options>``; rank 0 prints one JSON line per case,
``{"id", "status", "report"}`` (``status``: verify's exit status, 0 when it returns).
"""

import contextlib
import io
import json
import os
import sys

from ringmpi.cli.verify import verify
from ringmpi.runtime.errors import abort_on_error


def main():
    from mpi4py import MPI

    cases = json.load(open(sys.argv[1]))
    where, options = sys.argv[2], sys.argv[3:]
    for case in cases:
        src, dst = (os.path.join(where, f"{case['id']}.{x}.h5") for x in ("in", "out"))
        report = io.StringIO()
        with abort_on_error(abort_config=True), contextlib.redirect_stdout(report):
            try:
                verify.main(args=[src, dst] + options, standalone_mode=False)
                status = 0
            except SystemExit as exc:
                status = exc.code
        if MPI.COMM_WORLD.Get_rank() == 0:
            print(json.dumps({"id": case["id"], "status": status, "report": report.getvalue()}), flush=True)


if __name__ == "__main__":
    main()
