"""The command line: bad input exits 2 with one clear message and leaves no
file; failures while writing never damage an existing output; ``--help`` and
``--version`` never initialise MPI; the job scripts parse."""

import hashlib
import json
import os
import re
import subprocess
import sys

import h5py
import numpy as np
import pytest

from cli_util import RINGMPI, leftovers, ringmpi, write_input
from mpi_util import DRIVERS, ROOT, case_records, mpirun, mpirun_env

JOB_SCRIPTS = sorted(p for p in (ROOT / "jobs").glob("*") if p.is_file() and p.suffix not in (".py", ".pyc")) + [ROOT / "scripts" / "main.sh", ROOT / "data" / "make_sample.sh"]


def digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


BAD = {
    "missing-file": (lambda p: p / "nope.h5", [], "input file does not exist"),
    "not-hdf5": (lambda p: (p / "text.h5").write_text("hello") and p / "text.h5", [], "not an HDF5 file"),
    "missing-dataset": (lambda p: write_input(p / "in.h5", v=None), [], "missing dataset 'v'"),
    "wrong-rank": (lambda p: write_input(p / "in.h5", q=np.zeros((20, 32), "f4")), [],
                   "dataset 'q' has rank 2"),
    "mismatched-dim": (lambda p: write_input(p / "in.h5", k=np.zeros((1, 20, 2, 4), "f4"),
                                             v=np.zeros((1, 20, 2, 4), "f4")), [], "head dims differ"),
    "mismatched-batch": (lambda p: write_input(p / "in.h5", k=np.zeros((2, 20, 2, 8), "f4"),
                                               v=np.zeros((2, 20, 2, 8), "f4")), [], "batch sizes differ"),
    "heads-not-multiple": (lambda p: write_input(p / "in.h5", h=4, hkv=3, do=False), [],
                           "H % H_kv must be 0"),
    "bad-dtype": (lambda p: write_input(p / "in.h5", dtype="int32"), [], "unsupported dtype int32"),
    "mixed-dtype": (lambda p: write_input(p / "in.h5", v=np.zeros((1, 20, 2, 8), "f8")), [],
                    "must share one dtype"),
    "no-do-backward": (lambda p: write_input(p / "in.h5", do=False), ["--backward"],
                       "--backward needs dataset 'do'"),
    "heads-per-pass": (lambda p: write_input(p / "in.h5"), ["--heads-per-pass", "3"],
                       "--heads-per-pass 3: must be a positive multiple of"),
    "output-dir-missing": (lambda p: write_input(p / "in.h5"), ["-o", "{tmp}/no/such/dir/out.h5"],
                           "output directory"),
}


def bad_input_case(directory, name):
    """Create case ``name``'s input under ``directory``: (argv after ``ringmpi``, output path, message)."""
    directory.mkdir()
    make, extra, message = BAD[name]
    src = make(directory)
    out = directory / "out.h5"
    args = [a.replace("{tmp}", str(directory)) for a in extra]
    if "-o" not in args:
        args += ["-o", str(out)]
    if name == "missing-dataset":
        message = [message, str(src)]  # the message names the file
    return ["run", str(src)] + args, out, message if isinstance(message, list) else [message]


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_input_exit_2_one_process(tmp_path, name):
    """One process without mpirun: exit 2, one message, no file."""
    argv, out, messages = bad_input_case(tmp_path / name, name)
    rc, stdout, stderr = ringmpi(argv)
    assert rc == 2, stderr
    assert all(m in stderr for m in messages) and stderr.count("ringmpi: error:") == 1, stderr
    assert not out.exists() and not leftovers(out.parent)


def test_a_job_beyond_the_memory_budget_is_refused_before_it_starts(tmp_path):
    """(issue 53) A pass whose shards exceed a rank's memory budget: exit 2 with what it needs and
    the budget, no file (it used to end in a MemoryError traceback)."""
    src, out = write_input(tmp_path / "in.h5", n=64), tmp_path / "out.h5"
    rc, stdout, stderr = ringmpi(["run", src, "-o", out], env=mpirun_env(RINGMPI_MEMORY_BUDGET="1K"))
    assert rc == 2, stderr
    assert "one pass needs about" in stderr and "memory budget of 9.54e-07 GiB" in stderr, stderr
    assert "--heads-per-pass" in stderr and stderr.count("ringmpi: error:") == 1, stderr
    assert not out.exists() and not leftovers(out.parent)


