"""tilefuse's sm_90a GEMM vs cuBLAS (torch.matmul), bf16, issue 4's shapes.

    python3 bench/gemm.py [--json bench/results/gemm_h100.json] [--shapes 4096,4096,4096 ...]
        [--schedules 128x256s4c2,128x128s6c2m2] [--rep 300]
    python3 bench/gemm.py --fused [--json bench/results/gemm_fused_h100.json] [--no-baseline]
    python3 bench/gemm.py --compile-only [...]   # fill the cubin cache (no GPU needed), then exit
    python3 bench/gemm.py --with-alternative     # default schedules, plus each one's nearest alternative
    python3 bench/gemm.py --tune                 # tune each shape first (`tilefuse tune`); default and tuned
    python3 bench/gemm.py --decode               # a decode step's projections (M = 1 to 64) instead

With --schedules the table shows the best schedule per shape (a sweep); without, the default
schedule's ratio, and --with-alternative also times the default's nearest alternative (the
2-CTA cluster flipped for 128x256 tiles, the store path flipped for the smaller ones): a
second sample for the log, never mixed into the default's ratio or the geomean. --tune runs
the autotuner on each shape first (picks cached in TILEFUSE_CACHE_DIR, as `tilefuse tune`
leaves them) and times the tuned schedule next to the default, each with its own geomean.

Schedules: <bm>x<bn>s<stages>c<consumers>[g<group_m>][m2][d][p]: g = tile rows per raster group,
m2 = 2-CTA clusters along M multicasting B, d = epilogue stores straight from registers
instead of through shared memory and TMA, p = ping-pong consumers (each its own bm x bn tile,
main loops in turn), k<S> = split-K in S slices, sk<G> = stream-K: a grid of G CTAs
(clusters), the last waves' tiles shared out among them by K steps. With --fused, each fused kernel and its plain GEMM run with every
schedule given (else the default).

Random normal inputs; each tilefuse result is checked against a float32 reference (the 2x
rule of tilefuse.check, against cuBLAS's own bf16 error) before it is timed. Times are
medians of CUDA-event timings with L2 flushed by a read before each call
(tilefuse.analyze.bench; results before session 6 used do_bench's write flush, whose
write-back adds ~9 us to every call). TFLOP/s counts 2*M*N*K. The
dense bf16 peak is the best cuBLAS rate measured in this run. Prints a table last.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

# TILEFUSE_SRC: another tree's src, to time its defaults beside this one's (bench/LOG_gemm.md)
sys.path.insert(0, os.environ.get("TILEFUSE_SRC", str(Path(__file__).resolve().parents[1] / "src")))

from tilefuse.check import rel_error  # noqa: E402
from tilefuse.codegen import epilogue as epi  # noqa: E402
from dataclasses import replace  # noqa: E402

from tilefuse.codegen.gemm_sm90 import GemmProblem, GemmSchedule, default_schedule  # noqa: E402
from tilefuse.runtime.gemm import compile_gemm  # noqa: E402

SHAPES = [(4096, 4096, 4096), (6144, 6144, 6144), (8192, 8192, 8192), (8192, 4096, 4096),
          (8192, 11008, 4096), (8192, 4096, 11008), (16384, 6144, 4096), (8192, 14336, 4096),
          (8192, 4096, 14336), (512, 4096, 4096), (128, 4096, 4096)]

# a decode step's projections (M = batch): Llama widths 1024 (ffn 2816, GLU 5632) and 4096 (ffn
# 11008 / 14336, fused QKV 12288, GLU 22016), LM heads of 32000 and 128256 words, batches to 64
DECODE_SHAPES = [(1, 1024, 1024), (1, 3072, 1024), (1, 5632, 1024), (1, 1024, 2816), (1, 32000, 1024),
                 (1, 4096, 4096), (1, 12288, 4096), (1, 22016, 4096), (1, 4096, 11008), (1, 11008, 4096),
                 (1, 32000, 4096), (1, 8192, 2048), (1, 14336, 4096), (1, 4096, 14336), (8, 4096, 4096),
                 (16, 12288, 4096), (32, 22016, 4096), (64, 4096, 4096), (64, 14336, 4096), (1, 128256, 4096)]


REP_MS = 300


TIMING = "per-call"  # --timing


def median_ms(fn) -> float:
    """One implementation's time: the flushed per-call median (default), or with --timing
    sustained its time back to back after 0.8 s of its own calls (analyze.bench.sustained_ms:
    each at its own steady clock under the power limit, bench/LOG_blocks.md session 23)."""
    from tilefuse.analyze.bench import median_ms as timed, sustained_ms

    if TIMING == "sustained":
        return sustained_ms(fn, seconds=REP_MS / 1e3, settle_s=0.8)
    return timed(fn, warmup=50, rep=REP_MS)


def parse_schedule(text: str) -> GemmSchedule:
    """'128x256s4c2' -> bm 128, bn 256, 4 stages, 2 consumers (g<G>: group_m, m2: cluster
    along M, n2: along N, d: direct stores, p: ping-pong consumers, k<S>: split-K in S slices)."""
    import re

    m = re.fullmatch(r"(\d+)x(\d+)s(\d+)c(\d+)(?:g(\d+))?(?:m(\d))?(?:n(\d))?(d)?(p)?(?:k(\d+))?(?:sk(\d+))?",
                     text)
    if not m:
        raise SystemExit(f"bad schedule {text!r}; want like 128x256s4c2 (g8: group_m, m2/n2: 2-CTA cluster, "
                         f"d: direct stores, p: ping-pong, k4: split-K 4, sk132: stream-K over 132 CTAs)")
    bm, bn, s, c, g, cl, cn, d, p, split, sk = m.groups()
    return GemmSchedule(int(bm), int(bn), stages=int(s), consumers=int(c), group_m=int(g or 8),
                        cluster_m=int(cl or 1), cluster_n=int(cn or 1), tma_store=not d, pingpong=bool(p),
                        split_k=int(split or 1), stream_k=int(sk or 0))


def reference(a, b, b_major):
    """(float32 reference, cuBLAS's own bf16 error against it): computed once per shape."""
    bt = b.float() if b_major == "N" else b.float().transpose(-1, -2)
    ref = a.float() @ bt
    lowp = a @ (b if b_major == "N" else b.transpose(-1, -2))
    return ref, rel_error(lowp.float(), ref)


def check(out, ref, base):
    """DESIGN.md's 2x rule, and every element written (outputs are poisoned first)."""
    err = rel_error(out.float(), ref)
    ok = bool(torch.isfinite(out).all()) and err <= 2 * base + 1e-5
    return ok, err, base


def alternative(sched: GemmSchedule) -> GemmSchedule:
    """The default's nearest alternative: cluster flipped for the large tile, else the store path."""
    if sched.bn == 256:
        return replace(sched, cluster_m=3 - sched.cluster_m)
    return replace(sched, tma_store=not sched.tma_store)


def tuned(tuner, prob: GemmProblem) -> GemmSchedule:
    """The autotuner's schedule for `prob` (searched now, or a cache hit), else the default."""
    from tilefuse.tune.gemm import GemmTask
    from tilefuse.tune.lookup import choose_gemm

    tuner.tune({f"gemm {prob.m}x{prob.n}x{prob.k}": GemmTask(prob)})
    return choose_gemm(prob).schedule


def run_shape(m, n, k, schedules, b_major="K", with_alternative=False, tuned_schedule=None):
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(*((n, k) if b_major == "K" else (k, n)), device="cuda", dtype=torch.bfloat16)
    bt = b.t() if b_major == "K" else b
    t_cublas = median_ms(lambda: torch.matmul(a, bt))
    flops = 2 * m * n * k
    rows = []
    prob = GemmProblem(m, n, k, "bf16", b_major=b_major)
    ref, ref_base = reference(a, b, b_major)
    roles = ["sweep"] * len(schedules)
    if not schedules:
        schedules = [default_schedule(prob)] + ([alternative(default_schedule(prob))] if with_alternative else [])
        roles = ["default", "alternative"][:len(schedules)]
        if tuned_schedule is not None:
            schedules, roles = schedules + [tuned_schedule], roles + ["tuned"]
    for role, sched in zip(roles, schedules):
        t0 = time.perf_counter()
        try:
            g = compile_gemm(prob, sched)
        except Exception as e:  # noqa: BLE001 - a schedule this problem cannot take: say so, go on
            print(f"{m}x{n}x{k} {sched}: {e}", flush=True)
            continue
        compile_s = time.perf_counter() - t0
        out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        g(a, b, out=out)
        torch.cuda.synchronize()
        ok, err, base = check(out, ref, ref_base)
        t = median_ms(lambda: g(a, b, out=out)) if ok else float("nan")
        rows.append(dict(m=m, n=n, k=k, b_major=b_major, schedule=str(sched), ok=ok, err=err, cublas_err=base,
                         ms=t, cublas_ms=t_cublas, tflops=flops / t / 1e9 if ok else 0.0,
                         cublas_tflops=flops / t_cublas / 1e9, ratio=t_cublas / t if ok else 0.0,
                         regs=g.info.registers, spills=g.info.spill_stores + g.info.spill_loads,
                         compile_s=compile_s, role=role))
    t_after = median_ms(lambda: torch.matmul(a, bt))
    if t_after < t_cublas:  # the faster of cuBLAS before and after ours is the baseline
        for r in rows:
            r.update(cublas_ms=t_after, cublas_tflops=flops / t_after / 1e9,
                     ratio=t_after / r["ms"] if r["ok"] else 0.0)
    for r in rows:
        r["cublas_ms_before_after"] = (t_cublas, t_after)
    return rows


FUSED_SHAPES = [(8192, 4096, 4096), (8192, 11008, 4096)]


def epilogue_kinds(m, n) -> dict:
    """One GEMM of each fused kind on an m x n product (gemm_profile.py --epilogues,
    gemm_power.py): kind -> (epilogue or None for the plain GEMM, the operands it reads).
    SwiGLU's output is n/2 wide; run_fused below builds its own cases, with references."""
    return {"plain": (None, ()),
            "bias+gelu": (epi.standard(m, n, "bf16", bias="col", activation="gelu"), ("bias",)),
            "swiglu": (epi.glu(m, n, "bf16"), ()),
            "residual": (epi.standard(m, n, "bf16", residual=True), ("residual",)),
            "row-scale": (epi.standard(m, n, "bf16", row_scale=True), ("row_scale",))}


def epilogue_operands(m, n) -> dict:
    """Random operands for epilogue_kinds' epilogues, by name."""
    return {"bias": torch.randn(n, device="cuda", dtype=torch.bfloat16),
            "residual": torch.randn(m, n, device="cuda", dtype=torch.bfloat16),
            "row_scale": torch.rand(m, device="cuda", dtype=torch.float32) + 0.5}


def _baseline(fn, *args):
    """The faster of eager and torch.compile (default) for the same function, in ms."""
    eager = median_ms(lambda: fn(*args))
    from tilefuse.analyze.bench import fresh_compile

    # fresh: each epilogue's function is one code object, met at every shape of the table
    compiled = fresh_compile(fn)
    for _ in range(3):
        compiled(*args)
    comp = median_ms(lambda: compiled(*args))
    return min(eager, comp), eager, comp


def run_fused(m, n, k, scheds=(None,), baseline=True, kinds=None):
    """Each epilogue kind fused into the GEMM vs cuBLAS + the best of eager / torch.compile,
    once per schedule (None: the default), with the plain GEMM on the same schedule.
    baseline=False skips eager and torch.compile (speedup None): fused vs plain only."""
    import torch.nn.functional as F

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    rows = []
    cases = {
        "bias+gelu": (n, epi.standard(m, n, "bf16", bias="col", activation="gelu"),
                      lambda x, w, b, r, s: F.gelu(F.linear(x, w, b)), ("bias",)),
        "swiglu": (2 * n, epi.glu(m, 2 * n, "bf16"), None, ()),
        "residual": (n, epi.standard(m, n, "bf16", residual=True),
                     lambda x, w, b, r, s: F.linear(x, w) + r, ("residual",)),
        "row-scale": (n, epi.standard(m, n, "bf16", row_scale=True),
                      lambda x, w, b, r, s: F.linear(x, w) * s[:, None], ("row_scale",)),
    }
    for kind, (nn_, ep, ref_fn, extra) in cases.items():
        if kinds and kind not in kinds:
            continue
        w = torch.randn(nn_, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        b = torch.randn(nn_, device="cuda", dtype=torch.bfloat16)
        r = torch.randn(m, nn_, device="cuda", dtype=torch.bfloat16)
        s = torch.rand(m, device="cuda", dtype=torch.float32) + 0.5
        named = {"bias": b, "residual": r, "row_scale": s}
        args = {name: named[name] for name in extra}
        w_il = None
        if kind == "swiglu":
            # tilefuse: gate/up rows interleaved once; baseline: the usual [gate; up] weight
            w_std = w
            w_il = torch.stack([w_std[: nn_ // 2], w_std[nn_ // 2:]], dim=1).reshape(nn_, k).contiguous()

            def ref_fn(x, w, b, r, s):
                gate, up = F.linear(x, w).chunk(2, dim=-1)
                return F.silu(gate) * up
            base_args = (x, w_std, b, r, s)
        else:
            base_args = (x, w, b, r, s)
        ref32 = ref_fn(*(t.float() if t.dtype == torch.bfloat16 else t for t in base_args))
        lowp = ref_fn(*base_args)
        best, eager, comp = _baseline(ref_fn, *base_args) if baseline else (None, None, None)
        for sched in scheds:
            plain = compile_gemm(GemmProblem(m, nn_, k, "bf16"), sched)
            g = compile_gemm(GemmProblem(m, nn_, k, "bf16", epilogue=ep), sched)
            out = g(x, w_il) if w_il is not None else g(x, w, **args)
            torch.cuda.synchronize()
            err, base_err = rel_error(out.float(), ref32), rel_error(lowp.float(), ref32)
            ok = bool(torch.isfinite(out).all()) and err <= 2 * base_err + 1e-5
            if w_il is not None:
                t = median_ms(lambda: g(x, w_il))
            else:
                t = median_ms(lambda: g(x, w, **args))
            t_plain = median_ms(lambda: plain(x, w))
            rows.append(dict(kind=kind, m=m, n=nn_, k=k, schedule=str(g.source.schedule),
                             plain_schedule=str(plain.source.schedule), ok=ok, err=err, torch_err=base_err,
                             ms=t, plain_ms=t_plain, eager_ms=eager, compile_ms=comp,
                             speedup=best / t if best else None,
                             # the speedup were the epilogue free (the fused GEMM as fast as the
                             # plain one): the most fusion can give at this GEMM's speed
                             ceiling=best / t_plain if best else None,
                             vs_plain=t / t_plain))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def compile_all(args):
    """NVRTC needs no GPU: build this run's kernels into $TILEFUSE_CACHE_DIR ahead of time."""
    scheds = [parse_schedule(s) for s in args.schedules.split(",") if s]
    if args.fused:
        for m, n, k in FUSED_SHAPES:
            for nn_, ep in ((n, epi.standard(m, n, "bf16", bias="col", activation="gelu")),
                            (2 * n, epi.glu(m, 2 * n, "bf16")), (n, epi.standard(m, n, "bf16", residual=True)),
                            (n, epi.standard(m, n, "bf16", row_scale=True))):
                for sched in scheds or [None]:
                    compile_gemm(GemmProblem(m, nn_, k, "bf16"), sched)
                    compile_gemm(GemmProblem(m, nn_, k, "bf16", epilogue=ep), sched)
        return
    shapes = ([tuple(int(x) for x in s.split(",")) for s in args.shapes] if args.shapes else
              DECODE_SHAPES if args.decode else SHAPES)
    for m, n, k in shapes:
        prob = GemmProblem(m, n, k, "bf16", b_major=args.b_major)
        for sched in scheds or [default_schedule(prob)] + (
                [alternative(default_schedule(prob))] if args.with_alternative else []):
            try:
                compile_gemm(prob, sched)
            except Exception as e:  # noqa: BLE001 - report and go on: the timed run reports it too
                print(f"{m}x{n}x{k} {sched}: {e}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json")
    ap.add_argument("--shapes", nargs="*", help="M,N,K triples")
    ap.add_argument("--schedules", default="", help="comma-separated, e.g. 128x256s4c2,128x128s6c2m2,64x64s12c1n2d "
                    "(BMxBN s<stages> c<consumers>, then optional g<group_m> m2/n2 (2-CTA cluster along M/N) "
                    "d (direct stores) p (ping-pong) k<S> (split-K))")
    ap.add_argument("--decode", action="store_true",
                    help="decode's short-M shapes (DECODE_SHAPES: M = 1 to 64) instead of issue 4's")
    ap.add_argument("--b-major", default="K", choices=["K", "N"])
    ap.add_argument("--fused", action="store_true", help="the fused-epilogue table instead")
    ap.add_argument("--kinds", default="", help="with --fused: comma-separated epilogues to time "
                    "(bias+gelu, swiglu, residual, row-scale; default all)")
    ap.add_argument("--no-baseline", action="store_true",
                    help="with --fused: skip eager and torch.compile, time fused vs plain GEMM only")
    ap.add_argument("--with-alternative", action="store_true",
                    help="also time each default schedule's nearest alternative (a second sample)")
    ap.add_argument("--rep", type=int, default=REP_MS, help="ms of timed repetitions per measurement")
    ap.add_argument("--timing", choices=("per-call", "sustained"), default="per-call",
                    help="per-call (default): the median of single calls, L2 flushed before each; sustained: "
                         "after 0.8 s of its own calls, the time per call over --rep ms back to back")
    ap.add_argument("--tune", action="store_true",
                    help="tune each shape first (as `tilefuse tune`) and time the tuned schedule too")
    ap.add_argument("--compile-only", action="store_true",
                    help="compile (into the cubin cache) every kernel this run would time, then exit")
    args = ap.parse_args(argv)
    globals()["REP_MS"] = args.rep
    globals()["TIMING"] = args.timing
    if args.compile_only:
        compile_all(args)
        return
    if args.fused:
        fused_scheds = [parse_schedule(s) for s in args.schedules.split(",") if s] or [None]
        rows = [r for m, n, k in FUSED_SHAPES for r in run_fused(m, n, k, fused_scheds, not args.no_baseline,
                                                                      [x for x in args.kinds.split(",") if x])]
        if args.json:
            Path(args.json).write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), timing=TIMING, rows=rows),
                                                  indent=1))
        print(f"\n{torch.cuda.get_device_name()}, bf16; speedup = best of (eager, torch.compile) / fused GEMM; "
              "ceiling = that best / the plain GEMM (the speedup with a free epilogue)")
        print(f"{'epilogue':>10} {'M x N x K':>18} {'schedule':>30} {'ok':>3} {'ms':>7} {'plain':>7} {'eager':>7} "
              f"{'compile':>7} {'speedup':>8} {'ceiling':>8} {'vs plain':>8}")
        for r in rows:
            shape = f"{r['m']}x{r['n']}x{r['k']}"
            sched = r["schedule"].replace("GemmSchedule(tile ", "").replace(" consumer warpgroups", "c")
            opt = [f"{r[x]:{w}.3f}" if r[x] is not None else f"{'-':>{w}}"
                   for x, w in (("eager_ms", 7), ("compile_ms", 7), ("speedup", 8), ("ceiling", 8))]
            print(f"{r['kind']:>10} {shape:>18} {sched[:30]:>30} {'y' if r['ok'] else 'N':>3} "
                  f"{r['ms']:7.3f} {r['plain_ms']:7.3f} {' '.join(opt)} {r['vs_plain']:8.3f}")
        return
    shapes = ([tuple(int(x) for x in s.split(",")) for s in args.shapes] if args.shapes else
              DECODE_SHAPES if args.decode else SHAPES)
    scheds = [parse_schedule(s) for s in args.schedules.split(",") if s]
    rows = []
    picks = {}
    if args.tune and not scheds:
        import tuning

        # every shape tuned, and the tuner closed, before anything is timed: its compile-ahead
        # jobs would otherwise share the CPU with the timed calls
        tuner = tuning.make_tuner()
        try:
            for m, n, k in shapes:
                picks[m, n, k] = tuned(tuner, GemmProblem(m, n, k, "bf16", b_major=args.b_major))
        finally:
            tuning.close(tuner)
    for m, n, k in shapes:
        for r in run_shape(m, n, k, scheds, args.b_major, args.with_alternative, picks.get((m, n, k))):
            rows.append(r)
            print(json.dumps(r), flush=True)
    best, alt = {}, {}
    for r in rows:
        key = (r["m"], r["n"], r["k"])
        if r.get("role") in ("alternative", "tuned"):
            alt[key] = r
        elif key not in best or (scheds and r["ratio"] > best[key]["ratio"]):
            best[key] = r
    peak = max(r["cublas_tflops"] for r in rows)
    gpu = torch.cuda.get_device_name()
    if args.json:
        Path(args.json).write_text(json.dumps(dict(gpu=gpu, timing=TIMING, peak_tflops=peak, rows=rows), indent=1))
    print(f"\n{gpu}, bf16, B {args.b_major}-major; peak = best cuBLAS rate here = {peak:.0f} TFLOP/s")
    second = "tuned" if args.tune else "alt ratio"
    print(f"{'M x N x K':>17} {'schedule':>44} {'ok':>3} {'TFLOP/s':>8} {'cuBLAS':>7} {'ratio':>6} {'%peak':>6}"
          + (f" {second:>9}" if alt else ""))
    for (m, n, k), r in best.items():
        sched = r["schedule"].replace("GemmSchedule(tile ", "").replace(" consumer warpgroups", "c")
        a = alt.get((m, n, k))
        print(f"{f'{m}x{n}x{k}':>17} {sched[:44]:>44} {'y' if r['ok'] else 'N':>3} {r['tflops']:8.0f} "
              f"{r['cublas_tflops']:7.0f} {r['ratio']:6.3f} {100 * r['tflops'] / peak:6.1f}"
              + (f" {a['ratio']:9.3f}" if a else ""))
    for label, group in (("", best), ("tuned ", alt if args.tune else {})):
        ratios = [r["ratio"] for r in group.values() if r["ratio"] > 0]
        if ratios:
            print(f"{label}geomean ratio vs cuBLAS: {math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f}, "
                  f"min {min(ratios):.3f}")
    if args.tune:
        for (m, n, k), r in alt.items():
            print(f"  tuned {m}x{n}x{k}: {r['schedule']}")


if __name__ == "__main__":
    main()
