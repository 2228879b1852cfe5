"""The batch scripts and ``srun`` under a real Slurm (one node, this machine).

The ``slurm`` fixture installs Debian's ``slurm-wlm`` and ``munge`` when
missing (root with apt-get only; otherwise every test here is skipped with the
reason), starts ``munged``, ``slurmctld`` and ``slurmd`` (``slurm_cluster.py``)
once per session and stops them at the end.  Jobs are submitted from a
directory other than the checkout, as a user would, and their results checked
against the float64 dense reference.
"""

import shutil
import tempfile
from pathlib import Path

import h5py
import numpy as np
import pytest

import slurm_cluster
from cli_util import RINGMPI
from file_check import check_case
from mpi_util import ROOT, mpirun, mpirun_env

pytestmark = [pytest.mark.mpi, pytest.mark.slurm]

SAMPLE = ROOT / "data" / "sample.h5"
CPU_JOB = ROOT / "jobs" / "slurm-cpu.sbatch"
GPU_JOB = ROOT / "jobs" / "slurm-gpu.sbatch"
SMALL = ["--nodes=1", "--ntasks-per-node=2"]       # docs/file-job.md's override of the cluster-sized headers
GPU_SMALL = SMALL + ["--cpus-per-task=1", "--gpus-per-node=0"]  # this node has no GPU to ask for


def job_env(**extra):
    """The submitting shell: local Open MPI settings (inherited by srun), and RINGMPI_VENV only
    when the checkout has no .venv of its own (the scripts' default is <checkout>/.venv)."""
    env = mpirun_env(**extra)
    if "RINGMPI_VENV" not in extra and not (ROOT / ".venv" / "bin" / "ringmpi").exists():
        env["RINGMPI_VENV"] = str(Path(RINGMPI).parent.parent)
    return env


@pytest.fixture(scope="session")
def slurm():
    slurm_cluster.require_installed()
    # not under pytest's private tmp: munged wants every directory above its socket open to all
    cluster = slurm_cluster.SlurmCluster(Path(tempfile.mkdtemp(prefix="ringmpi-slurm-")))
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


def sample_case(tmp_path, run_args):
    """The bundled sample as ``sample.in.h5`` in ``tmp_path`` (check_case's naming)."""
    shutil.copy(SAMPLE, tmp_path / "sample.in.h5")
    return dict(id="sample", run=run_args)


def assert_one_error(text, needle):
    assert text.count("ringmpi: error:") == 1 and needle in text, text


def test_cpu_job_on_the_sample_verified(slurm, tmp_path):
    """sbatch from another directory: COMPLETED, every output within the tolerance rule."""
    case = sample_case(tmp_path, ["--causal", "--backward"])
    job = slurm.sbatch(SMALL + [CPU_JOB, "sample.in.h5", "sample.out.h5", *case["run"]], cwd=tmp_path,
                       env=job_env())
    assert (job.state, job.exit_code) == ("COMPLETED", 0), job.output
    assert "P=2, layout zigzag, causal, forward+backward, backend numpy" in job.output, job.output
    check_case(case, tmp_path, 2)
    with h5py.File(tmp_path / "sample.out.h5", "r") as f:
        assert f.attrs["backend"] == "numpy"


def test_cpu_job_missing_input_exits_2(slurm, tmp_path):
    job = slurm.sbatch(SMALL + [CPU_JOB, "missing.h5", "out.h5"], cwd=tmp_path, env=job_env())
    assert (job.state, job.exit_code) == ("FAILED", 2), job.output
    assert_one_error(job.output, "missing.h5: input file does not exist")
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"ringmpi-{job.id}.out"]


@pytest.mark.parametrize("script", [CPU_JOB, GPU_JOB], ids=lambda p: p.name)
def test_usage_names_the_script_as_submitted(slurm, tmp_path, script):
    """Not $0 (Slurm's spool copy): the path given to sbatch, relative when submitted from the checkout."""
    for cwd, given in ((ROOT, script.relative_to(ROOT)), (tmp_path, script)):
        job = slurm.sbatch(GPU_SMALL + [f"--output={tmp_path}/usage-%j.out", given], cwd=cwd, env=job_env())
        assert (job.state, job.exit_code) == ("FAILED", 2), job.output
        first = job.output.splitlines()[0]
        assert first.startswith("usage: sbatch ") and f" {given} IN.h5 OUT.h5" in first, job.output
        assert "slurm_script" not in job.output


