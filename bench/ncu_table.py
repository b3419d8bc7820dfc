"""Print the tilefuse GEMM kernels of an Nsight Compute CSV (`ncu --csv --metrics ...`), one row
per kernel in launch order, labelled in the order gemm_profile.py --epilogues ran them:

    ncu --clock-control none --csv --metrics gpu__time_duration.sum,sm__cycles_elapsed.avg,\\
        smsp__inst_executed.sum,dram__bytes_read.sum python3 bench/gemm_profile.py \\
        --shape 8192,4096,4096 --epilogues plain,residual > run.csv
    python3 bench/ncu_table.py run.csv --labels plain,residual [--tag old]

Each kernel runs once, alone, from an idle GPU: durations repeat to ~0.3% from run to run, so
an epilogue's cost shows as a duration and cycle difference that same-run CUDA-event ratios
(2-3% apart between runs, the clock drifting under the power limit) cannot resolve. It is the
unthrottled cost: sustained back-to-back launches run at the power limit, where it can differ.
"""
from __future__ import annotations

import argparse
import csv

METRICS = {"gpu__time_duration.sum": ("us", 1e-3), "sm__cycles_elapsed.avg": ("cycles", 1.0),
           "smsp__inst_executed.sum": ("instructions", 1.0), "dram__bytes_read.sum": ("DRAM MB read", 1e-6)}


def kernels(path: str) -> list[dict]:
    rows = [r for r in csv.reader(open(path)) if len(r) > 10]
    head, by = rows[0], {}
    ki, mi, vi, ii = (head.index(x) for x in ("Kernel Name", "Metric Name", "Metric Value", "ID"))
    for r in rows[1:]:
        if "tf_gemm" in r[ki] and r[mi] in METRICS:
            by.setdefault(int(r[ii]), {})[r[mi]] = float(r[vi].replace(",", "")) * METRICS[r[mi]][1]
    return [by[i] for i in sorted(by)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--labels", default="", help="one per kernel, separated by --sep")
    ap.add_argument("--sep", default=",", help="the labels' separator (default ','; ' ' where labels hold commas)")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    labels = args.labels.split(args.sep) if args.labels else []
    for i, k in enumerate(kernels(args.csv)):
        label = labels[i] if i < len(labels) else f"kernel {i}"
        cells = "  ".join(f"{METRICS[m][0]} {k[m]:,.1f}" for m in METRICS if m in k)
        print(f"{args.tag:>6} {label:>12}  {cells}")


if __name__ == "__main__":
    main()
