"""Every code name the docs mention exists: README.md and docs/*.md, read as text.

What counts as a name, in a backticked span (````code```` blocks: their ``ringmpi.*`` names and
repository paths only):

* a chain of identifiers with at least one dot, calls allowed between them
  (`ringmpi.torch.ring_attention`, `AttentionOptions.digest`, `Layout(kind, n, P).indices(rank)`,
  `ring_schedule.HOST_GRADS_IN_PLACE = False`): the first part is a package (`ringmpi`, `numpy` as
  `np`, `mpi4py.MPI` as `MPI`, `torch`, ...), a module of ringmpi named by the tail of its path
  (`masks`, `core.host`, `bench.sdpa`), or a class or function defined at the top of one
  (`Layout`, `AttentionOptions`); the rest are attributes (a dataclass field counts);
* a repository path (`backends/invariant_device.py`, `tests/support/`, `jobs/*.sbatch`, a bare
  `decode.py`), relative to the checkout, `src/`, `src/ringmpi/` or `tests/`, optionally with a
  name defined in it (`tests/support/reference.py: dropout_factors`, `cli/flags.attention_flags`);
* inside any other span (a command, an expression): its `ringmpi.*` chains and its paths under
  the checkout's own folders.

Markdown links are checked too: a relative target exists, and an ``#anchor`` is a heading of
the page it points to.  :data:`NOT_CODE` is the short list of names that are not the project's
code.  The checker is shown to fail on a page of wrong names (``tmp_path``).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import re
import typing
from functools import lru_cache
from pathlib import Path

ROOT = next(d for d in Path(__file__).resolve().parents if (d / "src" / "ringmpi").is_dir())  # the checkout
PACKAGE = ROOT / "src" / "ringmpi"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# what a chain's first part may name outside ringmpi: the packages the docs quote
EXTERNAL = {"np": "numpy", "numpy": "numpy", "MPI": "mpi4py.MPI", "mpi4py": "mpi4py", "torch": "torch",
            "h5py": "h5py", "ml_dtypes": "ml_dtypes", "cupy": "cupy", "os": "os", "time": "time",
            "typing": "typing", "click": "click", "transformers": "transformers"}
# names in backticks that are not code of this project or of a package it imports, with why
NOT_CODE = {
    "mma.sync": "a PTX instruction",
    "out.loss": "a Hugging Face model output's field",
    "out.logits": "a Hugging Face model output's field",
    "sinks.grad": "a torch tensor's gradient (the sinks a caller passes)",
    "config.alibi": "a Hugging Face config's field (the sweep's refusal reasons)",
    "config.attn_config.alibi": "a Hugging Face config's field (the sweep's refusal reasons)",
    "config.layer_types": "a Hugging Face config's field",
    "mpirun.mpich": "Debian's MPICH launcher, a command",
}
REPO_DIRS = ("src", "tests", "jobs", "scripts", "data", "docs", ".ci")
FILE_SUFFIXES = (".py", ".md", ".c", ".h", ".cu", ".cuh", ".sh", ".yml", ".toml", ".h5", ".sbatch", ".png")
SEARCH_ROOTS = (ROOT, ROOT / "src", PACKAGE, ROOT / "tests")

IDENT = r"[A-Za-z_]\w*"
CALL = r"\((?:[^()]|\([^()]*\))*\)"   # one call's arguments, one level of nesting
CHAIN = re.compile(rf"^({IDENT}(?:{CALL})?(?:\.{IDENT}(?:{CALL})?)+)(?:\s*=\s*.+)?$", re.S)
PART = re.compile(rf"({IDENT})({CALL})?")
PATH = re.compile(r"^[\w.\-*]+(?:/[\w.\-*]*)+(?::\s*\w+(?:\(\))?)?$|^[\w\-]+(?:\.\w+)+$")
EMBEDDED_NAME = re.compile(r"(?<![\w./-])ringmpi(?:\.\w+)+")
EMBEDDED_PATH = re.compile(rf"(?<![\w./-])(?:{'|'.join(re.escape(d) for d in REPO_DIRS)})/[\w./*\-]*[\w*/]")
LINK = re.compile(r"\]\(([^)\s]+)\)")


# ------------------------------------------------------------------ reading a page
def spans(text: str):
    """``(kind, text)`` of a page: ``"span"`` for each backticked span, ``"block"`` per code block."""
    found = []
    for match in re.finditer(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M):
        found.append(("block", match.group(1)))
    prose = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.S | re.M)
    for match in re.finditer(r"`([^`]+)`", prose):
        if "\n\n" not in match.group(1):
            found.append(("span", " ".join(match.group(1).split())))
    return found


def names_of(kind: str, span: str) -> list:
    """``(kind, name)`` to check: ``"chain"`` (a dotted name, calls dropped) or ``"path"``."""
    if kind == "span" and span in NOT_CODE:
        return []
    if kind == "span" and PATH.match(span) and is_repo_path(span):
        return [("path", span)]
    if kind == "span" and CHAIN.match(span):
        return [("chain", CHAIN.match(span).group(1))]
    return ([("chain", n) for n in EMBEDDED_NAME.findall(span)]
            + [("path", p) for p in EMBEDDED_PATH.findall(span)])


def is_repo_path(span: str) -> bool:
    """A span PATH matched is the repository's (a file suffix, a trailing /, or its first folder
    exists): ``P/U`` or ``sharedfp/lockedfile`` are not."""
    path = re.split(r":\s*", span)[0]
    if path.endswith("/") or path.endswith(FILE_SUFFIXES) or "*" in path:
        return True
    first = path.split("/")[0]
    return "/" in path and any((root / first).exists() for root in SEARCH_ROOTS)


# ------------------------------------------------------------------ resolving a name
@lru_cache(maxsize=None)
def package_modules() -> tuple:
    """Every module of ringmpi, from its files (``ringmpi.core.masks``, ...), plus the compiled ones."""
    mods = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        mods.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    setup = (ROOT / "setup.py").read_text()
    mods += re.findall(r'Extension\(\s*"([\w.]+)"', setup)
    return tuple(mods)


@lru_cache(maxsize=None)
def top_level_names() -> dict:
    """name -> the ringmpi modules defining it at their top (class, function or assignment)."""
    defined = {}
    for module in package_modules():
        rel = Path(*module.split("."))
        path = PACKAGE.parent / rel.with_suffix(".py")
        path = path if path.exists() else PACKAGE.parent / rel / "__init__.py"
        if not path.exists():
            continue
        for name in defined_names(path):
            defined.setdefault(name, []).append(module)
    return defined


@lru_cache(maxsize=None)
def defined_names(path: Path) -> frozenset:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(t.id for t in ast.walk(target) if isinstance(t, ast.Name))
    return frozenset(names)


def attribute(obj, name: str):
    """``getattr``, or a field a class declares (dataclass, annotation): its declared type when
    that is a class, so ``AgreedCall.place_q.layout`` follows ``place_q: Placement``."""
    if isinstance(obj, type):
        hints = {}
        for cls in reversed(obj.__mro__):
            try:
                hints.update(typing.get_type_hints(cls))
            except Exception:  # an annotation naming what this process cannot import
                hints.update(getattr(cls, "__annotations__", {}))
        if name in hints:
            return hints[name] if isinstance(hints[name], type) else getattr(obj, name, dataclasses.MISSING)
    if hasattr(obj, name):
        return getattr(obj, name)
    raise AttributeError(name)


def follow(obj, parts) -> bool:
    """Whether ``parts`` (``(name, called)`` pairs) are attributes of ``obj`` in turn.  After a call
    of something that is not a class the value is a call's result, which the text cannot know."""
    for name, called in parts:
        try:
            obj = attribute(obj, name)
        except AttributeError:
            return False
        if called and not isinstance(obj, type):
            return True
    return True


