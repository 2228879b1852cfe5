"""``ringmpi run --head-parallel``: the file job through the head x ring schedule, and bad choices.

One launch at P = 4 under ``RINGMPI_NODE_SIZE=2`` (two pretend nodes of two
ranks, ``cli_cases.py``): the flat ring and ``--head-parallel auto`` (U = 1 or 2, by
predicted cost; the summary names the choice) on the same input, both checked against the float64
reference under the tolerance rule; then unusable choices, each exit 2 on
every rank with one message and no file.
"""

import json
import re
import sys

import h5py
import numpy as np
import pytest

from cli_util import leftovers
import reference
from mpi_util import DRIVERS, case_records, mpirun, mpirun_env

B, N, H, HKV, D = 2, 37, 4, 2, 8


def write_input(path):
    rng = np.random.default_rng(5)
    with h5py.File(path, "w") as f:
        for name, heads in (("q", H), ("k", HKV), ("v", HKV), ("do", H)):
            f[name] = rng.standard_normal((B, N, heads, D)).astype(np.float32)
        ids = np.repeat(np.arange(4), [9, 12, 6, 10])
        f["segment_ids"] = np.stack([ids, (ids + 1) // 2])
    return path


def check_against_reference(src, out):
    with h5py.File(src, "r") as f:
        q, k, v, do, seg = (f[n][...] for n in ("q", "k", "v", "do", "segment_ids"))
    vis = reference.visible(N, N, causal=True, seg_q=seg, seg_kv=seg)
    scale = 1.0 / np.sqrt(D)
    refs = reference.dense_forward(q, k, v, vis, scale, np.float64) + \
        reference.dense_backward(do, q, k, v, vis, scale, np.float64)
    naives = reference.dense_forward(q, k, v, vis, scale, np.float32) + \
        reference.dense_backward(do, q, k, v, vis, scale, np.float32)
    with h5py.File(out, "r") as f:
        ours = [f[n][...] for n in ("o", "lse", "dq", "dk", "dv")]
    messages, ok = [], True
    for name, x, ref, naive in zip(("o", "lse", "dq", "dk", "dv"), ours, refs, naives):
        good, msg = reference.tolerance_check(name, x, ref, naive, gradient=name.startswith("d"))
        ok &= good
        messages.append(msg)
    return ok, "; ".join(messages)


BAD = {
    "not-dividing-P": (["--head-parallel", "3"], "head_parallel=3 must divide the number of ranks (4)"),
    "not-a-number": (["--head-parallel", "two"], "--head-parallel: head_parallel must be a positive integer"),
    "zero": (["--head-parallel", "0"], "head_parallel must be a positive integer or 'auto', got 0"),
    "pass-heads": (["--head-parallel", "4", "--heads-per-pass", "2"],
                   "head_parallel=4 must divide the query heads of every pass (2)"),
}


@pytest.mark.mpi
def test_file_job_head_parallel_auto_and_bad_choices(tmp_path):
    src = write_input(tmp_path / "in.h5")
    common = ["run", str(src), "--causal", "--backward"]
    cases = [{"id": "flat", "argv": common + ["-o", str(tmp_path / "flat.h5")]},
             {"id": "auto", "argv": common + ["-o", str(tmp_path / "auto.h5"), "--head-parallel", "auto"]}]
    for name, (extra, _) in BAD.items():
        cases.append({"id": name, "argv": common + ["-o", str(tmp_path / f"{name}.h5")] + extra})
    path = tmp_path / "cases.json"
    path.write_text(json.dumps(cases))
    rc, stdout, stderr, _ = mpirun(4, [sys.executable, DRIVERS / "cli_cases.py", path], 240,
                                   env=mpirun_env(RINGMPI_NODE_SIZE=2))
    results = case_records(stdout)
    assert rc == 0 and set(results) == {c["id"] for c in cases}, (rc, sorted(results), stderr[-3000:])
    for name in ("flat", "auto"):
        assert results[name]["rc"] == [0, 0, 0, 0], (name, results[name]["stderr"])
        ok, msg = check_against_reference(src, tmp_path / f"{name}.h5")
        assert ok, f"{name}: {msg}"
    # auto chose U = 2 or the flat ring by predicted cost on the measured links (issue 53), and says so
    assert re.search(r"  schedule: (head x ring, 2 ranks per group \(all-to-all\), ring of 2 groups|flat ring, "
                     r"head_parallel U=1) \(chosen by head_parallel auto: (head x ring, U=2|ring), predicted "
                     r"[0-9.e+-]+ s, runner-up [\w ,=]+ [0-9.e+-]+ s\)", stdout), stdout[-3000:]
    assert stdout.count("(chosen by head_parallel auto") == 1  # the auto run only, rank 0 only
    for name, (_, message) in BAD.items():
        rcs, errs = results[name]["rc"], results[name]["stderr"]
        assert rcs == [2, 2, 2, 2], (name, rcs, errs)
        assert message in errs[0], (name, errs)
        assert sum(e.count("ringmpi: error:") for e in errs) == 1, (name, errs)
        assert not (tmp_path / f"{name}.h5").exists() and not leftovers(tmp_path), name
