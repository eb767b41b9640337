#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Per-case summary of several runs of bench/run_forward.sh or
`cmake/blockattn.sh bench-isa` (their console logs, ANSI colours or not).

Each run's ratios are measured in that run (ours and PyTorch's rate on the
same case, same threads, minutes apart at most). On a shared, noisy machine a
single cell moves by 5-10 % between runs, more than the margin of the closest
cells, so this prints, per case, every run's ratio and their median and
minimum: the median says where the case stands, the minimum how far one run
can fall; "best ÷ best" is our fastest rate over all runs over PyTorch's
fastest over all runs (each side as fast as the machine let it be once).
Ratios are recomputed from the printed rates (not the rounded ratio columns).

    bench/summarize_runs.py run1.log run2.log ... [--dtype fp32]

Markdown on stdout: one table per build, thread count and head count (B = 1,
H query = K/V heads; fwd = forward,
bwd = backward, "÷ PyTorch" = ours / PyTorch's scaled_dot_product_attention,
"÷ sgemm" = ours / OpenBLAS sgemm of the same N x N x D), then a line per
table with the range of the medians and the cells whose median or minimum
is below 1.0.
"""
import argparse
import re
import statistics
import sys

HEADER = re.compile(
    r"Ratios measured in this run \(\S+, (\d+) threads?; "
    r"(?:B = \d+, H = (\d+)(?:, memory (\w+))?; )?host ISA (\S+), ")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def parse(path, dtype):
    """The runs of one log (a table whose key the current run already holds
    starts the next run: run_forward.sh with RUNS > 1), each
    {(build, threads, heads, memory layout): {(D, N, mask): {"fwd": ours/torch,
    "rates": (ours, torch) forward GFLOP/s, "bwd": ..., "sgemm": ...,
    "ours": forward GFLOP/s, "ours_bwd": backward GFLOP/s, "fp32": our fp32
    forward GFLOP/s, "fp32_bwd": our fp32 backward GFLOP/s}}}"""
    runs = [{}]
    build, table, mode = None, None, None
    with open(path, errors="replace") as f:
        for line in f:
            line = ANSI.sub("", line.rstrip("\n"))
            if line.startswith("##### -march="):
                build = line[len("##### -march="):].split()[0]
                continue
            m = HEADER.match(line)
            if m:
                key = (build or "host ISA " + m.group(4).rstrip(","), int(m.group(1)),
                       int(m.group(2) or 1), m.group(3) or "bnhd")
                if key in runs[-1]:
                    runs.append({})
                table, mode = runs[-1].setdefault(key, {}), "fwd"
                continue
            if line.startswith("Backward"):
                mode = "bwd"
                continue
            if table is None:
                continue
            p = line.split()
            try:
                if mode == "fwd" and len(p) >= 10 and p[0] == "register" and p[1] == "fp32":
                    table.setdefault((int(p[3]), int(p[2]), p[4]), {})["fp32"] = float(p[5])
                if mode == "bwd" and len(p) >= 8 and p[0] == "fp32":
                    table.setdefault((int(p[2]), int(p[1]), p[3]), {})["fp32_bwd"] = float(p[4])
                if mode == "fwd" and len(p) >= 10 and p[0] == "register" and p[1] == dtype:
                    n, d, mask, ours, torch = int(p[2]), int(p[3]), p[4], float(p[5]), float(p[-2])
                    cell = table.setdefault((d, n, mask), {})
                    cell["ours"] = ours
                    if p[6] != "-":
                        cell["sgemm"] = float(p[6])
                    if torch > 0:
                        cell["fwd"] = ours / torch
                        cell["rates"] = (ours, torch)
                elif mode == "bwd" and len(p) >= 8 and p[0] == dtype:
                    n, d, mask, ours, torch = int(p[1]), int(p[2]), p[3], float(p[4]), float(p[-2])
                    cell = table.setdefault((d, n, mask), {})
                    cell["ours_bwd"] = ours
                    if torch > 0:
                        cell["bwd"] = ours / torch
            except ValueError:  # a line of another table
                continue
    return [r for r in runs if r]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--dtype", default="fp32")
    a = ap.parse_args()
    runs = [r for p in a.logs for r in parse(p, a.dtype)]
    keys = []
    for r in runs:
        keys += [k for k in r if k not in keys]
    if not keys:
        sys.exit("summarize_runs.py: no ratio tables in " + ", ".join(a.logs))
    for key in keys:
        present = [r[key] for r in runs if key in r]
        print(f"\n**{key[0]}, {key[1]} thread{'s' if key[1] > 1 else ''}, H = {key[2]}, "
              f"memory {key[3]}** ({len(present)} run{'s' if len(present) > 1 else ''})\n")
        print("| D | N | mask | fwd ÷ PyTorch, each run | median | min | best ÷ best | "
              "bwd ÷ PyTorch median | min | fwd ÷ sgemm median |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        cells = sorted({c for t in present for c in t},
                       key=lambda c: (c[0], c[1], c[2] != "full"))
        medians, low = [], []
        for c in cells:
            fwd = [t[c]["fwd"] for t in present if "fwd" in t.get(c, {})]
            bwd = [t[c]["bwd"] for t in present if "bwd" in t.get(c, {})]
            sg = [t[c]["sgemm"] for t in present if "sgemm" in t.get(c, {})]
            rates = [t[c]["rates"] for t in present if "rates" in t.get(c, {})]
            # Our fastest over all runs / PyTorch's fastest over all runs: what
            # each reaches when the machine leaves it alone.
            if not fwd:
                continue
            bb = max(r[0] for r in rates) / max(r[1] for r in rates)
            med = statistics.median(fwd)
            medians.append(med)
            if med < 1.0 or min(fwd) < 1.0:
                low.append(f"D={c[0]} N={c[1]} {c[2]} (median {med:.3f}, min {min(fwd):.3f})")
            fmt = lambda v: f"{v:.2f}"
            print(f"| {c[0]} | {c[1]} | {c[2]} | {' '.join(fmt(v) for v in fwd)} | {med:.3f} | "
                  f"{min(fwd):.3f} | {bb:.2f} | {fmt(statistics.median(bwd)) if bwd else '-'} | "
                  f"{fmt(min(bwd)) if bwd else '-'} | {fmt(statistics.median(sg)) if sg else '-'} |")
        if medians:
            print(f"\nfwd ÷ PyTorch medians {min(medians):.2f}-{max(medians):.2f}; "
                  f"below 1.0 in a median or a run: {'; '.join(low) if low else 'none'}")
        if a.dtype != "fp32":
            over_fp32(present, cells, a.dtype)


def over_fp32(present, cells, dtype):
    """Our 16-bit rate over our fp32 rate, per run (both in the same run)."""
    rows = []
    for c in cells:
        per = {}
        for mine, base in (("ours", "fp32"), ("ours_bwd", "fp32_bwd")):
            per[mine] = [t[c][mine] / t[c][base] for t in present
                         if mine in t.get(c, {}) and t[c].get(base, 0) > 0]
        if per["ours"] or per["ours_bwd"]:
            rows.append((c, per))
    if not rows:
        return
    print(f"\nOurs, {dtype} over our fp32 (same run):\n")
    print("| D | N | mask | fwd, each run | median | bwd, each run | median | min |")
    print("|---|---|---|---|---|---|---|---|")
    for c, per in rows:
        f, b = per["ours"], per["ours_bwd"]
        each = lambda v: " ".join(f"{x:.2f}" for x in v) if v else "-"
        med = lambda v: f"{statistics.median(v):.2f}" if v else "-"
        print(f"| {c[0]} | {c[1]} | {c[2]} | {each(f)} | {med(f)} | {each(b)} | {med(b)} | "
              f"{f'{min(b):.2f}' if b else '-'} |")


if __name__ == "__main__":
    main()
