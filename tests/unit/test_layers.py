"""The import layers of src/ringmpi, read from the source: no module imports a higher layer.

Every ``import`` / ``from ... import`` of a module counts, at module level and inside
functions alike (an import deferred to a function is still a dependency).  A name
imported from the package root counts as an import of the module that defines it
(``ringmpi._PUBLIC``, ``ringmpi._MODULES``, read from ``__init__.py``).  The checks:

* a module imports only its own layer or lower ones (:data:`LAYERS`, lowest first);
* no import cycle between modules;
* ``core/`` imports neither MPI, HDF5 nor a GPU array library;
* no private name (a leading underscore) is imported from another module, in the
  package or in the tests (modules named with an underscore, such as the compiled
  ``_ext._fused``, are modules, not names).

Each check is shown to fail on a small tree built to break it (``tmp_path``).
docs/design.md's layer table is this one.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = next(d for d in Path(__file__).resolve().parents if (d / "src" / "ringmpi").is_dir())  # the checkout
PACKAGE = ROOT / "src" / "ringmpi"
TESTS = ROOT / "tests"

# lowest first: a module may import modules of its own layer and of the layers before it
LAYERS = (
    ("package root", ("ringmpi",)),  # __version__ and lazy public names (counted as their modules)
    ("runtime", ("ringmpi.runtime",)),  # errors, abort, watchdog, faults, env, GPU binding: the process
    ("core", ("ringmpi.core",)),  # pure math: dtypes, masks, modifiers, dropout, layouts, softmax state
    ("options", ("ringmpi.options", "ringmpi.context")),  # one call's options, the mask spec they imply;
    # where and how calls run (RingContext) and what they return
    ("block ops", ("ringmpi.kernels", "ringmpi._ext")),  # CUDA sources and their loader; the compiled CPU pass
    ("backends", ("ringmpi.backends",)),  # the block-op interface and its NumPy and CuPy backends
    ("parallel", ("ringmpi.parallel",)),  # communicators, topology, the ring, its schedule and passes
    ("public calls", ("ringmpi.attention", "ringmpi.decode", "ringmpi.kvcache", "ringmpi.linear_attention",
                      "ringmpi.causal_conv", "ringmpi.relayout")),
    ("file job and bridges", ("ringmpi.filejob", "ringmpi.torch", "ringmpi.transformers", "ringmpi.transformers_models",
                              "ringmpi.torch_distributed", "ringmpi.torch_linear")),
    ("commands", ("ringmpi.cli", "ringmpi.bench", "ringmpi.__main__")),
)
CORE_FORBIDDEN = ("mpi4py", "h5py", "cupy")


# ------------------------------------------------------------------ reading the source
def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def extension_modules(root: Path) -> set:
    """The compiled modules ``setup.py`` beside ``src/`` declares (``Extension("ringmpi._ext._fused", ...)``)."""
    setup = root.parent.parent / "setup.py"
    return set(re.findall(r'Extension\(\s*"([\w.]+)"', setup.read_text())) if setup.exists() else set()


def root_aliases(root: Path) -> dict:
    """Names of the package root that stand for other modules: ``_PUBLIC`` (name -> module) and
    ``_MODULES`` (documented module path -> real module), as ``__init__.py`` states them."""
    aliases = {}
    init = root / "__init__.py"
    for node in ast.parse(init.read_text()).body if init.exists() else ():
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id == "_PUBLIC":
                aliases.update({name: f"{root.name}.{mod}" for name, mod in ast.literal_eval(node.value).items()})
            elif node.targets[0].id == "_MODULES":
                aliases.update(ast.literal_eval(node.value))
    return aliases


class Source:
    """The modules of a package directory and every import they make."""

    def __init__(self, root: Path):
        self.root = root
        self.paths = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
        self.modules = set(self.paths) | extension_modules(root)
        self.aliases = root_aliases(root)
        self.edges = []     # (importer, imported module, line)
        self.names = []     # (importer, module, name, line): a name (not a module) imported from a module
        self.external = []  # (importer, top-level package, line)
        for module, path in self.paths.items():
            self._read(module, path)

    def _resolve(self, target: str) -> str:
        return self.aliases.get(target, target)

    def _read(self, module: str, path: Path) -> None:
        tree = ast.parse(path.read_text(), filename=str(path))
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        top = self.root.name
        binds_root = False
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == top:
                        self.edges.append((module, self._resolve(alias.name), node.lineno))
                        binds_root |= alias.name == top and alias.asname is None
                    else:
                        self.external.append((module, alias.name.split(".")[0], node.lineno))
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module
                if target.split(".")[0] != top:
                    self.external.append((module, target.split(".")[0], node.lineno))
                    continue
                target = self._resolve(target)
                for alias in node.names:
                    full = f"{target}.{alias.name}"
                    if full in self.modules:
                        self.edges.append((module, full, node.lineno))
                    elif target == top and alias.name in self.aliases:
                        self.edges.append((module, self.aliases[alias.name], node.lineno))
                    else:
                        self.edges.append((module, target, node.lineno))
                        self.names.append((module, target, alias.name, node.lineno))
        if binds_root:  # ``import ringmpi`` then ``ringmpi.ring_attention(...)``
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                        and node.value.id == top and node.attr in self.aliases:
                    self.edges.append((module, self.aliases[node.attr], node.lineno))


def layer_of(module: str):
    """``(index, name)`` of the layer holding ``module`` (the longest matching prefix), or None."""
    best = None
    for index, (name, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            inside = module == prefix or (prefix != "ringmpi" and module.startswith(prefix + "."))
            if inside and (best is None or len(prefix) > best[2]):
                best = (index, name, len(prefix))
    return None if best is None else best[:2]


# ------------------------------------------------------------------ the checks
def layer_problems(src: Source) -> list:
    problems = [f"{m}: in no layer of LAYERS (add it)" for m in sorted(src.paths) if layer_of(m) is None]
    for importer, imported, line in src.edges:
        mine, theirs = layer_of(importer), layer_of(imported)
        if mine and theirs and theirs[0] > mine[0]:
            problems.append(f"{importer}:{line} imports {imported}: layer '{mine[1]}' imports the higher "
                            f"layer '{theirs[1]}'")
    return problems


def cycles(src: Source) -> list:
    """The import cycles between modules: each strongly connected component of more than one
    module (Tarjan), as a sorted list of its modules."""
    graph = {m: set() for m in src.paths}
    for importer, imported, _ in src.edges:
        if imported in graph and imported != importer:
            graph[importer].add(imported)
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def core_problems(src: Source) -> list:
    return [f"{m}:{line} imports {pkg}: core/ is pure math (no MPI, no HDF5, no GPU arrays)"
            for m, pkg, line in src.external if layer_of(m) and layer_of(m)[1] == "core" and pkg in CORE_FORBIDDEN]


def private_problems(src: Source) -> list:
    return [f"{m}:{line} imports the private name {name} from {target}" for m, target, name, line in src.names
            if name.startswith("_") and not name.startswith("__") and target != m]


def test_layer_table_is_ordered_and_disjoint():
    prefixes = [p for _, ps in LAYERS for p in ps]
    assert len(prefixes) == len(set(prefixes))
    assert layer_of("ringmpi") == (0, "package root") and layer_of("ringmpi.cli.run")[1] == "commands"
    assert layer_of("ringmpi.core.masks")[1] == "core" and layer_of("ringmpi.corex") is None


# ------------------------------------------------------------------ the package itself
@pytest.fixture(scope="module")
def package():
    return Source(PACKAGE)


def test_every_module_sits_in_a_layer_and_imports_only_its_own_or_lower(package):
    assert layer_problems(package) == []


def test_no_import_cycle(package):
    assert cycles(package) == []


def test_core_does_no_mpi_io_or_gpu(package):
    assert core_problems(package) == []


def test_no_private_name_is_imported_across_modules(package):
    assert private_problems(package) == []


def test_the_tests_import_no_private_name_of_the_package_or_of_each_other():
    """The tests use what the package (and each other's helpers) make public."""
    local = {p.stem for p in TESTS.rglob("*.py")}
    modules = Source(PACKAGE).modules
    problems = []
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
                continue
            top = node.module.split(".")[0]
            if top != "ringmpi" and node.module.split(".")[-1] not in local:
                continue
            for alias in node.names:
                name = alias.name
                if name.startswith("_") and not name.startswith("__") and f"{node.module}.{name}" not in modules:
                    problems.append(f"{path.relative_to(TESTS)}:{node.lineno} imports {name} from {node.module}")
    assert problems == []


def test_the_reading_sees_function_level_imports_and_root_names(package):
    """What the checks stand on: imports inside functions, names of the package root, the
    compiled extension as a module."""
    edges = {(a, b) for a, b, _ in package.edges}
    assert ("ringmpi.filejob.job", "ringmpi.attention") in edges  # ``from .. import ring_attention`` in a function
    assert ("ringmpi.torch", "ringmpi.attention") in edges        # ``ringmpi.ring_attention(...)``
    assert ("ringmpi.backends", "ringmpi.backends.numpy_backend") in edges  # inside get_backend
    assert ("ringmpi.backends.tile_pass", "ringmpi._ext._fused") in edges  # setup.py's extension


# ------------------------------------------------------------------ the checks fail where they should
CLEAN = {
    "__init__.py": '_PUBLIC = {"ring_attention": "attention"}\n__version__ = "0"\n',
    "runtime/__init__.py": "",
    "runtime/errors.py": "class ConfigError(ValueError):\n    pass\n",
    "core/__init__.py": "",
    "core/masks.py": "import numpy as np\nfrom ..runtime.errors import ConfigError\n",
    "parallel/__init__.py": "",
    "parallel/ring.py": "from ..core.masks import np\n",
    "attention.py": "from .parallel.ring import np\n\ndef ring_attention():\n    pass\n",
    "cli/__init__.py": "def main():\n    from .. import ring_attention, __version__\n",
}
VIOLATIONS = {
    "upward": ({"core/extra.py": "import numpy as np\n\ndef f():\n    from ..parallel import ring\n"},
               layer_problems, ["ringmpi.core.extra:4 imports ringmpi.parallel.ring: layer 'core' imports the "
                                "higher layer 'parallel'"]),
    "upward through the root": ({"parallel/extra.py": "def f():\n    from .. import ring_attention\n"},
                                layer_problems, ["ringmpi.parallel.extra:2 imports ringmpi.attention: layer "
                                                 "'parallel' imports the higher layer 'public calls'"]),
    "no layer": ({"misc.py": ""}, layer_problems, ["ringmpi.misc: in no layer of LAYERS (add it)"]),
    "cycle": ({"parallel/ring.py": "from .schedule import x\n",
               "parallel/schedule.py": "x = 1\n\ndef f():\n    from .ring import x\n"},
              cycles, [["ringmpi.parallel.ring", "ringmpi.parallel.schedule"]]),
    "mpi in core": ({"core/masks.py": "def f():\n    from mpi4py import MPI\n"},
                    core_problems, ["ringmpi.core.masks:2 imports mpi4py: core/ is pure math (no MPI, no HDF5, "
                                    "no GPU arrays)"]),
    "h5py in core": ({"core/io.py": "import h5py.h5s\n"},
                     core_problems, ["ringmpi.core.io:1 imports h5py: core/ is pure math (no MPI, no HDF5, "
                                     "no GPU arrays)"]),
    "private name": ({"runtime/errors.py": "def _prefix():\n    pass\n",
                      "cli/__init__.py": "def main():\n    from ..runtime.errors import _prefix\n"},
                     private_problems, ["ringmpi.cli:2 imports the private name _prefix from ringmpi.runtime.errors"]),
}


def build(tree: Path, files: dict) -> Source:
    for name, text in files.items():
        path = tree / "ringmpi" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return Source(tree / "ringmpi")


def test_a_clean_tree_passes_every_check(tmp_path):
    src = build(tmp_path, CLEAN)
    assert (layer_problems(src), cycles(src), core_problems(src), private_problems(src)) == ([], [], [], [])


@pytest.mark.parametrize("kind", sorted(VIOLATIONS))
def test_each_check_fails_on_its_violation(tmp_path, kind):
    changes, check, want = VIOLATIONS[kind]
    src = build(tmp_path, {**CLEAN, **changes})
    assert check(src) == want
    others = [c for c in (layer_problems, cycles, core_problems, private_problems) if c is not check]
    assert all(c(src) == [] for c in others), [c(src) for c in others]
