"""Each block's time at full clock and at the power limit, with the energy of one forward.

    python3 bench/power_state.py [--cases mlp,layer7b,llama4] [--rounds 2] [--json out.json]

Large bf16 GEMMs hold an H100 at its power limit (700 W), where the SM clock drops from 1980
MHz to ~1.5 GHz; how far depends on how much energy the work takes, not on how few cycles it
takes. So a block is timed two ways, for tilefuse and torch.compile in turn (rounds rotate who
goes first), each from an idle GPU (a 2 s pause first):

- cold: the kernel span of 5 forwards under torch.profiler right after the pause (first
  kernel's start to last kernel's end, over 5), with the clock still at or near its maximum;
- sustained: CUDA events around back-to-back forwards for --seconds (default 2.0); the time per
  forward over the last half, the power limit long reached.

nvidia-smi samples SM clock and power every 20 ms meanwhile; energy per forward is the
sustained phase's mean power (its last half) times its time per forward. The ratio of two
implementations' sustained times is then close to the ratio of their energies, whatever
their cold ratio (bench/LOG_blocks.md, session 23). Prints a table last.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import blocks  # noqa: E402
from tilefuse.analyze.bench import back_to_back_ms, fresh_compile  # noqa: E402
import tilefuse  # noqa: E402


class Sampler:
    """nvidia-smi in the background: (wall time, SM MHz, W) every 20 ms."""

    FIELDS = "timestamp,clocks.sm,power.draw.instant"

    def __init__(self):
        fields = self.FIELDS
        probe = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                               capture_output=True, text=True)
        if probe.returncode != 0 or "Field" in probe.stdout + probe.stderr:
            fields = "timestamp,clocks.sm,power.draw"  # older drivers: the 1 s average
        self.fields = fields
        self.proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits",
                                      "-lms", "20"], stdout=subprocess.PIPE, text=True)
        self.lines: list[str] = []  # drained as they come: a full pipe would stall nvidia-smi
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self.reader.start()

    def stop(self) -> list[tuple[float, float, float]]:
        self.proc.terminate()
        self.reader.join(timeout=5)
        out = []
        for line in self.lines:
            try:
                ts, clk, pw = [x.strip() for x in line.split(",")[:3]]
                day, frac = ts.split(".")
                t = time.mktime(time.strptime(day, "%Y/%m/%d %H:%M:%S")) + float("0." + frac)
                out.append((t, float(clk), float(pw)))
            except ValueError:
                continue
        return out


def cold_span_ms(fn, calls: int = 5) -> float:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    ev = [e for e in p.events() if e.device_type.name == "CUDA"]
    return (max(e.time_range.end for e in ev) - min(e.time_range.start for e in ev)) / calls / 1e3


def sustained(fn, seconds: float) -> tuple[float, float, float]:
    """(ms per forward over the second half, its wall start, its wall end)"""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    per = time.perf_counter() - t0
    n = max(10, int(seconds / 2 / per))
    for _ in range(n):  # the first half: reach the power limit
        fn()
    torch.cuda.synchronize()
    w0 = time.time()
    ms = back_to_back_ms(fn, n)
    return ms, w0, time.time()


def compiled_pair(case: str):
    """(tokens, tilefuse's program, {"tilefuse": call, "torch_compile": call}) for a blocks.py case,
    each called 3 times already (graph capture, dynamo's compile). Call under torch.no_grad()."""
    m, inputs, tokens = blocks.build(case)
    prog = tilefuse.compile(m, inputs)
    tc = fresh_compile(m)
    impls = {"tilefuse": lambda: prog(*inputs), "torch_compile": lambda: tc(*inputs)}
    for f in impls.values():
        for _ in range(3):
            f()
    torch.cuda.synchronize()
    return tokens, prog, impls


def run_case(case: str, rounds: int, seconds: float) -> dict:
    with torch.no_grad():
        tokens, _, impls = compiled_pair(case)
        row: dict = {"case": case, "tokens": tokens, **{k: {"cold_ms": [], "sustained_ms": [], "window": []}
                                                        for k in impls}}
        names = list(impls)
        for r in range(rounds):
            for k in names[r % 2:] + names[:r % 2]:
                time.sleep(2.0)
                row[k]["cold_ms"].append(cold_span_ms(impls[k]))
                ms, w0, w1 = sustained(impls[k], seconds)
                row[k]["sustained_ms"].append(ms)
                row[k]["window"].append((w0, w1))
    return row


def summarise(row: dict, samples) -> dict:
    for k in ("tilefuse", "torch_compile"):
        clk, pw = [], []
        for w0, w1 in row[k]["window"]:
            s = [x for x in samples if w0 <= x[0] <= w1]
            clk += [x[1] for x in s]
            pw += [x[2] for x in s]
        r = row[k]
        r["cold"] = statistics.median(r["cold_ms"])
        r["sust"] = statistics.median(r["sustained_ms"])
        r["mhz"] = statistics.mean(clk) if clk else float("nan")
        r["watts"] = statistics.mean(pw) if pw else float("nan")
        r["joules"] = r["watts"] * r["sust"] / 1e3
    tf, tc = row["tilefuse"], row["torch_compile"]
    row["cold_ratio"] = tc["cold"] / tf["cold"]
    row["sustained_ratio"] = tc["sust"] / tf["sust"]
    row["energy_ratio"] = tc["joules"] / tf["joules"]
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="mlp,layer7b,llama4")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=2.0, help="length of each sustained run (default 2.0)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.seconds <= 0:
        ap.error("--rounds must be at least 1 and --seconds positive")
    sampler = Sampler()
    rows = []
    try:
        for case in args.cases.split(","):
            rows.append(run_case(case, args.rounds, args.seconds))
            torch._dynamo.reset()
            torch.cuda.empty_cache()
    finally:
        samples = sampler.stop()
    rows = [summarise(r, samples) for r in rows]
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "power_field": sampler.fields,
              "rows": rows}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    print(f"\n{result['gpu']}, bf16; cold = kernel span from idle, sustained = back-to-back at the power limit")
    print(f"{'case':8} {'impl':14} {'cold ms':>8} {'sust ms':>8} {'MHz':>6} {'W':>5} {'J/fwd':>6}")
    for r in rows:
        for k in ("tilefuse", "torch_compile"):
            x = r[k]
            print(f"{r['case']:8} {k:14} {x['cold']:8.3f} {x['sust']:8.3f} {x['mhz']:6.0f} {x['watts']:5.0f} "
                  f"{x['joules']:6.3f}")
        print(f"{r['case']:8} {'t.c / tf':14} {r['cold_ratio']:8.3f} {r['sustained_ratio']:8.3f} "
              f"{'':6} {'':5} {r['energy_ratio']:6.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
