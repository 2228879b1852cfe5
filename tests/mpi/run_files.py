"""Rank-side driver: many ``ringmpi run`` jobs on existing input files in one mpirun launch.

    mpirun -n P python tests/mpi/run_files.py CASES.json DIR

Each case ``{"id", "run": [options]}`` runs ``run DIR/<id>.in.h5 -o DIR/<id>.out.h5 <options>``
through the real click command, in process, on every rank.
"""

import json
import os
import sys

from ringmpi.runtime.errors import abort_on_error
from ringmpi.cli.run import run


def main():
    cases = json.load(open(sys.argv[1]))
    where = sys.argv[2]
    for case in cases:
        src = os.path.join(where, f"{case['id']}.in.h5")
        dst = os.path.join(where, f"{case['id']}.out.h5")
        with abort_on_error(abort_config=True):  # a broken case ends the job instead of hanging it
            run.main(args=[src, "-o", dst] + case["run"], standalone_mode=False)


if __name__ == "__main__":
    main()
