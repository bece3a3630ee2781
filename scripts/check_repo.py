"""Repository checks CI runs next to the linters (``python scripts/check_repo.py``; exit 1 on a
finding):

* results are data: ``bench/results`` holds ``<device>.json`` files and study folders, each with a
  ``README.md`` -- no logs or profiler dumps (``.log``, ``.txt``, ``.ncu-rep``, ``.live``);
* no source line (``amdqb/``, ``hip_src/``) points at a results folder;
* no work-log markers (numbered work periods or runs, device budgets, "what changed ...") in
  tracked text files.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKERS = re.compile(
    r"\bsessions? ?[0-9]|\bcall ?[0-9]+\b|_s[0-9]+/call|device[- ]time|device budget"
    r"|\bbudget_left|what changed (today|on|in)\b",
    re.IGNORECASE,
)
RESULT_PATH = re.compile(r"bench/results/[\w.-]+/")
LOG_SUFFIXES = (".log", ".txt", ".live", ".ncu-rep", ".nsys-rep", ".qdrep")
TEXT_SUFFIXES = (".py", ".md", ".hip", ".h", ".cpp", ".sh", ".toml", ".json", ".cfg", ".txt", "")
SELF = Path(__file__).resolve().relative_to(ROOT).as_posix()


def tracked() -> list[str]:
    out = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    return [line for line in out.splitlines() if line]


def findings(files: list[str]) -> list[str]:
    found = []
    studies = set()
    for name in files:
        if name.startswith("bench/results/"):
            rest = name[len("bench/results/") :]
            if name.endswith(LOG_SUFFIXES):
                found.append(f"{name}: a log or profiler dump under bench/results")
            elif "/" in rest:
                studies.add(rest.split("/", 1)[0])
            elif not rest.endswith(".json"):
                found.append(f"{name}: bench/results holds <device>.json files and study folders")
    for study in sorted(studies):
        if f"bench/results/{study}/README.md" not in files:
            found.append(f"bench/results/{study}/: a study folder needs a README.md")
    for name in files:
        path = ROOT / name
        if name == SELF or not name.endswith(TEXT_SUFFIXES) or not path.is_file():
            continue
        try:
            lines = path.read_text().splitlines()
        except UnicodeDecodeError:
            continue
        source = name.startswith(("amdqb/", "hip_src/"))
        for number, line in enumerate(lines, 1):
            if MARKERS.search(line):
                found.append(f"{name}:{number}: work-log marker: {line.strip()[:100]}")
            if source and RESULT_PATH.search(line):
                found.append(f"{name}:{number}: source points at a results folder")
    return found


def main() -> int:
    problems = findings(tracked())
    for line in problems:
        print(line)
    if problems:
        print(f"{len(problems)} finding(s)", file=sys.stderr)
        return 1
    print("repository checks: clean")
    return 0


if __name__ == "__main__":
    sys.exit(main())
