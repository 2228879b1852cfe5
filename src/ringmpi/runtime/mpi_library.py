"""Which MPI library this process runs on: its name, and the library file that each MPI user
(mpi4py, h5py) loaded (``ringmpi info``, the bench's record, and scripts/setup.sh's final check).

Two MPI libraries in one process (mpi4py on one, h5py's parallel HDF5 on another) crash or
misbehave at the first MPI call; the question is answered by asking the libraries themselves:
the file that defines ``MPI_Get_library_version`` (found with ``dlsym`` from a module's handle,
then ``dladdr``), and the name that function returns (callable before ``MPI_Init``).

Also a script, run by scripts/setup.sh with the venv's Python before ringmpi is installed
(standard library and mpi4py only)::

    python src/ringmpi/runtime/mpi_library.py [--library FILE] [--version LINE] MODULE...

imports mpi4py without initialising MPI, then the modules, prints every MPI library mapped into
the process, and exits 1 unless they are one library (that ``FILE`` and ``LINE``, when given).
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Dict, List, Optional

_SYMBOL = "MPI_Get_library_version"
_VERSION_BYTES = 8192  # >= MPI_MAX_LIBRARY_VERSION_STRING of every implementation


def mpi_library() -> str:
    """The MPI library's name and version: the first line of ``MPI_Get_library_version`` (Open MPI
    pads the string with NULs)."""
    from mpi4py import MPI

    return first_line(MPI.Get_library_version())


# an MPICH derivative's name before MPICH's own: Cray MPICH and MVAPICH name MPICH too
_FAMILIES = (("Open MPI", "Open MPI"), ("CRAY MPICH", "Cray MPICH"), ("MVAPICH", "MVAPICH"),
             ("Intel(R) MPI", "Intel MPI"), ("MPICH", "MPICH"))


def implementation(name: Optional[str] = None) -> str:
    """The implementation a library name (default: this process's, :func:`mpi_library`) belongs
    to: ``Open MPI``, ``Cray MPICH``, ``MVAPICH``, ``Intel MPI``, ``MPICH``, else its first word."""
    name = mpi_library() if name is None else name
    for marker, family in _FAMILIES:
        if marker.lower() in name.lower():
            return family
    return (name.split() or ["unknown"])[0]


def first_line(version: str) -> str:
    """The first line of a library version string, NULs and padding removed."""
    lines = version.replace("\x00", "").strip().splitlines()
    return " ".join(lines[0].split()) if lines else ""


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def _defining_file(handle: ctypes.CDLL) -> Optional[str]:
    """The real path of the file that defines the MPI symbol as ``handle``'s scope resolves it
    (the object and its dependencies), or None when none of them defines it."""
    try:
        function = getattr(handle, _SYMBOL)
    except AttributeError:
        return None
    info = _DlInfo()
    libc = ctypes.CDLL(None)
    libc.dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    if not libc.dladdr(ctypes.cast(function, ctypes.c_void_p), ctypes.byref(info)) or not info.dli_fname:
        return None
    return os.path.realpath(os.fsdecode(info.dli_fname))


def _loaded(path: str) -> Optional[ctypes.CDLL]:
    """A handle on ``path`` if it is already loaded (nothing new is loaded), else None."""
    try:
        return ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return None


def library_file(module) -> Optional[str]:
    """The MPI library file that a loaded extension module (``mpi4py.MPI``, ``h5py.defs``: the one that calls HDF5) uses,
    or None when it uses none (or the module is not a shared object)."""
    path = getattr(module, "__file__", None)
    handle = _loaded(path) if path else None
    return None if handle is None else _defining_file(handle)


def library_version(path: str) -> str:
    """The first line of ``MPI_Get_library_version`` of the (loaded) library file ``path``."""
    handle = _loaded(path)
    if handle is None:
        return "not loaded"
    function = getattr(handle, _SYMBOL)
    function.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_int)]
    buffer, length = ctypes.create_string_buffer(_VERSION_BYTES), ctypes.c_int(0)
    if function(buffer, ctypes.byref(length)) != 0:
        return "unknown (MPI_Get_library_version failed)"
    return first_line(buffer.value.decode(errors="replace"))


def mapped_libraries() -> Dict[str, str]:
    """{real path: name and version} of every MPI library mapped into this process: each mapped
    shared object's scope is asked where the MPI symbol is defined (Linux; empty elsewhere)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({fields[5] for fields in (line.split(None, 5) for line in maps)
                            if len(fields) == 6 and ".so" in fields[5]})
    except OSError:
        return {}
    files = set()
    for path in (p.strip() for p in paths):
        handle = _loaded(path)
        found = None if handle is None else _defining_file(handle)
        if found is not None:
            files.add(found)
    return {path: library_version(path) for path in sorted(files)}


