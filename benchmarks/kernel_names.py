"""Kernel names from real records, with the class trials/measure/kernels.py gives each: the fixture's source.

Reads the ``kernel_table`` of every record under the given result directories (sweeps run on a GPU)
and prints one line per distinct kernel name: class, ms per step summed over the records, the name.
With ``--write FILE``, writes ``{name: class}`` for review: a wrong class is corrected by changing a
rule in trials/measure/kernels.py, never by editing the file (tests/test_why.py checks every name against it).
Usage: python benchmarks/kernel_names.py DIR [DIR ...] [--write tests/fixtures/h200_kernels.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from orchestrator.store import read_results
from trials.measure.kernels import classify


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("dirs", nargs="+")
    parser.add_argument("--write", type=Path)
    args = parser.parse_args()
    seen: dict[str, float] = {}
    for d in args.dirs:
        for table in read_results(d).column("kernel_table").to_pylist():
            for k in json.loads(table or "[]"):
                seen[k["name"]] = seen.get(k["name"], 0.0) + k["ms"]
    for name, ms in sorted(seen.items(), key=lambda kv: -kv[1]):
        print(f"{classify(name):12s} {ms:9.3f}  {name[:140]}")
    if args.write:
        args.write.write_text(json.dumps({n: classify(n) for n in sorted(seen)}, indent=1) + "\n")
        print(f"{len(seen)} names -> {args.write}")


if __name__ == "__main__":
    main()
