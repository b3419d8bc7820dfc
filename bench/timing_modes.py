"""One block under several timing methods, SM clock and power sampled throughout.

    python3 bench/timing_modes.py [case]    (a bench/blocks.py case, default llama4; JSON to $OUT)

Session 23 asked why a timed tilefuse forward of the 4-layer Llama took ~12% more than its
profiled kernel span while torch.compile's timed time matched its profile. Per implementation,
two rounds of: a profile from idle (cold clock), the flushed per-call median, the unflushed
median, 30 and 200 back-to-back calls, a profile right after (hot clock); nvidia-smi logs the
clock and power of each phase (power.draw.instant where the driver has it; session 23's run
logged power.draw, a trailing 1 s average, and its temperature). Answer (bench/LOG_blocks.md): the power limit.
"""
import json, os, statistics, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch
import power_state
from tilefuse.analyze.bench import back_to_back_ms, timings_ms

case = sys.argv[1] if len(sys.argv) > 1 else "llama4"
OUT = os.environ.get("OUT", "/tmp")
sampler = power_state.Sampler()  # drains nvidia-smi as it writes; instant power where the driver has it
marks = []  # (wall time, label)


def mark(label):
    torch.cuda.synchronize()
    marks.append((time.time(), label))


with torch.no_grad():
    tokens, prog, impls = power_state.compiled_pair(case)

    def span(fn, calls=5):
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as p:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
        ev = [e for e in p.events() if e.device_type.name == "CUDA"]
        ev.sort(key=lambda e: e.time_range.start)
        busy = sum(e.time_range.end - e.time_range.start for e in ev)
        total = ev[-1].time_range.end - ev[0].time_range.start
        return total / calls / 1e3, busy / calls / 1e3, len(ev) // calls

    res = {k: {} for k in impls}
    for rnd in range(2):
        for k, f in impls.items():
            time.sleep(1.0)
            mark(f"{k}:idle-profile-start")
            res[k].setdefault("profile_cold", []).append(span(f))
            mark(f"{k}:read-start")
            res[k].setdefault("timed_read", []).append(statistics.median(timings_ms(f, 25, 100, "read")))
            mark(f"{k}:none-start")
            res[k].setdefault("timed_none", []).append(statistics.median(timings_ms(f, 25, 100, "none")))
            mark(f"{k}:loop-start")
            res[k].setdefault("loop30", []).append(back_to_back_ms(f, 30))
            mark(f"{k}:hotprofile-start")
            res[k].setdefault("profile_hot", []).append(span(f))
            mark(f"{k}:long-start")
            res[k].setdefault("loop200", []).append(back_to_back_ms(f, 200))
            mark(f"{k}:end")
    stats = [g.stats for g in prog._graphed.values()]

samples = sampler.stop()
phases = []
for (t0, lab), (t1, _) in zip(marks, marks[1:]):
    s = [x for x in samples if t0 <= x[0] < t1]
    if s and not lab.endswith(":end"):
        phases.append((lab, t1 - t0, statistics.mean(x[1] for x in s), statistics.mean(x[2] for x in s)))
json.dump({"gpu": torch.cuda.get_device_name(), "power_field": sampler.fields, "res": res, "phases": phases,
           "graph_stats": stats},
          open(f"{OUT}/timing_modes_{case}.json", "w"), indent=1)
print("graph stats", stats)
print(f"{'phase':32s} {'s':>6s} {'MHz':>6s} {'W':>6s}")
for p in phases:
    print(f"{p[0]:32s} {p[1]:6.2f} {p[2]:6.0f} {p[3]:6.0f}")
for k, r in res.items():
    print(k)
    for mode, v in r.items():
        print(f"  {mode:14s}", "  ".join(str(tuple(round(y, 3) for y in x)) if isinstance(x, tuple) else f"{x:.3f}"
                                         for x in v))
