"""Issue 2's map-reduce table: tilefuse vs eager vs torch.compile, bf16, same run.

    python3 bench/mapreduce.py --json bench/results/mapreduce_h100.json [--quick]
    python3 bench/mapreduce.py --overhead [--json FILE]   # host time per call: graphs, clone, thin
    python3 bench/mapreduce.py --profile                   # cProfile of the thin launch path
    python3 bench/mapreduce.py --cases softmax:32768x4096,cross_entropy:32768x4096 \
        --no-compile-baseline --kernel-times                # a few cases, GPU time of each kernel

Each program is compiled with tilefuse.compile and timed (median, CUDA events, L2 flushed)
next to PyTorch eager and torch.compile (default mode) on random normal inputs, in `--rounds`
interleaved rounds (the order rotated each round; each time is the median over rounds); GB/s count
each input/weight read once and each output written once; % of copy is against a
device-to-device copy measured in the same run. tilefuse runs as it does by default (CUDA
graph replay after a warm-up call for programs of two or more kernels, a direct launch for
one). Each implementation's host time per call (the GPU idle) is recorded beside its GPU
time. Also records the RMSNorm program's compile time, cold (empty cubin cache) and warm. The JSON is rewritten after every case, so a run cut
short keeps what it measured. Prints a table last.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
import torch.nn.functional as F

import tilefuse
import tuning
from tilefuse.analyze.bench import compare, copy_bandwidth

SHAPES = [(32768, 4096), (16384, 8192), (4096, 65536), (32768, 256)]
LONG = [(8192, 262144)]


class RMSNorm(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n))

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, 1e-6)


class AddRMSNorm(RMSNorm):
    def forward(self, x, res):
        h = x + res
        return h, F.rms_norm(h, (h.shape[-1],), self.weight, 1e-6)


class LayerNorm(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.ln = torch.nn.LayerNorm(n)
        torch.nn.init.normal_(self.ln.weight)
        torch.nn.init.normal_(self.ln.bias)

    def forward(self, x):
        return self.ln(x)


class Softmax(torch.nn.Module):
    def __init__(self, n):
        super().__init__()

    def forward(self, x):
        return torch.softmax(x, -1)


class CrossEntropy(torch.nn.Module):
    def __init__(self, n):
        super().__init__()

    def forward(self, logits, target):
        return F.cross_entropy(logits, target)


def inputs_for(name, rows, cols):
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    if name == "add+rmsnorm":
        return (x, torch.randn_like(x))
    if name == "cross_entropy":
        return (x, torch.randint(0, cols, (rows,), device="cuda"))
    return (x,)


PROGRAMS = {"rmsnorm": RMSNorm, "layernorm": LayerNorm, "softmax": Softmax, "add+rmsnorm": AddRMSNorm,
            "cross_entropy": CrossEntropy}


def cases(quick: bool, only: str | None = None):
    """The issue's (program, shape) cases; `only`: "name:RxC,..." picks some, in that order."""
    if only:
        for c in only.split(","):
            name, shape = c.split(":")
            yield name, tuple(int(x) for x in shape.split("x"))
        return
    for name in PROGRAMS:
        for shape in SHAPES + (LONG if name in ("softmax", "cross_entropy") else []):
            if quick and shape not in ((32768, 4096), (32768, 256)):
                continue
            yield name, shape