@pytest.mark.mpi
def test_bad_input_exit_2_under_mpirun(tmp_path):
    """P = 4, every case in one launch: every rank exits 2, rank 0 alone prints the one message, no file."""
    cases, expect = [], {}
    for name in sorted(BAD):
        argv, out, messages = bad_input_case(tmp_path / name, name)
        cases.append({"id": name, "argv": argv})
        expect[name] = (out, messages)
    path = tmp_path / "cases.json"
    path.write_text(json.dumps(cases))
    rc, stdout, stderr, _ = mpirun(4, [sys.executable, DRIVERS / "cli_cases.py", path], 120)
    results = case_records(stdout)
    assert rc == 0 and set(results) == set(BAD), (rc, sorted(results), stderr[-3000:])
    for name, (out, messages) in expect.items():
        rcs, errs = results[name]["rc"], results[name]["stderr"]
        assert rcs == [2, 2, 2, 2], (name, rcs, errs)
        assert all(m in errs[0] for m in messages), (name, errs)
        assert sum(e.count("ringmpi: error:") for e in errs) == 1, (name, errs)
        assert not out.exists() and not leftovers(out.parent), name


@pytest.mark.mpi
def test_nonfinite_input_names_global_index(tmp_path):
    q = np.random.default_rng(0).standard_normal((1, 20, 4, 8)).astype("f4")
    q[0, 13, 2, 5] = np.nan
    src = write_input(tmp_path / "in.h5", q=q)
    rc, out, err, _ = mpirun(2, [RINGMPI, "run", src, "-o", tmp_path / "out.h5", "--check-finite",
                                 "--layout", "striped"], 60)
    assert rc == 2, err
    assert "q has a non-finite value (nan) at global index [0, 13, 2, 5]" in err, err
    assert err.count("ringmpi: error:") == 1
    assert not (tmp_path / "out.h5").exists() and not leftovers(tmp_path)


def test_check_finite_scans_every_pass_before_any_compute(tmp_path):
    """Four passes (one batch entry, one kv head each); the Inf is in the last.  The
    scan must reject it before the first ring step (where RINGMPI_FAULT would
    fire) and name the batch entry and head globally, not within the pass."""
    q = np.random.default_rng(0).standard_normal((2, 20, 4, 8)).astype("f4")
    q[1, 13, 3, 5] = np.inf
    src = write_input(tmp_path / "in.h5", b=2, q=q)
    rc, _, err = ringmpi(["run", src, "-o", tmp_path / "out.h5", "--check-finite", "--heads-per-pass", "2"],
                         env=mpirun_env(RINGMPI_PASS_BYTES="1", RINGMPI_FAULT="raise:0:0:fwd"))
    assert rc == 2, err
    assert "q has a non-finite value (inf) at global index [1, 13, 3, 5]" in err, err
    assert not (tmp_path / "out.h5").exists() and not leftovers(tmp_path)


def test_existing_output_needs_overwrite(tmp_path):
    src = write_input(tmp_path / "in.h5")
    out = tmp_path / "out.h5"
    out.write_bytes(b"precious")
    rc, _, err = ringmpi(["run", src, "-o", out])
    assert rc == 2 and "output file exists (pass --overwrite" in err, err
    assert out.read_bytes() == b"precious" and not leftovers(tmp_path)
    rc, _, err = ringmpi(["run", src, "-o", src, "--overwrite"])
    assert rc == 2 and "the output path is the input file" in err, err
    rc, stdout, err = ringmpi(["run", src, "-o", out, "--overwrite"])
    assert rc == 0, err
    with h5py.File(out, "r") as f:
        assert set(f) == {"o", "lse"} and f.attrs["world_size"] == 1


@pytest.mark.mpi
@pytest.mark.parametrize("fault", ["write:1", "raise:0:1:bwd", "exit:3:2:fwd"])
def test_failure_leaves_existing_output_intact(tmp_path, fault):
    """A rank failing in the ring or between writing and closing ends the job;
    the existing output is byte-identical and no temporary file is left.  Only the
    failure path can end it within mpirun's 60 s deadline (past it the test fails):
    the ring's own timeout is ``run``'s default 600 s."""
    src = write_input(tmp_path / "in.h5", n=50)
    out = tmp_path / "out.h5"
    rc, _, err, _ = mpirun(4, [RINGMPI, "run", src, "-o", out, "--backward"], 60)
    assert rc == 0, err
    before = digest(out)
    rc, _, err, _ = mpirun(4, [RINGMPI, "run", src, "-o", out, "--backward", "--causal", "--overwrite"], 60,
                           env=mpirun_env(RINGMPI_FAULT=fault))
    assert rc != 0, err
    assert fault.startswith("exit") or "injected fault" in err, err
    assert digest(out) == before and not leftovers(tmp_path)
    fresh = tmp_path / "fresh.h5"
    rc, _, err, _ = mpirun(4, [RINGMPI, "run", src, "-o", fresh, "--backward"], 60,
                           env=mpirun_env(RINGMPI_FAULT=fault))
    assert rc != 0 and not fresh.exists() and not leftovers(tmp_path), err


