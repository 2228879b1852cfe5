"""Rank-side driver: run many ``ringmpi`` command lines in one mpirun launch.

    mpirun -n P python tests/mpi/cli_cases.py CASES.json

``CASES.json`` is a list of ``{"id", "argv"}``.  Every rank runs each command
line in-process through :func:`ringmpi.cli.main` (the console entry point),
capturing its exit status and stderr; rank 0 gathers them and prints one line
per case: ``CASE {"id", "rc": [per rank], "stderr": [per rank]}``.  For
commands that fail before any ring step (bad input, exit 2): a command that
aborts the job ends the whole launch, which the caller sees as missing cases.
"""

import contextlib
import io
import json
import sys

from mpi4py import MPI

from ringmpi.cli import main as ringmpi_main


def run_case(argv):
    err = io.StringIO()
    rc = 0
    with contextlib.redirect_stderr(err):
        try:
            ringmpi_main(argv)
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else 1
    return rc, err.getvalue()


def main():
    comm = MPI.COMM_WORLD
    with open(sys.argv[1]) as fh:
        cases = json.load(fh)
    for case in cases:
        rc, err = run_case(case["argv"])
        every = comm.gather((rc, err), root=0)
        if comm.Get_rank() == 0:
            print("CASE " + json.dumps({"id": case["id"], "rc": [r for r, _ in every],
                                        "stderr": [e for _, e in every]}), flush=True)


if __name__ == "__main__":
    main()
