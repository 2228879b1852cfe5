"""Every call of src/ringmpi that blocks on peers runs under the watchdog, read from the source.

A blocking collective (mpi4py's ``allgather``, ``Allreduce``, ``bcast``, ``Barrier``,
``Split``, ``Dup``, ..., torch.distributed's rendezvous and ``new_group``) must sit
lexically inside ``with phase(...)`` / ``with watchdog.phase(...)``, or in a function
of :data:`CALLED_IN_A_PHASE` (every caller enters it inside a phase), or in a place of
:data:`NOT_WATCHED` with the reason a deadline does not belong there.  Nonblocking
calls (``Isend``, ``Ialltoallv``, ``Ibarrier``) are waited for by polling loops with
their own deadline (``ring.poll_until``), not here.  docs/design.md: "a new
collective call goes inside a phase".
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = next(d for d in Path(__file__).resolve().parents if (d / "src" / "ringmpi").is_dir()) / "src" / "ringmpi"

BLOCKING = {
    # mpi4py, pickle-based and buffer-based
    "allgather", "allreduce", "alltoall", "barrier", "bcast", "gather", "scatter", "scan", "exscan",
    "Allgather", "Allgatherv", "Allreduce", "Alltoall", "Alltoallv", "Barrier", "Bcast", "Gather",
    "Gatherv", "Reduce", "Reduce_scatter", "Scatter", "Scatterv", "Scan", "Exscan",
    # communicators (collective over the parent)
    "Dup", "Split", "Split_type", "Create_group",
    # torch.distributed
    "init_process_group", "new_group",
}
ARRAY_MODULES = {"np", "numpy", "xp", "cupy", "torch"}  # np.maximum.reduce and the like are not MPI
CALLED_IN_A_PHASE = {
    ("ringmpi.runtime.watchdog", "sync"): "runs just before a collective HDF5 call, inside its phase",
    ("ringmpi.filejob.hdf5", "ShardIO._pieces"): "called by ShardIO._read/_write, inside read/write's phase",
    ("ringmpi.filejob.hdf5", "ShardIO._read"): "called by ShardIO.read inside its phase",
    ("ringmpi.filejob.hdf5", "ShardIO._write"): "called by ShardIO.write inside its phase",
    ("ringmpi.parallel.cost_measure", "_minimal_call_seconds"): "called by call_costs inside its phase",
    ("ringmpi.parallel.cost_measure", "_receive_times"): "called by _exchange_seconds and _pairs_link, which links calls inside its phases",
    ("ringmpi.parallel.cost_measure", "_pairs_link"): "called by links inside its phase",
}
NOT_WATCHED = {
    ("ringmpi.cli.verify", "_check_whole_on_rank_0"): "the ranks wait in this bcast for as long as rank 0's dense reference "
                                      "takes: a deadline would bound that compute, not a collective",
    ("ringmpi.bench", None): "idle ranks wait in bench's barriers while the others measure, for as long "
                             "as that takes; the measured calls themselves run under the watchdog",
}


def _parents(tree):
    parent = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parent[child] = node
    return parent


def _is_phase(item: ast.withitem) -> bool:
    call = item.context_expr
    if not isinstance(call, ast.Call):
        return False
    func = call.func
    return (isinstance(func, ast.Name) and func.id == "phase") or \
        (isinstance(func, ast.Attribute) and func.attr == "phase")


def unwatched(root: Path) -> list:
    """``(module, function qualname, line, method)`` of every blocking call outside a phase and
    outside :data:`CALLED_IN_A_PHASE` / :data:`NOT_WATCHED`."""
    found = []
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        tree = ast.parse(path.read_text(), filename=str(path))
        parent = _parents(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in BLOCKING):
                continue
            receiver = node.func.value
            while isinstance(receiver, ast.Attribute):
                receiver = receiver.value
            if isinstance(receiver, ast.Name) and receiver.id in ARRAY_MODULES:
                continue
            watched, names, up = False, [], parent.get(node)
            while up is not None:
                if isinstance(up, (ast.With, ast.AsyncWith)) and any(_is_phase(i) for i in up.items):
                    watched = True
                if isinstance(up, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.append(up.name)
                up = parent.get(up)
            qualname = ".".join(reversed(names))
            if watched or (module, qualname) in CALLED_IN_A_PHASE or (module, qualname) in NOT_WATCHED \
                    or any(m is not None and q is None and (module == m or module.startswith(m + "."))
                           for m, q in NOT_WATCHED):
                continue
            found.append((module, qualname, node.lineno, node.func.attr))
    return found


def test_every_blocking_call_runs_in_a_watchdog_phase():
    assert unwatched(PACKAGE) == []


def test_the_exceptions_still_exist():
    """Each entry of the tables names a function that holds a blocking call (else delete it)."""
    everything = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef):
                        everything.add((module, f"{node.name}.{item.name}"))
            elif isinstance(node, ast.FunctionDef):
                everything.add((module, node.name))
    for key in list(CALLED_IN_A_PHASE) + [k for k in NOT_WATCHED if k[1] is not None]:
        assert key in everything, key


@pytest.mark.parametrize("body,want", [
    ("def f(comm):\n    return comm.allgather(1)\n", [("ringmpi.m", "f", 2, "allgather")]),
    ("class C:\n    def g(self):\n        from mpi4py import MPI\n        MPI.COMM_WORLD.Barrier()\n",
     [("ringmpi.m", "C.g", 4, "Barrier")]),
    ("def f(comm):\n    with phase('x'):\n        comm.Allreduce(a, b)\n    return comm.Dup()\n",
     [("ringmpi.m", "f", 4, "Dup")]),
    ("def f(comm):\n    with watchdog.phase('x'), open('y'):\n        return comm.bcast(1)\n", []),
    ("import numpy as np\nx = np.maximum.reduce([1])\n", []),
])
def test_the_reading_finds_calls_outside_a_phase(tmp_path, body, want):
    (tmp_path / "ringmpi").mkdir()
    (tmp_path / "ringmpi" / "m.py").write_text(body)
    assert unwatched(tmp_path / "ringmpi") == want