@pytest.mark.parametrize("script", [CPU_JOB, GPU_JOB], ids=lambda p: p.name)
def test_missing_environment_says_how_to_make_it(slurm, tmp_path, script):
    missing = tmp_path / "no-venv"
    job = slurm.sbatch(GPU_SMALL + [script, SAMPLE, "out.h5"], cwd=tmp_path,
                       env=job_env(RINGMPI_VENV=missing))
    assert (job.state, job.exit_code) == ("FAILED", 2), job.output
    text = job.output.strip()
    assert len(text.splitlines()) == 1, text  # nothing was launched
    assert f"no ringmpi environment at {missing}" in text and "scripts/setup.sh" in text \
        and "RINGMPI_VENV=" in text, text
    assert not (tmp_path / "out.h5").exists()


def test_gpu_job_without_a_gpu_exits_2_once(slurm, tmp_path):
    """The GPU script on a node where CuPy finds no usable device: ``ringmpi info`` names the
    cause, the run stops before any data moves with one message, exit 2, no output."""
    from ringmpi.runtime.device import gpu_unavailable_reason

    reason = gpu_unavailable_reason()
    if reason is None:
        pytest.skip("this machine has a usable GPU; the test cluster has no GPU resources to give the job")
    job = slurm.sbatch(GPU_SMALL + [GPU_JOB, SAMPLE, "out.h5", "--causal"], cwd=tmp_path, env=job_env())
    assert (job.state, job.exit_code) == ("FAILED", 2), job.output
    assert f"GPUs seen by rank 0: 0 [none]; {reason}" in job.output, job.output
    assert_one_error(job.output, f"ringmpi: error: --backend cupy needs a usable CUDA GPU, but {reason}")
    assert "Traceback" not in job.output and "MPI_Abort" not in job.output, job.output
    assert not (tmp_path / "out.h5").exists() and not list(tmp_path.glob(".*tmp*"))


def test_srun_run_directly(slurm, tmp_path):
    case = sample_case(tmp_path, ["--causal", "--layout", "striped"])
    rc, out, err = slurm.srun(["--mpi=pmix", "-n", "2", RINGMPI, "run", "sample.in.h5", "-o", "sample.out.h5",
                               *case["run"]], cwd=tmp_path, env=job_env())
    assert rc == 0, err
    assert "P=2, layout striped, causal, forward" in out, out
    check_case(case, tmp_path, 2)


def test_srun_bench(slurm, tmp_path):
    rc, out, err = slurm.srun(["--mpi=pmix", "-n", "2", RINGMPI, "bench", "--n", "256", "--heads", "2", "--dim", "16",
                               "--repeat", "1", "--warmup", "0", "--backend", "numpy", "--json", "bench.json"],
                              cwd=tmp_path, env=job_env())
    assert rc == 0, err
    assert out.startswith("ringmpi bench: P=2 N=256") and out.count("ringmpi bench:") == 1, out
    assert "exposed comm" in out and (tmp_path / "bench.json").exists()


def test_training_example_under_sbatch(slurm, tmp_path):
    """jobs/train_context_parallel.py as a batch job (srun --mpi=pmix, 2 tasks): COMPLETED, and its
    losses and parameters equal a one-rank run's to float32 rounding."""
    python = Path(RINGMPI).parent / "python"
    script = ROOT / "jobs" / "train_context_parallel.py"
    args = ["--seq-len", "129", "--steps", "3", "--dim", "16", "--heads", "2", "--kv-heads", "1", "--layers", "1"]
    job = slurm.sbatch(SMALL + ["--wrap", " ".join(["srun", "--mpi=pmix", str(python), str(script), *args,
                                                     "--save", "p2.npz"])], cwd=tmp_path, env=job_env())
    assert (job.state, job.exit_code) == ("COMPLETED", 0), job.output
    rc, out, err, _ = mpirun(1, [python, script, *args, "--save", tmp_path / "p1.npz"], 240)
    assert rc == 0, err
    with np.load(tmp_path / "p2.npz") as two, np.load(tmp_path / "p1.npz") as one:
        assert sorted(two) == sorted(one) and len(one) > 5
        for name in one:
            np.testing.assert_allclose(two[name], one[name], rtol=1e-4, atol=1e-5, err_msg=name)


def test_cluster_stops_without_leftovers(slurm):
    """A second cluster, started and stopped: its daemons are gone, its ports free, its directory removed."""
    root = Path(tempfile.mkdtemp(prefix="ringmpi-slurm-"))
    cluster = slurm_cluster.SlurmCluster(root).start()
    pids = [p.pid for p in cluster.daemons.values()]
    ports = list(cluster.ports.values())
    assert cluster.node_state() == "idle" and len(pids) == 3
    cluster.stop()
    assert not root.exists()
    assert not [pid for pid in pids if Path(f"/proc/{pid}").exists()]
    assert not [port for port in ports if slurm_cluster.port_in_use(port)]
