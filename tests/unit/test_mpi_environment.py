"""What ringmpi reads of the launcher and of the MPI library before and beside MPI: the same under
Open MPI and under the MPICH family (issue 52).  The environments are the launchers' own variables
(Open MPI's mpirun, MPICH's Hydra, srun, Cray's PALS); the names are real library strings."""

import os

import pytest

from ringmpi.cli import launcher_rank, mpi_io_across_nodes
from ringmpi.runtime.mpi_library import first_line, implementation

LAUNCHER_VARIABLES = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "PMIX_RANK",
                      "PMI_RANK", "PALS_RANKID", "SLURM_PROCID", "SLURM_STEP_NUM_NODES", "SLURM_NNODES",
                      "OMPI_MCA_io")


@pytest.fixture
def clean_env(monkeypatch):
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize("variables,rank", [
    ({}, None),
    ({"OMPI_COMM_WORLD_RANK": "3", "PMIX_RANK": "3"}, 3),  # Open MPI's mpirun
    ({"PMI_RANK": "2"}, 2),                                # MPICH's Hydra, Intel MPI, MVAPICH
    ({"PALS_RANKID": "5"}, 5),                             # Cray PALS (aprun's successor)
    ({"SLURM_PROCID": "1"}, 1),                            # srun
])
def test_launcher_rank_under_every_launcher(clean_env, variables, rank):
    for name, value in variables.items():
        clean_env.setenv(name, value)
    assert launcher_rank() == rank


@pytest.mark.parametrize("variables,io", [
    ({"OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "PMIX_RANK": "0"}, "^ompio"),
    ({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "PMIX_RANK": "0"}, None),  # one node
    ({"SLURM_NNODES": "2", "PMIX_RANK": "0"}, "^ompio"),     # srun --mpi=pmix: Open MPI's way
    ({"SLURM_NNODES": "2", "PMI_RANK": "0"}, None),          # srun --mpi=pmi2, or Hydra: ROMIO only
    ({"PMI_RANK": "0"}, None),                               # Hydra on one node
])
def test_mpi_io_choice_is_open_mpi_only(clean_env, variables, io):
    for name, value in variables.items():
        clean_env.setenv(name, value)
    mpi_io_across_nodes()
    assert os.environ.get("OMPI_MCA_io") == io


@pytest.mark.parametrize("version,name", [
    ("Open MPI v4.1.4, package: Debian OpenMPI, ident: 4.1.4, repo rev: v4.1.4, May 26, 2022", "Open MPI"),
    ("MPICH Version:\t4.0.2\nMPICH Release date:\tThu May  5 16:46:10 CDT 2022\n", "MPICH"),
    ("Intel(R) MPI Library 2021.10 for Linux* OS\n", "Intel MPI"),
    ("MVAPICH2 Version      :\t2.3.7\nMVAPICH2 Release date :\tWed March 02 22:00:00 EST 2022", "MVAPICH"),
    ("MPI VERSION    : CRAY MPICH version 8.1.25.17 (ANL base 3.4a2)", "Cray MPICH"),
])
def test_implementation_names(version, name):
    assert implementation(first_line(version)) == name
    assert "\n" not in first_line(version) and "\t" not in first_line(version)