def kernel_times(prog, inputs, calls: int = 20) -> dict:
    """Mean GPU time of each kernel the program launches (torch.profiler, CUDA activity), us:
    which kernel of a program the time goes to, and what the gaps between them cost."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        for _ in range(3):
            prog(*inputs)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as p:
            for _ in range(calls):
                prog(*inputs)
            torch.cuda.synchronize()
    out = {}
    for e in p.key_averages():
        if e.device_type.name == "CUDA" and e.count >= calls:
            out[e.key] = {"us": e.device_time_total / e.count, "count": e.count // calls}
    return out


def compile_times():
    """RMSNorm compile time with an empty cubin cache, then with a warm one."""
    with tempfile.TemporaryDirectory() as d:
        old = os.environ.get("TILEFUSE_CACHE_DIR")
        os.environ["TILEFUSE_CACHE_DIR"] = d
        try:
            m = RMSNorm(4096).cuda().bfloat16()
            x = torch.randn(32768, 4096, device="cuda", dtype=torch.bfloat16)
            t0 = time.perf_counter()
            tilefuse.compile(m, (x,))
            cold = time.perf_counter() - t0
            t0 = time.perf_counter()
            tilefuse.compile(m, (x,))
            warm = time.perf_counter() - t0
        finally:
            if old is None:
                os.environ.pop("TILEFUSE_CACHE_DIR")
            else:
                os.environ["TILEFUSE_CACHE_DIR"] = old
    return cold, warm


def program_bytes(module, inputs) -> int:
    nbytes = sum(t.numel() * t.element_size() for t in inputs)
    nbytes += sum(p.numel() * p.element_size() for p in module.parameters())
    with torch.no_grad():
        outs = module(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    return nbytes + sum(o.numel() * o.element_size() for o in outs)


def err_vs_eager(prog, module, inputs) -> float:
    """Worst relative Frobenius error of tilefuse's outputs against eager's, from one more call
    after the timing (so the replayed path is the one checked); a sanity check, not the 2x rule."""
    with torch.no_grad():
        got, want = prog(*inputs), module(*inputs)
    got, want = (got if isinstance(got, tuple) else (got,)), (want if isinstance(want, tuple) else (want,))
    worst = 0.0
    for g, w in zip(got, want):
        g, w = g.reshape(-1), w.reshape(-1)
        num = den = 0.0
        for i in range(0, g.numel(), 1 << 26):  # in chunks: the largest outputs are 4 GB
            a, b = g[i:i + (1 << 26)].double(), w[i:i + (1 << 26)].double()
            num += float((a - b).square().sum())
            den += float(b.square().sum())
        worst = max(worst, (num / den) ** 0.5 if den else num ** 0.5)
    return worst


def _save(path, out):
    if path:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(out, f, indent=1)


def _record(name, rows, cols, rows_, prog, nbytes, seconds):
    st = prog.stages
    rec = {"program": name, "shape": [rows, cols], "bytes": nbytes, "kernels": len(st.kernels),
           "externs": sum(s.family == "extern" for s in st.plan.steps), "graph": prog.graph_info(),
           "case_s": seconds}
    for r in rows_:
        rec[r.name] = {"us": r.ms * 1e3, "GBps": r.gbps, "pct_copy": r.pct_copy, "host_us": r.host_us}
    return rec


def tune_all(args) -> dict:
    """Every case's kernels tuned, and the tuner closed, before anything is timed, so that no
    tuner work (its compile-ahead jobs, its worker) shares the machine with a timed call. A
    session-46 run that tuned each case just before timing it gave torch.compile's LayerNorm
    and add+RMSNorm at 32768 x 256 54.8 and 65.0 us, their host time per call 93 and 80 us,
    where a run without the tuner gave 11.8 and 17.7 us (host 51 and 72): the first two cases
    only, which fits compile jobs still running; not checked since."""
    tuner = tuning.make_tuner()
    out = {}
    try:
        for name, (rows, cols) in cases(args.quick, args.cases):
            module = PROGRAMS[name](cols).cuda().bfloat16()
            out[name, rows, cols] = tuning.tune(tuner, module, inputs_for(name, rows, cols))
            del module
            torch.cuda.empty_cache()
    finally:
        tuning.close(tuner)
    return out


def run_table(args):
    gpu = torch.cuda.get_device_name()
    copy_bps = copy_bandwidth()
    out = {"gpu": gpu, "torch": torch.__version__, "copy_TBps": copy_bps / 1e12, "cuda_graphs": True,
           "results": []}
    out["tuned"] = bool(args.tune)
    out["rounds"] = args.rounds
    tunings = tune_all(args) if args.tune else {}
    for name, (rows, cols) in cases(args.quick, args.cases):
        t0 = time.perf_counter()
        module = PROGRAMS[name](cols).cuda().bfloat16()
        inputs = inputs_for(name, rows, cols)
        tuned = tunings.get((name, rows, cols))
        prog = tilefuse.compile(module, inputs)
        nbytes = program_bytes(module, inputs)
        rows_ = compare(prog, module, inputs, nbytes, copy_bps, with_compile=not args.no_compile_baseline,
                        rounds=args.rounds)
        out["results"].append(_record(name, rows, cols, rows_, prog, nbytes, time.perf_counter() - t0))
        out["results"][-1]["schedules"] = {k[0]: str(ck.source.schedule) for k, ck in prog._compiled.items()
                                           if getattr(getattr(ck, "source", None), "schedule", None) is not None}
        if args.kernel_times:
            out["results"][-1]["kernel_us"] = kt = kernel_times(prog, inputs)
            print(f"  kernels of {name} {rows}x{cols}: " + ", ".join(f"{k} {v['us']:.1f}us" for k, v in kt.items()))
        out["results"][-1]["err_vs_eager"] = err_vs_eager(prog, module, inputs)
        if tuned is not None:
            out["results"][-1]["tuning"] = tuned
        _save(args.json, out)
        print(f"{name:14s} {rows}x{cols}: " + "  ".join(f"{r.name} {r.ms * 1e3:.1f}us/{r.host_us:.0f}us host"
                                                         for r in rows_), flush=True)
        del prog, inputs, module, rows_
        torch.cuda.empty_cache()
    cold, warm = compile_times()
    out["rmsnorm_compile_s"] = {"cold": cold, "warm": warm}
    _save(args.json, out)
    print(f"\n{gpu}, copy {copy_bps / 1e12:.2f} TB/s; RMSNorm compile cold {cold * 1e3:.0f} ms, warm {warm * 1e3:.0f} ms")
    print(f"{'program':14s} {'shape':>12s} {'tf us':>8s} {'TB/s':>5s} {'%copy':>6s} {'eager/tf':>8s} {'compile/tf':>10s}"
          f" {'host us tf/eager/compile':>26s}")
    for r in out["results"]:
        tf = r["tilefuse"]
        comp = r.get("torch.compile", {}).get("us", float("nan")) / tf["us"]
        hosts = "/".join(f"{r[k]['host_us']:.0f}" for k in ("tilefuse", "eager", "torch.compile") if k in r)
        print(f"{r['program']:14s} {'x'.join(map(str, r['shape'])):>12s} {tf['us']:8.1f} {tf['GBps'] / 1e3:5.2f} "
              f"{tf['pct_copy']:5.0f}% {r['eager']['us'] / tf['us']:8.2f} {comp:10.2f} {hosts:>26s}")


OVERHEAD_CASES = [("rmsnorm", (32768, 256)), ("add+rmsnorm", (32768, 256)), ("cross_entropy", (32768, 256)),
                  ("softmax", (32768, 256)), ("layernorm", (32768, 256)), ("rmsnorm", (32768, 4096)),
                  ("add+rmsnorm", (32768, 4096)), ("softmax", (32768, 4096))]


def run_profile(args, calls: int = 3000):
    """Where the thin path's host time goes: cProfile of repeated calls, GPU idle at the start."""
    import cProfile
    import pstats

    module = PROGRAMS["cross_entropy"](256).cuda().bfloat16()
    inputs = inputs_for("cross_entropy", 4096, 256)
    prog = tilefuse.compile(module, inputs)
    prog.graphs = False
    for _ in range(10):
        prog(*inputs)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        prog(*inputs)
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof)
    print(f"thin path, cross_entropy 4096x256, {len(prog.stages.kernels)} kernels: "
          f"{stats.total_tt / calls * 1e6:.1f} us/call under the profiler")
    stats.sort_stats("tottime").print_stats(14)


