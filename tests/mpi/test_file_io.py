"""Attention over a file: ``make-data`` -> ``run`` under real mpirun, every
output element checked against the float64 dense reference of ``reference.py``.

One mpirun launch per world size runs every case (``file_cases.py``); each
case is then its own pytest item.  Also: the generator is rank-count
independent, the bundled sample and ``jobs/local.sh`` work end to end, and
``verify`` passes a good file and fails a damaged one.
"""

import json
import re
import shutil
import subprocess
import sys

import h5py
import numpy as np
import pytest

import reference
from cli_util import RINGMPI
from file_check import check_case, load_file
from mpi_util import DRIVERS, ROOT, launch_cache, mpirun, mpirun_env

WORLD_SIZES = (1, 2, 3, 4)
BASE = ["--n", "67", "--heads", "4", "--kv-heads", "2", "--dim", "8", "--with-do", "--seed", "7"]


def cases():
    out = []
    for layout in ("contiguous", "zigzag", "striped"):
        for causal in (False, True):
            out.append(dict(id=f"{layout}-{'causal' if causal else 'full'}", data=BASE + ["--batch", "2"],
                            run=["--layout", layout, "--backward"] + (["--causal"] if causal else [])))
    out += [
        dict(id="forward-only", data=["--n", "50", "--heads", "2", "--dim", "16", "--seed", "3"], run=[]),
        dict(id="causal-default-layout", data=BASE, run=["--causal"]),
        dict(id="three-d", data=BASE + ["--no-batch-axis"], run=["--causal", "--backward", "--layout", "striped"]),
        dict(id="nq-ne-nkv", data=["--n", "37", "--n-kv", "50", "--heads", "3", "--kv-heads", "1", "--dim", "5",
                                   "--with-do"], run=["--causal", "--backward", "--layout", "zigzag"]),
        dict(id="segments-window", data=BASE + ["--segments", "4", "--batch", "2"],
             run=["--window", "5", "2", "--backward", "--layout", "striped"]),
        dict(id="passes", data=["--n", "40", "--heads", "4", "--kv-heads", "2", "--dim", "8", "--batch", "3",
                                "--with-do"], run=["--heads-per-pass", "2", "--backward", "--causal"],
             env={"RINGMPI_PASS_BYTES": 1}),
        dict(id="small-pieces", data=BASE, run=["--backward", "--layout", "striped", "--causal"],
             env={"RINGMPI_IO_PIECE_BYTES": 200}),
        dict(id="tiny", data=["--n", "2", "--heads", "2", "--dim", "4", "--with-do"], run=["--causal", "--backward"]),
        dict(id="float16", data=BASE + ["--dtype", "float16"], run=["--causal", "--backward"]),
        dict(id="float64", data=BASE + ["--dtype", "float64"], run=["--causal", "--backward", "--scale", "0.3"]),
        dict(id="bfloat16", data=BASE + ["--dtype", "bfloat16", "--batch", "2"],
             run=["--causal", "--backward", "--layout", "striped"]),
        dict(id="progress", data=BASE, run=["--causal", "--backward"], env={"RINGMPI_PROGRESS_S": 0}),
        dict(id="quiet", data=BASE, run=["--causal", "--backward", "--quiet"], env={"RINGMPI_PROGRESS_S": 0}),
        dict(id="alibi", data=["--n", "37", "--n-kv", "50", "--heads", "4", "--kv-heads", "2", "--dim", "8",
                               "--with-do", "--batch", "2"],
             run=["--causal", "--backward", "--alibi-slopes", "0.5,0.25,0.3,0.0625", "--heads-per-pass", "2"]),
        # packed documents (issue 42): the balanced layout from the segment ids (different per batch
        # entry here), K/V routed; then in head passes with a window, the schedule forced
        dict(id="balanced", data=BASE + ["--segments", "6", "--batch", "2"],
             run=["--causal", "--backward", "--layout", "balanced"]),
        dict(id="balanced-window-routed", data=BASE + ["--segments", "5"],
             run=["--causal", "--window", "6", "0", "--backward", "--layout", "balanced", "--schedule", "routed",
                  "--heads-per-pass", "2"]),
    ]
    return out


CASES = cases()


def _run(p, tmp_path_factory):
    where = tmp_path_factory.mktemp(f"files_P{p}")
    spec = where / "cases.json"
    spec.write_text(json.dumps(CASES))
    rc, out, err, secs = mpirun(p, [sys.executable, DRIVERS / "file_cases.py", spec, where], 240)
    return rc, out, err, where


_runs = launch_cache(_run)  # (rc, out, err, where) per world size, started by the launch fixture


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    def get(p):
        rc, out, err, where = _runs(p, tmp_path_factory)
        assert rc == 0, f"mpirun -n {p} file_cases.py exit {rc}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-5000:]}"
        return where
    return get


