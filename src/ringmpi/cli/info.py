"""``ringmpi info``: what this job sees: MPI, CUDA-aware support, GPUs, parallel HDF5."""

from __future__ import annotations

import click

from .. import __version__


@click.command("info")
def info():
    """MPI library and version, world size, CUDA-aware MPI, GPUs, h5py/HDF5, default backend.

    Under mpirun rank 0 reports (GPU counts from every rank are gathered).
    """
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    try:
        from ..runtime import device
    except ImportError:
        device = None
    if device is not None:
        gpus = device.gpu_summary()
        aware, why = device.cuda_aware_mpi(comm)
        aware_text = f"{'yes' if aware else 'no'} ({why})"
    else:
        gpus, aware_text = None, "unknown (ringmpi.runtime.device not available)"
    from ..backends import gpu_available
    auto = "cupy" if gpu_available() else "numpy"
    from ..runtime.watchdog import phase
    from ..runtime.mpi_library import implementation, mpi_library

    with phase("ringmpi info: gathering the ranks' GPU counts and hosts (gather)"):
        gpu_counts = comm.gather(None if gpus is None else gpus["count"], root=0)
        hosts = comm.gather(MPI.Get_processor_name(), root=0)
    if rank != 0:
        return
    try:
        import h5py
        h5 = (f"h5py {h5py.__version__}, HDF5 {'.'.join(map(str, h5py.version.hdf5_version_tuple))}, "
              f"parallel {'yes' if h5py.get_config().mpi else 'NO (mpio driver unavailable)'}")
    except Exception as exc:  # a broken h5py should not hide the rest
        h5 = f"unavailable ({exc})"
    import mpi4py
    version = ".".join(map(str, MPI.Get_version()))
    library = mpi_library()
    lines = [
        f"ringmpi {__version__}",
        f"MPI: {implementation(library)} ({library}; MPI standard {version}), mpi4py {mpi4py.__version__}",
        *mpi_library_files(),
        f"world size: {comm.Get_size()} rank(s) on {len(set(hosts))} node(s)",
        f"CUDA-aware MPI: {aware_text}",
    ]
    if gpus is None:
        lines.append("GPUs: unknown (ringmpi.runtime.device not available)")
    else:
        seen = ", ".join(f"{d['id']}: {d['name']} (sm {d['compute_capability']}, {d['memory_gib']} GiB)"
                         for d in gpus["devices"]) or "none"
        lines.append(f"GPUs seen by rank 0: {gpus['count']} [{seen}]"
                     + (f"; {gpus['error']}" if gpus.get("error") else ""))
        if comm.Get_size() > 1:
            lines.append(f"GPUs seen per rank: {gpu_counts}")
        lines.append(f"CuPy: {gpus['cupy'] or 'not installed'}")
    lines += [f"HDF5: {h5}", f"backend 'auto' picks: {auto}", f"CPU vector paths: {cpu_paths()}",
              f"dtypes: {dtype_support()}"]
    click.echo("\n".join(lines))


def mpi_library_files() -> list:
    """The MPI library file that mpi4py and h5py each loaded, and a warning line when they (or
    the libraries mapped into this process) are not one library: two MPIs in one process crash."""
    from mpi4py import MPI

    from ..runtime.mpi_library import library_file, mapped_libraries

    users = {"mpi4py": library_file(MPI)}
    try:
        import h5py.defs
        users["h5py"] = library_file(h5py.defs)
    except Exception:  # noqa: BLE001 - reported on the HDF5 line
        pass
    mapped = mapped_libraries()
    lines = ["MPI library files: " + ", ".join(f"{user} loaded {path or 'none'}" for user, path in users.items())]
    if len(set(users.values())) > 1 or len(mapped) > 1:
        listing = "; ".join(f"{path} ({name})" for path, name in mapped.items())
        lines.append(f"WARNING: mpi4py and h5py do not load one MPI library (mapped: {listing}); "
                     "rebuild the venv with scripts/setup.sh and MPICC naming the MPI you run")
    return lines


def cpu_paths() -> str:
    """The vector path of each compiled CPU loop (``RINGMPI_CPU_VECTOR`` pins both), or NumPy's."""
    from ..backends import fixed_sums, tile_pass

    paths = tile_pass.vector_paths()
    tile = tile_pass.vector_path() or "numpy (not built, or RINGMPI_CPU_KERNEL=numpy)"
    fixed = fixed_sums.vector_path() or "numpy"
    runs = f" (this CPU runs {', '.join(paths)})" if paths else ""
    return f"tile pass {tile}, fixed-point sums {fixed}{runs}"


def dtype_support() -> str:
    """The dtypes this installation computes with (bfloat16 through ml_dtypes)."""
    try:
        import ml_dtypes
    except ImportError as exc:
        return f"float16, float32, float64; bfloat16 unavailable ({exc})"
    return (f"float16, bfloat16 (ml_dtypes {ml_dtypes.__version__}, NumPy and CuPy arrays; "
            f"HDF5 as uint16 with attribute dtype=\"bfloat16\"), float32, float64")
