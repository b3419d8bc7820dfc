"""What a sum-of-squares partial costs a residual GEMM: the GEMM + residual epilogue as the
planner builds it, against the same epilogue that also writes sum(y^2) per row per 128
columns (EpilogueBuilder.partial_sum; what an RMSNorm after the GEMM would need), on the same
random inputs. Both default schedules (since session 18 the partials run beside the element
code and keep the plain one); CUDA events, L2 flushed by a read, 5 interleaved rounds.
Prints how far apart the two stored tiles are, and how far the partials' row sums are from
the stored row's sum of squares (the partials square y before its bf16 rounding).

    python3 bench/gemm_partials_cost.py
"""
import statistics
import torch
from tilefuse.codegen import epilogue as epi, gemm_sm90 as g
from tilefuse.runtime.gemm import compile_gemm
from tilefuse.analyze.bench import timings_ms

def res_sq(m, n):
    e = epi.EpilogueBuilder(m, n)
    y = e.op("add", e.acc(), e.load("residual", "tile", "bf16"))
    e.store("out", y, "bf16")
    e.partial_sum("sq", e.op("mul", y, y), epi.PARTIAL_WIDTH)
    return e.kernel("res_sq")

for (m, n, k) in [(8192, 2048, 2048), (8192, 2048, 5632), (8192, 4096, 11008)]:
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    r = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    plain = compile_gemm(g.GemmProblem(m, n, k, "bf16", b_major="K", epilogue=epi.standard(m, n, "bf16", residual=True)))
    part = compile_gemm(g.GemmProblem(m, n, k, "bf16", b_major="K", epilogue=res_sq(m, n)))
    out1 = plain(a, b, residual=r)
    out2 = part(a, b, residual=r)
    o2 = out2["out"] if isinstance(out2, dict) else out2
    sq = out2["sq"] if isinstance(out2, dict) else None
    diff = (out1.float() - o2.float()).abs().max().item()
    ref = (o2.float() ** 2).sum(1)
    perr = ((sq.sum(1) - ref).abs() / ref).max().item() if sq is not None else float("nan")
    per = {"residual": [], "residual+sq partials": []}
    calls = {"residual": lambda: plain(a, b, residual=r), "residual+sq partials": lambda: part(a, b, residual=r)}
    for rnd in range(5):
        for kname in (list(calls) if rnd % 2 == 0 else list(calls)[::-1]):
            per[kname].append(statistics.median(timings_ms(calls[kname], warmup=10, rep=60)) * 1e3)
    p, q = statistics.median(per["residual"]), statistics.median(per["residual+sq partials"])
    print(f"{m}x{n}x{k}: residual {p:.1f} us ({plain.schedule}); +partials {q:.1f} us ({part.schedule}); "
          f"ratio {q / p:.3f}; out diff {diff:.3g}; partial sums rel err {perr:.2g}", flush=True)
