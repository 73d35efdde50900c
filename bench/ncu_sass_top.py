"""Where a kernel's warps stall, by SASS opcode and by instruction, from Nsight Compute's source page.

Run on the GPU machine (the image has ncu; give it ``--clock-control none``):

    ncu --clock-control none -o tiles -k regex:delta_tiles --launch-skip 2 --launch-count 1 \\
        --section SourceCounters --section WarpStateStats \\
        python3 bench/profile_ops.py --rows vera:256:1 --configs default
    ncu --import tiles.ncu-rep --page source --csv --print-source sass > tiles_sass.csv
    python3 bench/ncu_sass_top.py tiles_sass.csv

Prints each opcode's share of the warp-stall samples and its executed count, then the 40 instructions with the
most samples and their stall reasons.
"""

from __future__ import annotations

import collections
import csv
import sys


def _num(v: str) -> float:
    try:
        return float(v.replace(",", ""))
    except ValueError:
        return 0.0


def main(path: str) -> None:
    with open(path) as f:
        rows = list(csv.reader(f))
    at = next(i for i, r in enumerate(rows) if "Source" in r)
    hdr, data = rows[at], [r for r in rows[at + 1:] if len(r) == len(rows[at])]
    src = hdr.index("Source")
    samp = next(i for i, h in enumerate(hdr) if h.startswith("Warp Stall Sampling (All"))
    ex = hdr.index("Instructions Executed")
    total = sum(_num(r[samp]) for r in data) or 1.0
    by_op, executed = collections.Counter(), collections.Counter()
    for r in data:
        words = r[src].split()
        op = (words[1] if words and words[0].startswith("@") and len(words) > 1 else words[0] if words else "?")
        by_op[op.split(".")[0]] += _num(r[samp])
        executed[op.split(".")[0]] += _num(r[ex])
    print(f"total samples {total:.0f}")
    for op, n in by_op.most_common(25):
        print(f"{op:<12} samples {n / total * 100:5.1f}%  executed {executed[op]:.0f}")
    print("--- top instructions")
    stalls = [i for i, h in enumerate(hdr) if h.startswith("stall_") and "Not Issued" not in h]
    for r in sorted(data, key=lambda r: -_num(r[samp]))[:40]:
        why = ", ".join(f"{hdr[i][6:]} {r[i]}" for i in stalls if _num(r[i]) > 0)
        print(f"{_num(r[samp]) / total * 100:5.1f}%  {r[src][:70]:<70}  {why}")


if __name__ == "__main__":
    main(sys.argv[1])
