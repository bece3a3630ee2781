"""The SASS lines with the most warp-stall samples, per profiled kernel, from the CSV that

    ncu --section WarpStateStats --section SourceCounters --page source --print-source sass --csv

prints. Usage: python scripts/ncu_hotspots.py NCU.csv [--top 25]
"""

from __future__ import annotations

import argparse
import csv
import io


def _blocks(text: str):
    """(kernel, rows) per profiled launch: ncu opens each launch's table with a
    ``"Kernel Name","<name>"`` line, then the header line."""
    title, lines = None, []
    for line in text.splitlines():
        if line.startswith('"Kernel Name"'):
            if title is not None:
                yield title, list(csv.DictReader(io.StringIO("\n".join(lines))))
            title, lines = line.split(",")[1].strip('"'), []
        elif title is not None:
            lines.append(line)
    if title is not None:
        yield title, list(csv.DictReader(io.StringIO("\n".join(lines))))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("csv")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    text = open(args.csv, errors="replace").read()
    for title, rows in _blocks(text):
        if not rows:
            continue
        cols = list(rows[0])
        samp = next((c for c in cols if c and c.startswith("Warp Stall Sampling (All")), None)
        src = next((c for c in cols if c.strip() in ("Source", "# Source")), cols[1])
        addr = next((c for c in cols if "Address" in c), cols[0])
        if samp is None:
            print(f"== {title}: no stall-sampling column ({cols[:8]})")
            continue

        def n(r, samp=samp):
            try:
                return float(r[samp].replace(",", "") or 0)
            except ValueError:
                return 0.0

        total = sum(n(r) for r in rows) or 1.0
        print(f"== {title}  ({len(rows)} SASS lines, {total:.0f} samples)")
        for r in sorted(rows, key=n, reverse=True)[: args.top]:
            print(f"{100 * n(r) / total:5.1f}%  {r[addr]:>8}  {r[src].strip()}")


if __name__ == "__main__":
    main()