@pytest.mark.mpi
@pytest.mark.parametrize("p", WORLD_SIZES)
@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_file_case(launch, p, case):
    check_case(case, launch(p), p)


@pytest.mark.mpi
def test_make_data_same_bytes_for_any_rank_count(launch):
    one, three = launch(1), launch(3)
    for case in CASES:
        a, _ = load_file(one / f"{case['id']}.in.h5")
        b, _ = load_file(three / f"{case['id']}.in.h5")
        assert a.keys() == b.keys()
        for name in a:
            assert a[name].dtype == b[name].dtype and a[name].tobytes() == b[name].tobytes(), (case["id"], name)


@pytest.mark.mpi
def test_balanced_layout_runs_the_schedule_auto_chose(launch):
    """``--layout balanced`` let ``schedule="auto"`` choose by predicted time (issue 53), and the
    summary says what it chose, its prediction and the runner-up's."""
    launch(3)
    _, out, err, _ = _runs(3)
    summary = out.split("layout balanced")[1].splitlines()
    assert any(re.match(r"  K/V schedule: [a-z, ]+ \(chosen by "
                        r"schedule auto: predicted [0-9.e+-]+ s, runner-up \w+ [0-9.e+-]+ s\); bytes received "
                        r"per rank", line) for line in summary[:8]), out[-3000:]


@pytest.mark.mpi
def test_passes_were_used(launch):
    """The "passes" case (B=3, two kv-head groups, a 1-byte budget) ran as six passes."""
    launch(2)
    _, out, err, _ = _runs(2)
    summary = [line for line in out.splitlines() if line.startswith("ringmpi run: N=40 B=3 ")]
    assert len(summary) == 1 and summary[0].endswith(", 6 pass(es)"), out[-3000:]
    assert "[ringmpi] 12/12 backward batch 2:3 kv heads 1:2" in err, err[-3000:]


PROGRESS = re.compile(r"^\[ringmpi\] (forward|backward) batch 0:1 kv heads 0:2, step (\d)/(\d): (\d+\.\d)% done"
                      r"(, \S+ [MGT]?FLOP/s)?, \S+ elapsed(, ~\S+ left)?$")


def case_messages(err, case_id):
    """The stderr lines of one case of a file_cases launch (after its ``[case <id>]`` mark)."""
    lines = err.splitlines()
    start = lines.index(f"[case {case_id}]") + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("[case ")), len(lines))
    return lines[start:end]


@pytest.mark.mpi
def test_run_reports_progress_on_rank_0_and_quiet_silences_it(launch):
    """With RINGMPI_PROGRESS_S=0 every ring step's progress line appears (batch log: stderr is a
    pipe), once (rank 0 only), with the pass, the step of P, a share done that never goes back,
    and a rate and time left once a step has ended; ``--quiet`` prints no progress and no pass lines."""
    launch(3)
    _, _, err, _ = _runs(3)
    lines = case_messages(err, "progress")
    matched = [PROGRESS.match(x) for x in lines if PROGRESS.match(x)]
    assert matched, lines
    assert {m[1] for m in matched} == {"forward", "backward"} and {m[3] for m in matched} == {"3"}
    assert {m[2] for m in matched} >= {"1", "2", "3"}, lines
    shares = [float(m[4]) for m in matched]
    assert shares == sorted(shares) and 0 <= shares[0] and shares[-1] <= 100, shares
    assert any(m[5] and m[6] for m in matched), lines  # after a step: rate and time left
    assert "[ringmpi] 2/2 backward batch 0:1 kv heads 0:2" in "\n".join(lines)
    assert all(x.startswith("[ringmpi] ") for x in lines), lines  # nothing from the other ranks
    assert case_messages(err, "quiet") == [], err[-3000:]


@pytest.mark.mpi
def test_sampled_verify_passes_every_case(launch):
    """``verify --sample`` on every case's files (P = 3), its rows dealt to 2 ranks in one launch:
    batches, 3-D files, N_q != N_kv, segments and windows, passes, N = 2 (every row), float16,
    float64, bfloat16, ALiBi -- each within tolerance, o/lse (and dq/dk/dv) reported."""
    where = launch(3)
    rc, out, err, _ = mpirun(2, [sys.executable, DRIVERS / "verify_files.py", where / "cases.json", where,
                                 "--sample", "16", "--seed", "4"], 240)
    assert rc == 0, err[-3000:]
    results = {r["id"]: r for r in map(json.loads, out.splitlines())}
    assert sorted(results) == sorted(c["id"] for c in CASES)
    for case in CASES:
        r = results[case["id"]]
        assert r["status"] == 0 and "PASS: every sampled row within tolerance" in r["report"], r
        assert ", seed 4 (--sample 16 --seed 4" in r["report"], r["report"]
        names = ("o", "lse") + (("dq", "dk", "dv") if "--backward" in case["run"] else ())
        for name in names:
            assert re.search(rf"\n  {name} +\S+ +\S+ +\S+ +\S+  yes  ", r["report"]), (name, r["report"])


