"""The SASS lines with the most warp-stall samples, per profiled kernel, from the CSV that

    ncu --section WarpStateStats --section SourceCounters --page source --print-source sass --csv

prints (or ``ncu -i REPORT --page source --csv --print-source sass`` of a saved report).
``--mix``: what the kernel executed instead -- its opcode classes' shares of the executed warp
instructions and its longest-running straight-line stretches of SASS -- for short kernels whose
few stall samples rank nothing (a one-block launch of a few microseconds gives tens).

Usage: python scripts/ncu_hotspots.py NCU.csv [--top 25] [--mix]
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


def _count(r, col) -> float:
    try:
        return float(r[col].replace(",", "") or 0)
    except (ValueError, AttributeError):
        return 0.0


def opcode(sass: str) -> str:
    """The opcode class of a SASS line: ``@!P0 IMAD.WIDE.U32 R2, ...`` -> ``IMAD``."""
    words = sass.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else "?"


def mix(rows, src: str, executed: str, top: int) -> list[str]:
    """Report lines: the opcode classes' shares of the executed warp instructions, then the
    stretches of consecutive executed SASS lines with the most executed instructions (a stretch
    ends at a line that never ran)."""
    counts = [_count(r, executed) for r in rows]
    total = sum(counts) or 1.0
    classes: dict[str, float] = {}
    for r, c in zip(rows, counts):
        op = opcode(r[src].strip())
        classes[op] = classes.get(op, 0.0) + c
    ranked = sorted(classes.items(), key=lambda kv: -kv[1])[:top]
    out = ["   " + ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in ranked)]
    stretches, start = [], None
    for i, c in enumerate(counts + [0.0]):
        if c and start is None:
            start = i
        elif not c and start is not None:
            stretches.append((sum(counts[start:i]), start, i))
            start = None
    for n, a, b in sorted(stretches, reverse=True)[: min(top, 10)]:
        first = rows[a][src].strip()
        out.append(
            f"   {100 * n / total:5.1f}%  lines {a}-{b - 1} ({b - a}, each run "
            f"{counts[a]:.0f}x)  {first}"
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("csv")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--mix", action="store_true", help="executed instructions, not stalls")
    args = parser.parse_args()
    text = open(args.csv, errors="replace").read()
    for title, rows in _blocks(text):
        if not rows:
            continue
        cols = list(rows[0])
        src = next((c for c in cols if c.strip() in ("Source", "# Source")), cols[1])
        if args.mix:
            executed = next((c for c in cols if c == "Instructions Executed"), None)
            if executed is None:
                print(f"== {title}: no 'Instructions Executed' column ({cols[:8]})")
                continue
            total = sum(_count(r, executed) for r in rows)
            print(f"== {title}  ({len(rows)} SASS lines, {total:.0f} warp instructions executed)")
            print("\n".join(mix(rows, src, executed, args.top)))
            continue
        samp = next((c for c in cols if c and c.startswith("Warp Stall Sampling (All")), None)
        addr = next((c for c in cols if "Address" in c), cols[0])
        if samp is None:
            print(f"== {title}: no stall-sampling column ({cols[:8]})")
            continue

        def n(r, samp=samp):
            return _count(r, samp)

        total = sum(n(r) for r in rows) or 1.0
        print(f"== {title}  ({len(rows)} SASS lines, {total:.0f} samples)")
        for r in sorted(rows, key=n, reverse=True)[: args.top]:
            print(f"{100 * n(r) / total:5.1f}%  {r[addr]:>8}  {r[src].strip()}")


if __name__ == "__main__":
    main()
