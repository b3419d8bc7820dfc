"""Short-M GEMMs (a decode step's projections): the GEMV template against the tile template and cuBLAS.

    python3 bench/gemv.py [--m 1,2,4,8] [--sweep fma|mma|both|prefetch] [--json bench/results/gemv_h200.json]
    python3 bench/gemv.py --groups [--m 1,4] [--json FILE]   # Q, K, V one after another vs one launch

Each implementation's calls are captured in one CUDA graph, 60 back to back, each reading
the next of several copies of B (together more than twice the L2, so B comes from DRAM as
a decode step's weights do), and the graph replayed: the time per call with the host's launch
rate out of it, and under programmatic launch where tilefuse launches so (as in a program's
graph). B is a weight (`b_const`: its first loads before the wait). Every output is checked
against float32 (2x rule) first. At M > 1 the FMA form's default (one row's schedule) is timed
beside the tensor-core form (the default there). --sweep also times every schedule of the FMA
form, the tensor-core form or both at each shape (sources compiled first, in parallel); --sweep
prefetch, the tensor-core default's layout with `prefetch` 0, 1 and 2 (MmaGemvSchedule).
Prints a table (us a call, B's bytes a second, ratios against cuBLAS and the tile template).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
from tilefuse.check import rel_error  # noqa: E402
from tilefuse.codegen import gemv  # noqa: E402
from tilefuse.codegen.gemm_sm90 import GemmProblem  # noqa: E402
from tilefuse.runtime.gemm import compile_gemm  # noqa: E402
from tilefuse.runtime.gemv import compile_gemv, compile_gemv_group  # noqa: E402

# Llama decode projections: 4096 wide (QKV fused 12288, O 4096, gate/up 2 x 11008, down, LM head
# 32000), 1024 wide (GQA's K/V), and a 2048-wide model's
SHAPES = [(4096, 4096), (12288, 4096), (1024, 4096), (22016, 4096), (4096, 11008), (32000, 4096),
          (2048, 2048), (11264, 2048), (2048, 5632)]
CALLS, REPLAYS = 60, 5


def per_call_us(fn) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(3):
            fn(i)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        g.capture_begin()
        for i in range(CALLS):
            fn(i)
        g.capture_end()
    torch.cuda.current_stream().wait_stream(s)
    g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
    e0.record()
    for _ in range(REPLAYS):
        g.replay()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / (CALLS * REPLAYS) * 1e3


def _ok(out, a, b) -> bool:
    ref = a.float() @ b.float().T
    return rel_error(out.float(), ref) <= 2 * rel_error((a @ b.T).float(), ref) + 1e-5


def sweep_schedules(m: int, kinds: str, n: int, k: int) -> list:
    out = []
    if kinds == "prefetch" and m <= gemv.MAX_M:
        # the tensor-core default's layout without and with B's steps asked into L2 ahead (at
        # M = 1 the default is the FMA form: the first is the baseline then); two steps ahead
        # only where K is more than one step
        d = gemv._mma_default(GemmProblem(m, n, k, "bf16", b_major="K", b_const=True))
        steps = -(-(k // gemv.VEC) // (4 * d.warps * d.unroll))
        out += [gemv.MmaGemvSchedule(d.warps, d.unroll, p) for p in ((0, 1, 2) if steps > 1 else (0, 1))]
    if kinds in ("fma", "both"):
        out += [gemv.GemvSchedule(c, w, u) for c in (1, 2, 4) for w in (4, 8, 16) for u in (1, 2, 4, 8)
                if c * u <= 16 and c * m <= 32]
    if kinds in ("mma", "both") and m <= gemv.MAX_M:
        out += [gemv.MmaGemvSchedule(w, u) for w in (4, 8, 16, 32) for u in (1, 2, 4, 8)]
    return out


def _build(job):
    """Render and compile one source into the cubin cache (a worker process)."""
    kind, prob, sched = job
    if kind == "tile":
        compile_gemm(prob)
    else:
        compile_gemv(prob, sched)
    return True


def precompile(ms, sweep: str | None) -> None:
    from concurrent.futures import ProcessPoolExecutor
    import multiprocessing as mp

    jobs = []
    for m in ms:
        for n, k in SHAPES:
            prob = GemmProblem(m, n, k, "bf16", b_major="K", b_const=True)
            jobs += [("tile", prob, None), ("gemv", prob, None), ("gemv", prob, gemv._fma_default(prob))]
            jobs += [("gemv", prob, s) for s in sweep_schedules(m, sweep or "", n, k)]
    with ProcessPoolExecutor(max_workers=min(16, mp.cpu_count()), mp_context=mp.get_context("spawn")) as ex:
        list(ex.map(_build, jobs, chunksize=4))


def run_shape(m, n, k, sweep: str | None) -> dict:
    copies = max(2, int(2 * 100e6 // (n * k * 2)) + 1)
    bs = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    prob = GemmProblem(m, n, k, "bf16", b_major="K", b_const=True)
    row = dict(m=m, n=n, k=k, copies=copies)
    row["cublas_us"] = per_call_us(lambda i: torch.matmul(a, bs[i % copies].T, out=out))
    tile = compile_gemm(prob)
    tile(a, bs[0], out=out)
    row["tile_ok"] = _ok(out, a, bs[0])
    row["tile_schedule"] = str(tile.schedule)
    row["tile_us"] = per_call_us(lambda i: tile(a, bs[i % copies], out=out))
    g = compile_gemv(prob)
    out.fill_(float("nan"))
    g(a, bs[0], out=out)
    row["gemv_ok"] = _ok(out, a, bs[0])
    row["gemv_schedule"] = str(g.schedule)
    row["gemv_us"] = per_call_us(lambda i: g(a, bs[i % copies], out=out))
    row["gemv_TBs"] = n * k * 2 / row["gemv_us"] / 1e6
    if m > 1:
        f = compile_gemv(prob, gemv._fma_default(prob))
        out.fill_(float("nan"))
        f(a, bs[0], out=out)
        row["fma_ok"] = _ok(out, a, bs[0])
        row["fma_us"] = per_call_us(lambda i: f(a, bs[i % copies], out=out))
    if sweep:
        row["sweep"] = {}
        for s in sweep_schedules(m, sweep, n, k):
            gs = compile_gemv(prob, s)
            out.fill_(float("nan"))
            gs(a, bs[0], out=out)
            key = gs.source.name.split("_")[4]
            row["sweep"][key] = per_call_us(lambda i: gs(a, bs[i % copies], out=out)) if _ok(out, a, bs[0]) else None
    return row


# GEMMs of one A a decode step runs side by side: Llama-7B's Q, K, V; with 8 KV heads (GQA);
# the 4-layer Llama's (d 2048)
GROUPS = [((4096, 4096, 4096), 4096), ((4096, 1024, 1024), 4096), ((2048, 2048, 2048), 2048)]


def run_group(m: int, ns, k: int) -> dict:
    """The members launched one after another (each its own default schedule, and each under
    the group's schedule) against the group's one launch, each reading the next of several copies
    of its B; the group's outputs checked equal to its members' under the same schedule."""
    probs = [GemmProblem(m, n, k, "bf16", b_major="K", b_const=True) for n in ns]
    copies = max(2, int(2 * 100e6 // (sum(ns) * k * 2)) + 1)
    bs = [[torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for n in ns] for _ in range(copies)]
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    outs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for n in ns]
    group = compile_gemv_group(probs)
    alone = [compile_gemv(p) for p in probs]
    same = [compile_gemv(p, group.source.schedule) for p in probs]
    group(a, bs[0], [dict(out=o) for o in outs])
    got = [o.clone() for o in outs]
    for j, g in enumerate(same):
        g(a, bs[0][j], out=outs[j])
    row = dict(m=m, ns=list(ns), k=k, copies=copies, schedule=str(group.source.schedule),
               equal=all(torch.equal(x, y) for x, y in zip(got, outs)),
               ok=all(_ok(o, a, b) for o, b in zip(got, bs[0])))

    def each(kernels):
        return lambda i: [g(a, bs[i % copies][j], out=outs[j]) for j, g in enumerate(kernels)]

    row["alone_us"] = per_call_us(each(alone))
    row["same_schedule_us"] = per_call_us(each(same))
    row["group_us"] = per_call_us(lambda i: group(a, bs[i % copies], [dict(out=o) for o in outs]))
    row["group_TBs"] = sum(ns) * k * 2 / row["group_us"] / 1e6
    return row


def groups_main(ms, path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(8) as ex:  # NVRTC outside the GIL: the cubin cache first
        list(ex.map(lambda j: compile_gemv_group([GemmProblem(j[0], n, j[2], "bf16", b_major="K", b_const=True)
                                                  for n in j[1]]), [(m, ns, k) for m in ms for ns, k in GROUPS]))
    rows = []
    for m in ms:
        for ns, k in GROUPS:
            rows.append(run_group(m, ns, k))
            print(json.dumps(rows[-1]), flush=True)
    gpu = torch.cuda.get_device_name()
    if path:
        Path(path).write_text(json.dumps(dict(gpu=gpu, calls=CALLS, replays=REPLAYS, rows=rows), indent=1))
    print(f"\n{gpu}, bf16, us a step of the group's GEMMs back to back in a CUDA graph")
    print(f"{'M x Ns x K':>24} {'alone':>8} {'same sch':>8} {'group':>8} {'TB/s':>6} {'alone/group':>11} ok")
    for r in rows:
        shape = f"{r['m']}x{'+'.join(map(str, r['ns']))}x{r['k']}"
        print(f"{shape:>24} {r['alone_us']:8.2f} {r['same_schedule_us']:8.2f} {r['group_us']:8.2f} "
              f"{r['group_TBs']:6.2f} {r['alone_us'] / r['group_us']:11.3f} {'y' if r['ok'] and r['equal'] else 'N'}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--m", default="1,2,4,8", help="rows of A (comma-separated)")
    ap.add_argument("--sweep", choices=("fma", "mma", "both", "prefetch"),
                    help="also time every schedule of the FMA form, the tensor-core form or both; or "
                         "(prefetch) the tensor-core default with B's steps prefetched into L2, 1 or 2 ahead")
    ap.add_argument("--groups", action="store_true",
                    help="instead: GEMMs of one A (Q, K, V) one after another against one launch (render_group)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    rows = []
    ms = [int(x) for x in args.m.split(",")]
    if args.groups:
        return groups_main(ms, args.json)
    precompile(ms, args.sweep)
    for m in ms:
        for n, k in SHAPES:
            r = run_shape(m, n, k, args.sweep)
            rows.append(r)
            print(json.dumps({x: v for x, v in r.items() if x != "sweep"}), flush=True)
    gpu = torch.cuda.get_device_name()
    if args.json:
        Path(args.json).write_text(json.dumps(dict(gpu=gpu, calls=CALLS, replays=REPLAYS, rows=rows), indent=1))
    print(f"\n{gpu}, bf16, B K-major (a weight), us a call back to back in a CUDA graph")
    print(f"{'M x N x K':>16} {'cuBLAS':>8} {'tile':>8} {'FMA':>8} {'GEMV':>8} {'TB/s':>6} {'vs cuBLAS':>9} "
          f"{'vs tile':>8} {'vs FMA':>7} ok" + ("  best of sweep" if args.sweep else ""))
    for r in rows:
        timed = {key: us for key, us in r.get("sweep", {}).items() if us is not None}
        best = min(timed.items(), key=lambda kv: kv[1]) if timed else None
        bad = len(r.get("sweep", {})) - len(timed)
        fma = r.get("fma_us", r["gemv_us"])
        ok = r["gemv_ok"] and r["tile_ok"] and r.get("fma_ok", True) and not bad
        print(f"{r['m']}x{r['n']}x{r['k']:>6} {r['cublas_us']:8.2f} {r['tile_us']:8.2f} {fma:8.2f} {r['gemv_us']:8.2f} "
              f"{r['gemv_TBs']:6.2f} {r['cublas_us'] / r['gemv_us']:9.3f} {r['tile_us'] / r['gemv_us']:8.3f} "
              f"{fma / r['gemv_us']:7.3f} {'y' if ok else f'N ({bad} of the sweep wrong)'}"
              + (f"  {best[0]} {best[1]:.2f}" if best else ""))


if __name__ == "__main__":
    main()
