"""Read the SASS-level CSV that ``tools/device_run.sh ncusrc`` writes (``ncu --page source --csv
--print-source sass``) and print where the warps' stall samples fall: the top SASS lines and the
samples per opcode, for each file given (fa4 and flash-attn-4 side by side).

    python tools/ncu_src_top.py ncusrc_fa4_sass.csv ncusrc_peer_sass.csv [--top 25]

Column names differ between ncu versions; the parser takes the first column whose name contains
"Source" and the first whose name contains "Sampling (All" (falling back to any "Sampling").
"""

from __future__ import annotations

import argparse
import collections
import csv


def _col(header, *needles):
    for n in needles:
        for i, h in enumerate(header):
            if n.lower() in h.lower():
                return i
    raise SystemExit(f"no column with any of {needles} in {header}")


def read(path):
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    start = next(i for i, r in enumerate(rows) if any("Source" in c for c in r))
    header, body = rows[start], rows[start + 1:]
    src, samp = _col(header, "Source"), _col(header, "Sampling (All", "Sampling")
    out = []
    for r in body:
        try:
            n = float(r[samp].replace(",", "") or 0)
        except (ValueError, IndexError):
            continue
        out.append((r[src].strip(), n))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    for path in args.files:
        lines = read(path)
        total = sum(n for _, n in lines) or 1.0
        print(f"== {path}: {len(lines)} SASS lines, {total:.0f} samples")
        by_op = collections.Counter()
        for s, n in lines:
            op = s.split()[1] if s.startswith("@") and len(s.split()) > 1 else (s.split() or ["?"])[0]
            by_op[op.split(".")[0]] += n
        print("  by opcode: " + ", ".join(f"{op} {100 * n / total:.1f}%" for op, n in by_op.most_common(12)))
        idx = sorted(range(len(lines)), key=lambda i: -lines[i][1])[: args.top]
        for i in sorted(idx):
            s, n = lines[i]
            prev = lines[i - 1][0] if i else ""
            print(f"  {100 * n / total:5.1f}%  #{i:<5} {s[:70]:<70} (after: {prev[:40]})")


if __name__ == "__main__":
    main()
