"""Write the README's table of Hugging Face architectures under ringmpi.transformers, from the sweep.

    python scripts/transformers_table.py                 # runs the sweep at P = 2 (about 3 minutes)
    python scripts/transformers_table.py results.json    # the same, keeping the records (read if present)

The sweep is ``tests/mpi/transformers_sweep_cases.py`` (what
``tests/mpi/test_transformers_sweep.py`` runs): every decoder-only causal LM of
the installed transformers, exact against one process or refused by name.  The
table replaces what lies between the README's ``transformers-sweep`` markers.
"""

import collections
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))
BEGIN, END = "<!-- transformers-sweep:begin -->", "<!-- transformers-sweep:end -->"
ORDER = ("exact", "refused", "refused at its first attention", "not buildable", "FAIL", "WRONG")


def run_sweep(where: Path) -> list:
    import hf_architectures
    from mpi_util import mpirun_env

    cases = [dict(id=t, type=t) for t in hf_architectures.decoder_types()]
    cases += [dict(id=name, **spec) for name, spec in hf_architectures.VARIANTS.items()]
    (where / "cases.json").write_text(json.dumps(cases))
    cmd = ["mpirun", "-n", "2", "--oversubscribe", sys.executable,
           str(ROOT / "tests" / "mpi" / "transformers_sweep_cases.py"), str(where / "cases.json"),
           str(where / "results.json")]
    subprocess.run(cmd, check=True, env=mpirun_env(), stdout=subprocess.DEVNULL)
    return json.loads((where / "results.json").read_text())


def reason(record) -> str:
    """What a refusal found, in a few words (the message itself names every module)."""
    detail = record["detail"]
    classes = ", ".join(dict.fromkeys(re.findall(r"\((\w+)(?:, kernel \d+)?\)", detail)))
    rules = ((r"has (\S+) layers", lambda m: f"`{m.group(1)}` layers"),
             (r"own ALiBi position bias \((\S+)\)", lambda m: f"its own ALiBi (`{m.group(1)}`)"),
             (r"computes its scores itself", lambda m: f"attention that computes its own scores ({classes})"),
             (r"contains an? (.+?) sequence mixer", lambda m: f"{m.group(1)} sequence mixer ({classes})"),
             (r"computes its loss itself", lambda m: "its own loss with labels (logits are exact)"),
             (r"transformers refuses (.*)", lambda m: f"transformers refuses {m.group(1)}"),
             (r"mask or bias tensor of its own making", lambda m: "an attention mask or bias of its own"))
    for pattern, say in rules:
        found = re.search(pattern, detail)
        if found:
            return say(found)
    return detail


def table(records: list) -> str:
    import transformers

    by = collections.defaultdict(list)
    for r in records:
        r["arch"] = r.get("detail", "").split(" ", 1)[0].split("'")[0]
        by[r["status"]].append(r)
    counts = ", ".join(f"{len(by[s])} {s}" for s in ORDER if by[s])
    lines = [f"transformers {transformers.__version__}, {len(records)} cases at P = 2 "
             f"(contiguous, zigzag, balanced): {counts}.", "",
             "| status | architectures |", "|---|---|"]
    if by["exact"]:
        lines.append("| exact | " + ", ".join(r["id"] for r in by["exact"]) + " |")
    for status in ORDER[1:]:
        groups = collections.defaultdict(list)
        for r in by[status]:
            groups[reason(r) if status != "not buildable" else r["detail"].split(":")[0]].append(r["id"])
        for why, ids in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
            lines.append(f"| {status}: {why.replace('|', '/')} | {', '.join(ids)} |")
    return "\n".join(lines)


def main():
    saved = Path(sys.argv[1]) if len(sys.argv) > 1 else None
    if saved is not None and saved.exists():
        records = json.loads(saved.read_text())
    else:
        with tempfile.TemporaryDirectory() as where:
            records = run_sweep(Path(where))
        if saved is not None:
            saved.write_text(json.dumps(records, indent=1))
    readme = ROOT / "README.md"
    text = readme.read_text()
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    readme.write_text(f"{head}{BEGIN}\n{table(records)}\n{END}{tail}")
    print(f"README.md: {len(records)} architectures")


if __name__ == "__main__":
    main()