@pytest.mark.mpi
def test_a_rank_late_to_a_file_job_collective_ends_the_job_naming_it(tmp_path):
    """One rank pauses before the file job's allgather of its finiteness checks, far past
    ``--timeout``: the others' watchdog ends the job within seconds, naming that collective,
    and no file is left (tests/test_link_faults.py cuts a link there instead)."""
    src = write_input(tmp_path / "in.h5", n=50)
    out = tmp_path / "out.h5"
    rc, _, err, _ = mpirun(4, [RINGMPI, "run", src, "-o", out, "--timeout", "3"], 60,
                           env=mpirun_env(RINGMPI_FAULT="sleep:finite:2:120"))
    assert rc != 0
    named = re.findall(r"\[rank (\d)\] ringmpi: the ranks' finiteness check of \S+ \(allgather\) did not "
                       r"finish within 3 s", err)
    assert named and "2" not in named, err[-3000:]
    assert not out.exists() and not leftovers(tmp_path), err[-3000:]


def test_verify_samples_rows_above_max_n(tmp_path):
    src = write_input(tmp_path / "in.h5", n=300)
    rc, _, err = ringmpi(["verify", src, tmp_path / "missing.h5", "--max-n", "100"])
    assert rc == 2 and "missing or not an HDF5 file" in err, err
    rc, _, err = ringmpi(["run", src, "-o", tmp_path / "out.h5"])
    assert rc == 0, err
    rc, out, err = ringmpi(["verify", src, tmp_path / "out.h5", "--max-n", "100"])
    assert rc == 0 and "N=300 is above --max-n 100, too long to check whole" in out, out + err
    assert "a sample of 256 query rows, seed 0" in out and "PASS: every sampled row" in out, out


@pytest.mark.parametrize("flag", ["--help", "--version", "run --help", "make-data --help", "verify --help",
                                  "info --help"])
def test_help_does_not_initialise_mpi(flag):
    code = ("import sys\nfrom ringmpi.cli import main\n"
            f"try:\n    main({flag.split()!r})\nexcept SystemExit as e:\n    assert e.code == 0, e.code\n"
            "bad = [m for m in ('mpi4py.MPI', 'h5py', 'cupy') if m in sys.modules]\n"
            "assert not bad, bad\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert ("0.1" in proc.stdout) if flag == "--version" else ("Usage:" in proc.stdout)


def test_import_leaves_the_environment_alone_and_the_cli_sets_one_thread():
    """``import ringmpi`` changes no variable and loads no NumPy; the command line sets
    one BLAS/OpenMP thread per rank before NumPy loads, keeping what the user set."""
    code = ("import os, sys\n"
            "before = dict(os.environ)\n"
            "import ringmpi, ringmpi.cli\n"
            "assert dict(os.environ) == before and 'numpy' not in sys.modules\n"
            "try:\n    ringmpi.cli.main(['--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
            "assert 'numpy' not in sys.modules\n"
            "print(os.environ['OPENBLAS_NUM_THREADS'], os.environ['OMP_NUM_THREADS'], os.environ['MKL_NUM_THREADS'])\n")
    env = {k: v for k, v in os.environ.items() if not k.endswith("_NUM_THREADS")}
    env["MKL_NUM_THREADS"] = "3"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "1 1 3"


@pytest.mark.parametrize("script", JOB_SCRIPTS, ids=lambda p: p.name)
def test_job_scripts_parse(script):
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_local_sh_usage():
    proc = subprocess.run([str(ROOT / "jobs" / "local.sh"), "-n", "2"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "usage" in proc.stderr


@pytest.mark.mpi
def test_info(tmp_path):
    rc, out, err, _ = mpirun(2, [RINGMPI, "info"], 60)
    assert rc == 0, err
    for needle in ("MPI:", "world size: 2", "CUDA-aware MPI:", "GPUs", "parallel yes", "backend 'auto' picks:",
                   "CPU vector paths: tile pass", "bfloat16 (ml_dtypes"):
        assert needle in out, out
    assert out.count("world size") == 1
