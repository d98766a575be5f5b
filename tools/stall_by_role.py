"""Where the sm90 GEMM's consumer warps wait: ncu warp-stall samples of the k-loop, by opcode.

``python tools/stall_by_role.py source_sass.csv`` reads the CSV that `tools/gpu_ncu_source.sh`
exports (``ncu --page source --print-source sass --csv``: one row per SASS instruction with its
sampled stall reasons; one block per profiled kernel). For each kernel it finds the consumer
k-loop (the innermost backward branch whose body holds a QGMMA, as `tools/sass_mix.py` does on
the CPU) and prints, per opcode, the share of the loop's samples and the top stall reasons.
Samples no listed reason accounts for (ncu exports no GMMA-issue reason) are shown as
``unlisted``.
"""

from __future__ import annotations

import argparse
import csv
import re
from collections import Counter, defaultdict

SAMPLES = "Warp Stall Sampling (All Samples)"
BRA = re.compile(r"\bBRA\s+(0x[0-9a-f]+)")


def kernels(path: str):
    """(kernel name, header, rows) per profiled kernel in the CSV."""
    name, hdr, rows = None, None, []
    for row in csv.reader(open(path, newline="")):
        if row and row[0] == "Kernel Name":
            if rows:
                yield name, hdr, rows
            name, hdr, rows = row[1], None, []
        elif hdr is None:
            hdr = row
        else:
            rows.append(row)
    if rows:
        yield name, hdr, rows


def k_loop(addrs: list[int], srcs: list[str]) -> tuple[int, int]:
    best = None
    for i, s in enumerate(srcs):
        m = BRA.search(s)
        if m and (t := int(m.group(1), 16)) <= addrs[i] and t in addrs:
            j = addrs.index(t)
            if any("QGMMA" in x for x in srcs[j:i + 1]) and (best is None
                                                            or i - j < best[1] - best[0]):
                best = (j, i)
    if best is None:
        raise SystemExit("no loop holding a QGMMA in this kernel")
    return best


def opcode(src: str) -> str:
    words = src.split()
    return (words[1] if words[0].startswith("@") else words[0]).split(".")[0]


def report(name: str, hdr: list[str], rows: list[list[str]]) -> None:
    col = {h: i for i, h in enumerate(hdr)}
    reasons = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    addrs = [int(r[col["Address"]], 16) for r in rows]
    srcs = [r[col["Source"]].strip() for r in rows]
    lo, hi = k_loop(addrs, srcs)
    per_op, why = Counter(), defaultdict(Counter)
    for r, src in zip(rows[lo:hi + 1], srcs[lo:hi + 1], strict=True):
        op, n = opcode(src), int(r[col[SAMPLES]] or 0)
        per_op[op] += n
        listed = 0
        for h in reasons:
            v = int(r[col[h]] or 0)
            why[op][h.removeprefix("stall_")] += v
            listed += v
        why[op]["unlisted"] += n - listed
    total = sum(int(r[col[SAMPLES]] or 0) for r in rows)
    in_loop = sum(per_op.values())
    print(f"{name[:90]}\n  k-loop: {hi - lo + 1} instructions, {in_loop} of {total} samples "
          f"({100 * in_loop / max(total, 1):.0f}%)")
    print(f"  {'opcode':<11} {'share':>6}  top stall reasons (share of the opcode's samples)")
    for op, n in per_op.most_common(10):
        top = ", ".join(f"{k} {100 * v / n:.0f}%" for k, v in why[op].most_common(4) if v > 0)
        print(f"  {op:<11} {100 * n / in_loop:5.1f}%  {top}")
    allr = Counter()
    for c in why.values():
        allr.update(c)
    print("  all k-loop samples: " + ", ".join(
        f"{k} {100 * v / in_loop:.0f}%" for k, v in allr.most_common(8) if v > 0))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", help="source_sass.csv from tools/gpu_ncu_source.sh")
    for name, hdr, rows in kernels(ap.parse_args().csv):
        report(name, hdr, rows)


if __name__ == "__main__":
    main()