def starts(parts):
    """``(object loader, the parts left)`` for each way the first parts may name a start."""
    names = [name for name, _ in parts]
    for module in package_modules():
        pieces = module.split(".")
        for i in range(len(pieces)):
            tail = pieces[i:]
            if names[:len(tail)] == tail:
                yield (lambda m=module: importlib.import_module(m)), parts[len(tail):]
    for module in top_level_names().get(names[0], []):
        yield (lambda m=module: importlib.import_module(m)), parts
    if names[0] in EXTERNAL:
        yield (lambda: importlib.import_module(EXTERNAL[names[0]])), parts[1:]


def chain_exists(chain: str) -> bool:
    parts = [(m.group(1), bool(m.group(2))) for m in PART.finditer(chain)]
    for load, rest in starts(parts):
        try:
            start = load()
        except ImportError:
            continue
        if follow(start, rest):
            return True
    return False


def path_exists(span: str) -> bool:
    path, _, name = (s.strip() for s in re.split(r"(:)", span, maxsplit=1)) if ":" in span else (span, "", "")
    if not path.endswith("/") and "." in path.split("/")[-1] and not path.endswith(FILE_SUFFIXES) and "*" not in path:
        # a module's path then one of its names: cli/flags.attention_flags
        return chain_exists(path.replace("/", "."))
    if "/" not in path.rstrip("/"):
        hits = [p for p in repo_files() if p.name == path.rstrip("/")]
    else:
        hits = [p for root in SEARCH_ROOTS for p in root.glob(path.rstrip("/"))]
    if not hits:
        return False
    name = name.removesuffix("()")
    return not name or any(p.suffix == ".py" and name in defined_names(p) for p in hits)


