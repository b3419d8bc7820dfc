"""Where a residual epilogue's cost goes: the default residual GEMM's source edited four ways,
each timed by Nsight Compute beside the plain GEMM (one launch each from idle, two rounds):

    ncu --clock-control none --csv --metrics gpu__time_duration.sum,sm__cycles_elapsed.avg,\\
        smsp__inst_executed.sum,dram__bytes_read.sum -k regex:tf_gemm \\
        python3 bench/gemm_residual_diag.py 8192,2048,2048 > run.csv
    python3 bench/ncu_table.py run.csv --labels "$(cat labels.txt)" --sep ' '

- res_l2: every row reads the residual of rows m % 128 (512 KB that stay in L2): the same
  loads, none from DRAM;
- res_noload: the loaded word replaced by a value made from (m, n): the epilogue's arithmetic
  without its loads (the output is wrong, and is not checked);
- res_pfstart / res_pfmid: each consumer thread prefetches its rows of the tile's residual to
  L2 (evict_last) at the start / the middle of the tile's main loop (checked: same bits).

For the register-load epilogue (the edits look for its pair loads: use shapes whose default
does not take the residual by TMA, or see gemm_residual_ab.py for that). Labels go to
$OUT/labels.txt (or ./labels.txt), space-separated.
"""
import dataclasses
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from tilefuse.codegen import epilogue as epi, gemm_sm90 as g  # noqa: E402
from tilefuse.codegen.gemm_sm90 import GemmProblem  # noqa: E402
from tilefuse.runtime import cache  # noqa: E402
from tilefuse.runtime.gemm import GemmKernel, compile_gemm  # noqa: E402


def variant(src, fn):
    new = fn(src.source)
    assert new != src.source
    s2 = dataclasses.replace(src, source=new)
    cub, hit = cache.compile_cached(s2.source, s2.name, "sm_90a")
    return GemmKernel(s2, cub, hit)


def pf(where, N):
    code = ("{ const int pr = tm * BM + c * 64 + tid / 2; const int pc = tn * BN + (tid % 2) * 128;\n"
            "  for (int q = 0; q < 2; ++q) asm volatile(\"prefetch.global.L2::evict_last [%0];\" :: "
            f"\"l\"(residual + (long long)pr * {N} + pc + q * 64)); }}\n")
    def f(s):
        if where == "start":
            return s.replace("      int prev = -1;\n", "      int prev = -1;\n" + code, 1)
        return s.replace("        if (kt == K_ITERS - 1) {\n", f"        if (kt == K_ITERS / 2) {code}        if (kt == K_ITERS - 1) {{\n", 1)
    return f

labels = []
for spec in sys.argv[1:]:
    m, n, k = (int(v) for v in spec.split(","))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    r = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    ep = epi.standard(m, n, "bf16", residual=True)
    base = compile_gemm(GemmProblem(m, n, k, epilogue=ep), g.default_schedule(GemmProblem(m, n, k)))
    src = base.source
    load = f"*(const unsigned*)(residual + (m) * {n}LL + n)"
    assert load in src.source, "load pattern"
    ks = {"plain": compile_gemm(GemmProblem(m, n, k)), "res": base,
          "res_l2": variant(src, lambda s: s.replace(f"(residual + (m) * {n}LL", f"(residual + ((m) & 127) * {n}LL")),
          "res_noload": variant(src, lambda s: s.replace(load, "(unsigned)(m * 2048 + n)")),
          "res_pfstart": variant(src, pf("start", n)),
          "res_pfmid": variant(src, pf("mid", n))}
    ref = base(x, w, residual=r)
    for name in ("res_pfstart", "res_pfmid"):
        assert torch.equal(ks[name](x, w, residual=r), ref), name
    torch.cuda.synchronize()
    labels += [f"{spec}:check-{nm}" for nm in ("res", "pfstart", "pfmid")]
    for _ in range(2):
        for name, f in ks.items():
            f(x, w) if name == "plain" else f(x, w, residual=r)
            torch.cuda.synchronize()
            labels.append(f"{spec}:{name}")
Path(os.environ.get("OUT", "."), "labels.txt").write_text(" ".join(labels))
print("ok", file=sys.stderr)
