"""The ``ringmpi`` command line (also ``python -m ringmpi``).

Subcommands are imported only when they run, so ``ringmpi --help`` and
``ringmpi --version`` never initialise MPI or touch a GPU.
"""

from __future__ import annotations

import importlib
import os
import sys

import click

from .. import __version__

THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def one_thread_per_rank() -> None:
    """Default every BLAS/OpenMP pool to one thread: parallelism comes from MPI ranks.

    Takes effect only before NumPy is imported (this module imports none);
    variables the user set are kept.
    """
    for var in THREAD_VARIABLES:
        os.environ.setdefault(var, "1")


def mpi_io_across_nodes() -> None:
    """ROMIO for MPI-IO when Open MPI's ranks span nodes, unless ``OMPI_MCA_io`` is set.

    Open MPI's own MPI-IO (OMPIO) gives every open file a shared file pointer;
    across nodes its ``lockedfile`` component makes ``<file>-<jobid>-<pid>.lock``
    beside the file at open and removes it only at close, so an aborted job
    leaves one beside its input and its output.  HDF5 never uses the shared
    file pointer; ROMIO makes no such file.  Reads the launcher's environment
    (mpirun's world and node-local sizes, Slurm's node count) before MPI starts;
    one node is left as it is.  MPICH and its derivatives (Intel MPI, Cray MPICH,
    MVAPICH) have ROMIO only, so there is nothing to choose under their launchers:
    a PMI rank (``PMI_RANK``: Hydra, or srun's PMI-2) without a PMIx one.
    """
    if "OMPI_MCA_io" in os.environ or ("PMI_RANK" in os.environ and "PMIX_RANK" not in os.environ):
        return
    size, local = (os.environ.get(f"OMPI_COMM_WORLD_{k}SIZE", "") for k in ("", "LOCAL_"))
    nodes = os.environ.get("SLURM_STEP_NUM_NODES") or os.environ.get("SLURM_NNODES") or ""
    if (size.isdigit() and local.isdigit() and int(local) < int(size)) or (nodes.isdigit() and int(nodes) > 1):
        os.environ["OMPI_MCA_io"] = "^ompio"

COMMANDS = {
    "run": ("ringmpi.cli.run", "run", "Attention over an HDF5 file: read shards, run the ring, write outputs."),
    "make-data": ("ringmpi.cli.make_data", "make_data", "Write a reproducible random input file."),
    "verify": ("ringmpi.cli.verify", "verify", "Compare a result file with a float64 dense reference."),
    "bench": ("ringmpi.bench.command", "bench", "Measure the ring: per-step timeline, exposed communication, scaling."),
    "info": ("ringmpi.cli.info", "info", "MPI library, CUDA-aware support, GPUs, parallel HDF5."),
    "plan": ("ringmpi.cli.plan", "plan", "Predict each schedule's time on a described cluster (no MPI, no GPU)."),
}


class LazyGroup(click.Group):
    """A click group whose subcommands live in their own modules, imported on use."""

    def list_commands(self, ctx):
        return sorted(COMMANDS)

    def get_command(self, ctx, name):
        if name not in COMMANDS:
            return None
        module, attr, _ = COMMANDS[name]
        return getattr(importlib.import_module(module), attr)

    def format_commands(self, ctx, formatter):
        rows = [(name, COMMANDS[name][2]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ringmpi")
def cli():
    """Exact ring attention over MPI.

    \b
    Launch under MPI, e.g.
      mpirun -n 4 ringmpi run input.h5 -o out.h5 --causal --backward
    """


def main(argv=None):
    """Console entry point: errors end the whole job, bad input exits 2 on every rank."""
    one_thread_per_rank()
    mpi_io_across_nodes()
    from ..runtime.abort import rank_prefix
    from ..runtime.errors import ConfigError, abort_on_error

    try:
        with abort_on_error():
            rc = _main_or_usage_error(argv)
        if isinstance(rc, click.UsageError):
            _usage_error(rc)
    except ConfigError as exc:
        # raised identically on every rank (after errors.agree): rank 0 speaks, all exit 2
        prefix = rank_prefix()
        if prefix in ("", "[rank 0] "):
            click.echo(f"ringmpi: error: {exc}", err=True)
        sys.exit(2)
    except click.exceptions.Abort:
        click.echo("Aborted!", err=True)
        sys.exit(1)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    # standalone_mode=False hands back ctx.exit(n) codes as the return value
    sys.exit(rc if isinstance(rc, int) else 0)


def _main_or_usage_error(argv):
    """``cli.main``'s result, or the click usage error that stopped it (returned,
    not raised, so that it never reaches the abort path)."""
    try:
        return cli.main(args=argv, prog_name="ringmpi", standalone_mode=False)
    except click.UsageError as exc:
        return exc


def launcher_rank():
    """This process's rank from the launcher's environment, or None when there is no launcher;
    reads the environment only: Open MPI's mpirun, a PMIx launcher (Open MPI 5, srun --mpi=pmix),
    a PMI one (MPICH's Hydra ``mpirun``/``mpiexec``, Intel MPI, MVAPICH, srun --mpi=pmi2), Cray's
    PALS, or srun."""
    import os

    for name in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "PALS_RANKID", "SLURM_PROCID"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return None


def _usage_error(exc) -> None:
    """click's usage message, from rank 0 only; every rank exits 2 (no MPI_Abort).

    Under a launcher the ranks meet in a barrier after rank 0 printed: the
    launcher ends the job at the first non-zero exit, which must not come first.
    """
    rank = launcher_rank()
    if not rank:
        exc.show()
        sys.stderr.flush()
    if rank is not None:
        from mpi4py import MPI

        from ..runtime.watchdog import phase

        with phase("the ranks' exit after a usage error (barrier)"):
            MPI.COMM_WORLD.Barrier()
    sys.exit(exc.exit_code)


if __name__ == "__main__":
    main()
