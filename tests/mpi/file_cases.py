"""Rank-side driver: many ``make-data`` + ``run`` cases in one mpirun launch.

    mpirun -n P python tests/mpi/file_cases.py CASES.json OUTDIR

For each case every rank calls the real click commands (``make_data``, then
``run``) in process, exactly as ``ringmpi`` would, writing
``OUTDIR/<id>.in.h5`` and ``OUTDIR/<id>.out.h5``.  The checks against the
float64 reference happen in pytest (``test_file_io.py``), reading the files.
Environment overrides of a case (``env``) are set on every rank around it.
"""

import json
import os
import sys

from ringmpi.cli.make_data import make_data
from ringmpi.runtime.errors import abort_on_error
from ringmpi.cli.run import run


def main():
    cases = json.load(open(sys.argv[1]))
    outdir = sys.argv[2]
    for case in cases:
        saved = {k: os.environ.get(k) for k in case.get("env", {})}
        os.environ.update({k: str(v) for k, v in case.get("env", {}).items()})
        src = os.path.join(outdir, f"{case['id']}.in.h5")
        dst = os.path.join(outdir, f"{case['id']}.out.h5")
        with abort_on_error(abort_config=True):  # a broken case ends the job instead of hanging it
            make_data.main(args=[src, "--overwrite"] + case["data"], standalone_mode=False)
            run.main(args=[src, "-o", dst] + case["run"], standalone_mode=False)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


if __name__ == "__main__":
    main()
