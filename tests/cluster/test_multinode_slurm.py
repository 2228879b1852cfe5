"""A multi-node Slurm on the namespace cluster: ``slurmctld`` on h1, one ``slurmd`` per host
(entered into the host's namespaces: its network, hostname and own ``/tmp``, which pmix's
per-job directories need), ``munged`` shared.  The batch script on two nodes, ``srun --mpi=pmix
-N2`` of ``run`` and ``bench``.  Skipped where Slurm cannot be installed or the cluster built."""

import json
import re
import subprocess

import pytest

import slurm_cluster
from cli_util import RINGMPI
from mpi_util import ROOT

pytestmark = [pytest.mark.mpi, pytest.mark.slurm]

CPU_JOB = ROOT / "jobs" / "slurm-cpu.sbatch"


@pytest.fixture(scope="module")
def slurm_hosts(netns):
    slurm_cluster.require_installed()
    cluster = slurm_cluster.SlurmCluster(netns.root / "slurm", cpus=2, hosts=netns)
    cluster.start()
    where = netns.shared / "slurm"
    where.mkdir(exist_ok=True)
    make = subprocess.run([RINGMPI, "make-data", "in.h5", "--n", "333", "--heads", "4", "--kv-heads", "2",
                           "--dim", "16", "--with-do"], cwd=where, capture_output=True, text=True, timeout=120)
    assert make.returncode == 0, make.stderr
    try:
        yield cluster, where
    finally:
        cluster.stop()


def job_env(netns):
    env = netns.mpi_env()
    env.pop("OMPI_MCA_plm_rsh_agent")  # Slurm launches the ranks
    return env


def verified(where, output):
    proc = subprocess.run([RINGMPI, "verify", "in.h5", output], cwd=where, capture_output=True, text=True,
                          timeout=300)
    return proc.returncode == 0, proc.stdout + proc.stderr


def test_batch_script_on_two_nodes(netns, slurm_hosts):
    cluster, where = slurm_hosts
    job = cluster.sbatch(["--nodes=2", "--ntasks-per-node=2", CPU_JOB, "in.h5", "batch.h5", "--causal",
                          "--backward"], cwd=where, env=job_env(netns), timeout=300)
    assert (job.state, job.exit_code) == ("COMPLETED", 0), job.output
    assert "P=4, layout zigzag, causal, forward+backward" in job.output, job.output
    assert job.fields.get("NumNodes") == "2" and job.fields.get("NodeList") == "h[1-2]", job.fields
    ok, text = verified(where, "batch.h5")
    assert ok, text
    assert not list(where.glob("*.lock"))


def test_srun_run_and_bench_on_two_nodes(netns, slurm_hosts):
    cluster, where = slurm_hosts
    rc, out, err = cluster.srun(["--mpi=pmix", "-N2", "-n4", RINGMPI, "run", "in.h5", "-o", "srun.h5", "--backward",
                                 "--head-parallel", "auto"], cwd=where, env=job_env(netns), timeout=300)
    assert rc == 0, err[-3000:]
    assert "(chosen by head_parallel auto: " in out, out  # U by predicted cost (issue 53)
    ok, text = verified(where, "srun.h5")
    assert ok, text
    rc, out, err = cluster.srun(["--mpi=pmix", "-N2", "-n4", RINGMPI, "bench", "--n", "128", "--heads", "4",
                                 "--dim", "16", "--repeat", "1", "--warmup", "0", "--backend", "numpy",
                                 "--head-parallel", "auto", "--json", "bench.json"], cwd=where,
                                env=job_env(netns), timeout=300)
    assert rc == 0, err[-3000:]
    assert re.search(r"head_parallel auto \(U=[12]\)", out.splitlines()[0]), out
    hosts = json.loads((where / "bench.json").read_text())["environment"]["ranks_per_host"]
    assert hosts == {"h1": 2, "h2": 2}, hosts