def stack_problems(libraries: Dict[str, str], mpi4py_version: str, users: Dict[str, List[str]],
                   library: Optional[str] = None, version: Optional[str] = None) -> List[str]:
    """Why this process's MPI stack is not one library ([] when it is): ``libraries`` from
    :func:`mapped_libraries`, mpi4py's ``Get_library_version`` line, {user: the library files its
    extensions use}, and optionally the library file and version line it must be."""
    problems = []
    listing = "; ".join(f"{path} ({name})" for path, name in libraries.items()) or "none"
    if len(libraries) != 1:
        problems.append(f"{len(libraries)} MPI libraries are mapped into one process: {listing}")
    for user, paths in users.items():
        if not paths:
            problems.append(f"{user} uses no MPI library")
        elif len(paths) > 1 or len(libraries) > 1:
            problems.append(f"{user} uses " + ", ".join(f"{p} ({libraries.get(p, '?')})" for p in paths))
    if version is not None and mpi4py_version != version:
        problems.append(f"mpi4py's MPI.Get_library_version() is {mpi4py_version!r}, expected {version!r}")
    if library is not None and set(libraries) != {os.path.realpath(library)}:
        problems.append(f"expected only {os.path.realpath(library)}; mapped: {listing}")
    return problems


def _extension_files(package: str) -> List[str]:
    """The shared objects of a top-level package's folder, found without importing it."""
    import glob
    import importlib.util

    spec = importlib.util.find_spec(package)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    return sorted(path for folder in folders for path in glob.glob(os.path.join(folder, "*.so")))


def main(argv: List[str]) -> int:
    """The script (see the module's docstring): 0 when the process's MPI stack is one library.

    The packages' extensions are loaded first (the dynamic linker maps the MPI libraries they
    link) without running them, so that a mixed stack is reported, not crashed on; only a
    consistent one is then imported and checked again."""
    import argparse
    import importlib

    parser = argparse.ArgumentParser(description="check that mpi4py and MODULEs load one MPI library")
    parser.add_argument("--library", help="the MPI library file they must load")
    parser.add_argument("--version", help="the first line of MPI_Get_library_version it must report")
    parser.add_argument("modules", nargs="*")
    args = parser.parse_args(argv)
    expected_version = None if args.version is None else " ".join(args.version.split())
    import mpi4py

    mpi4py.rc.initialize = False  # MPI_Get_library_version needs no MPI_Init: no singleton start
    from mpi4py import MPI

    mpi4py_version = first_line(MPI.Get_library_version())
    users = {"mpi4py": [library_file(MPI)] if library_file(MPI) else []}
    for package in dict.fromkeys(name.partition(".")[0] for name in args.modules):
        files = set()
        for path in _extension_files(package):
            found = _defining_file(ctypes.CDLL(path, mode=os.RTLD_LAZY | os.RTLD_LOCAL))
            if found is not None:
                files.add(found)
        if files or package == "h5py":  # h5py must use one (parallel HDF5); ringmpi uses none
            users[package] = sorted(files)
    problems = stack_problems(mapped_libraries(), mpi4py_version, users, args.library, expected_version)
    if not problems:
        for name in args.modules:
            importlib.import_module(name)
    libraries = mapped_libraries()
    problems = problems or stack_problems(libraries, mpi4py_version, users, args.library, expected_version)
    for user, paths in users.items():
        print(f"{user}: {', '.join(paths) or 'no MPI library'}")
    print(f"mpi4py's MPI.Get_library_version(): {mpi4py_version}")
    for path, name in libraries.items():
        print(f"mapped MPI library: {path} ({name})")
    for problem in problems:
        print(f"MISMATCH: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    # run as a file: this folder's modules (errors, env, ...) must not shadow anything imported
    here = os.path.dirname(os.path.realpath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != here]
    sys.exit(main(sys.argv[1:]))