@lru_cache(maxsize=None)
def repo_files() -> tuple:
    """The checkout's files and folders, build outputs and caches left out."""
    skip = {".git", "build", "__pycache__", ".venv", ".pytest_cache"}
    return tuple(p for p in ROOT.rglob("*") if not skip & set(p.relative_to(ROOT).parts))


# ------------------------------------------------------------------ links
def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(page: Path) -> set:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, flags=re.M)}


def link_problems(page: Path) -> list:
    problems = []
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            problems.append(f"{page.name}: link to {target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{page.name}: link to {target}: no heading with that anchor in {dest.name}")
    return problems


# ------------------------------------------------------------------ the checks
def page_names(page: Path) -> set:
    return {name for kind, span in spans(page.read_text()) for name in names_of(kind, span)}


def problems(pages) -> tuple:
    """(problems, the number of distinct names checked) over ``pages``."""
    found, checked = [], set()
    for page in pages:
        for kind, name in sorted(page_names(page)):
            checked.add((kind, name))
            ok = chain_exists(name) if kind == "chain" else path_exists(name)
            if not ok:
                found.append(f"{page.name}: `{name}` names nothing ({'no such file' if kind == 'path' else 'no such module or attribute'})")
        found += link_problems(page)
    return found, len(checked)


def test_every_name_in_the_docs_exists():
    found, checked = problems(PAGES)
    print(f"{checked} names checked in {len(PAGES)} pages")
    assert checked >= 250, f"only {checked} names found: is the reader still reading the pages?"
    assert not found, "\n".join(found)


def test_not_code_names_are_still_mentioned():
    """An entry of NOT_CODE that no page mentions any more goes."""
    mentioned = {span for page in PAGES for _, span in spans(page.read_text())}
    assert not set(NOT_CODE) - mentioned


def test_the_checker_fails_on_wrong_names(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("\n".join([
        "# A page", "",
        "Good: `ringmpi.ring_attention`, `masks.ScoreSpec`, `AttentionOptions.digest`, `np.exp`,",
        "`Layout(kind, n, P).indices(rank)`, `backends/invariant_device.py`, `decode.py`, `tests/support/`,",
        "`tests/support/mpi_util.py: launch_cache`, `cli/flags.attention_flags`, [a](#a-page).",
        "Bad: `ringmpi.no_such_call`, `io.open_file`, `AttentionOptions.no_such_field`, `backends/gone.py`,",
        "`tests/support/mpi_util.py: no_such_helper`, `core/no_such.helper`, [b](#no-such-heading),",
        "[c](no_such_page.md), and in a command `python -m ringmpi.no_such_module`.",
        "", "```python", "import ringmpi", "ringmpi.no_such_in_a_block(q, k, v)", "```", ""]))
    found, checked = problems([page])
    assert checked == 18
    assert len(found) == 10, "\n".join(found)
    for wrong in ("ringmpi.no_such_call", "io.open_file", "AttentionOptions.no_such_field", "backends/gone.py",
                  "no_such_helper", "core/no_such.helper", "#no-such-heading", "no_such_page.md",
                  "ringmpi.no_such_module", "ringmpi.no_such_in_a_block"):
        assert any(wrong in line for line in found), wrong