def run_overhead(args):
    """GPU and host time per call of the three ways a program can run: graph replay (results
    tracked), graph replay returning clones, and the thin launch path, next to the baselines."""
    gpu = torch.cuda.get_device_name()
    copy_bps = copy_bandwidth()
    out = {"gpu": gpu, "torch": torch.__version__, "copy_TBps": copy_bps / 1e12, "results": []}
    for name, (rows, cols) in OVERHEAD_CASES:
        t0 = time.perf_counter()
        module = PROGRAMS[name](cols).cuda().bfloat16()
        inputs = inputs_for(name, rows, cols)
        prog = tilefuse.compile(module, inputs, graphs=True)  # replay even a one-kernel program here
        clone = tilefuse.compile(module, inputs, graphs=True)
        clone.graph_clone = True
        thin = tilefuse.compile(module, inputs)
        thin.graphs = False
        extra = {"tilefuse clone": lambda: clone(*inputs), "tilefuse thin": lambda: thin(*inputs)}
        nbytes = program_bytes(module, inputs)
        rows_ = compare(prog, module, inputs, nbytes, copy_bps, with_compile=not args.no_compile_baseline,
                        extra=extra)
        out["results"].append(_record(name, rows, cols, rows_, prog, nbytes, time.perf_counter() - t0))
        _save(args.json, out)
        del prog, clone, thin, extra, inputs, module
        torch.cuda.empty_cache()
    print(f"\n{gpu}: GPU us (CUDA events, median) / host us per call (GPU idle, median)")
    impls = ["tilefuse", "tilefuse clone", "tilefuse thin", "eager", "torch.compile"]
    print(f"{'program':14s} {'shape':>11s} " + " ".join(f"{i:>17s}" for i in impls))
    for r in out["results"]:
        cells = [f"{r[i]['us']:7.1f}/{r[i]['host_us']:6.1f}" if i in r else "-" for i in impls]
        print(f"{r['program']:14s} {'x'.join(map(str, r['shape'])):>11s} " + " ".join(f"{c:>17s}" for c in cells))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--quick", action="store_true", help="two shapes only")
    ap.add_argument("--overhead", action="store_true", help="host overhead per call: graphs, clones, thin path")
    ap.add_argument("--profile", action="store_true", help="cProfile the thin launch path of one program")
    ap.add_argument("--no-compile-baseline", action="store_true", help="skip torch.compile (it takes a while)")
    ap.add_argument("--cases", help="only these program:RxC cases, comma-separated (e.g. softmax:4096x65536)")
    ap.add_argument("--kernel-times", action="store_true", help="GPU time of each kernel (torch.profiler; run with TILEFUSE_PDL=0, else a kernel's time includes its wait for the one before)")
    ap.add_argument("--rounds", type=int, default=5,
                    help="interleaved timing rounds per case (rotated order; each time is the median of its rounds)")
    ap.add_argument("--tune", action="store_true", help="tune each program's kernels first (as `tilefuse tune` "
                    "does; picks cached in TILEFUSE_CACHE_DIR), so tilefuse runs with the tuned schedules")
    args = ap.parse_args()
    torch.manual_seed(0)
    (run_profile if args.profile else run_overhead if args.overhead else run_table)(args)


if __name__ == "__main__":
    main()