@pytest.mark.mpi
def test_local_sh_sample_and_verify(tmp_path):
    """The bundled input through jobs/local.sh (as scripts/main.sh does), then verify."""
    sample = ROOT / "data" / "sample.h5"
    assert sample.stat().st_size < 2 * 2**20
    out = tmp_path / "sample_out.h5"
    proc = subprocess.run([str(ROOT / "jobs" / "local.sh"), "-n", "4", "run", str(sample), "-o", str(out),
                           "--causal", "--backward"], capture_output=True, text=True, timeout=120,
                          env=mpirun_env(), start_new_session=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "P=4, layout zigzag" in proc.stdout and "HDF5 (max over ranks): read" in proc.stdout
    assert out.exists() and not list(tmp_path.glob(".*tmp*"))
    good = subprocess.run([RINGMPI, "verify", str(sample), str(out)], capture_output=True, text=True, timeout=120)
    assert good.returncode == 0 and "PASS" in good.stdout, good.stdout + good.stderr
    for name in ("o", "lse", "dq", "dk", "dv"):
        assert f"\n  {name} " in good.stdout
    # damage one gradient element: verify must notice and exit 1
    with h5py.File(out, "r+") as f:
        f["dk"][0, 5, 1, 3] += 1e-2
    bad = subprocess.run([RINGMPI, "verify", str(sample), str(out)], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "FAIL" in bad.stdout and "NO" in bad.stdout, bad.stdout + bad.stderr


@pytest.mark.mpi
def test_verify_under_mpirun_and_three_d_lse(launch):
    """verify reads the 3-D case's (H, N) lse; under mpirun only rank 0 reports."""
    where = launch(2)
    rc, out, err, _ = mpirun(2, [RINGMPI, "verify", where / "three-d.in.h5", where / "three-d.out.h5"], 120)
    assert rc == 0 and out.count("PASS") == 1, out + err


@pytest.mark.mpi
def test_verify_reads_the_alibi_slopes_it_was_written_with(launch):
    """verify applies the slopes of the output's attributes: the P = 3 ALiBi job passes, and the
    same file with other slopes recorded fails."""
    where = launch(3)
    inp, out = where / "alibi.in.h5", where / "alibi.out.h5"
    good = subprocess.run([RINGMPI, "verify", str(inp), str(out)], capture_output=True, text=True, timeout=120)
    assert good.returncode == 0 and "PASS" in good.stdout and ", alibi" in good.stdout, good.stdout + good.stderr
    bad = where / "alibi.bad.h5"
    shutil.copy(out, bad)
    with h5py.File(bad, "r+") as f:
        f.attrs["alibi_slopes"] = np.array([0.5, 0.25, 0.3, 0.07], dtype=np.float32)
    proc = subprocess.run([RINGMPI, "verify", str(inp), str(bad)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "FAIL" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.mpi
def test_bfloat16_file_round_trip_and_verify(launch):
    """make-data --dtype bfloat16 writes marked uint16 patterns (h5py alone sees
    uint16), run writes bfloat16 outputs the same way, verify passes them under
    mpirun and fails a damaged one."""
    where = launch(3)
    inp, out = where / "bfloat16.in.h5", where / "bfloat16.out.h5"
    with h5py.File(inp, "r") as f:
        assert f["q"].dtype == np.uint16 and f["q"].attrs["dtype"] == "bfloat16"
    with h5py.File(out, "r") as f:
        for name in ("o", "dq", "dk", "dv"):
            assert f[name].dtype == np.uint16 and f[name].attrs["dtype"] == "bfloat16", name
        assert f["lse"].dtype == np.float32 and "dtype" not in f["lse"].attrs
    rc, text, err, _ = mpirun(2, [RINGMPI, "verify", inp, out], 120)
    assert rc == 0 and text.count("PASS") == 1, text + err
    bad = where / "bfloat16.bad.h5"
    shutil.copy(out, bad)
    with h5py.File(bad, "r+") as f:
        o = f["o"][()].view(reference.BFLOAT16)
        o[1, 7, 2, 3] += reference.BFLOAT16.type(0.25)
        f["o"][...] = o.view(np.uint16)
    proc = subprocess.run([RINGMPI, "verify", str(inp), str(bad)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "FAIL" in proc.stdout, proc.stdout + proc.stderr
