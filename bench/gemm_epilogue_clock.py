"""Cycles a GEMM's consumer warpgroups spend per tile in the main loop and in the epilogue,
counted by clock64 in an edited copy of the default kernel (stores in place: defer_stores=False,
so the epilogue is one stretch of code):

    python3 bench/gemm_epilogue_clock.py 8192,4096,4096 8192,4096,4096,gelu

Per tile and warpgroup: main (from the tile's start to the last wgmma's retirement), epilogue
(from there to the tile's end), and the wait for the tile's first stage. The edited kernel must
give the same bits as the unedited one. Three launches per case; the GPU's clock is whatever it
runs at (the counts are cycles, not time). Session 15: the plain store 2,050 cycles a tile
(3% of a 128x256x4096 tile), bias+GELU 8,700.
"""
import dataclasses
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from tilefuse.codegen import epilogue as epi, gemm_sm90 as g  # noqa: E402
from tilefuse.runtime import cache  # noqa: E402
from tilefuse.runtime.gemm import GemmKernel, compile_gemm  # noqa: E402


def instrument(s: str) -> str:
    def rep(a, b):
        nonlocal s
        if s.count(a) != 1:
            raise SystemExit(f"the kernel's source no longer has one {a!r}: update this script")
        s = s.replace(a, b)
    rep('extern "C" __global__', '__device__ unsigned long long tf_prof[4];\nextern "C" __global__')
    rep("    unsigned ep_slot = 0;", "    unsigned ep_slot = 0;\n    long long tf_pm = 0, tf_pe = 0, tf_pf = 0; int tf_pn = 0;")
    rep("      int prev = -1;\n", "      int prev = -1;\n      long long tf_c0 = clock64(); bool tf_f = true;\n")
    rep("        tf_bar_wait(bars + 8 * stage, phase);\n        const unsigned sa",
        "        tf_bar_wait(bars + 8 * stage, phase);\n        if (tf_f) { tf_pf += clock64() - tf_c0; tf_f = false; }\n"
        "        const unsigned sa")
    rep("      tf_wgmma_wait<0>();\n", "      tf_wgmma_wait<0>();\n      long long tf_c1 = clock64(); tf_pm += tf_c1 - tf_c0;\n")
    rep("    }\n    if (tid == 0) tf_bulk_wait_read<0>();",
        "      tf_pe += clock64() - tf_c1; ++tf_pn;\n    }\n    if (tid == 0) { atomicAdd(&tf_prof[0], (unsigned long long)tf_pm); "
        "atomicAdd(&tf_prof[1], (unsigned long long)tf_pe); atomicAdd(&tf_prof[2], (unsigned long long)tf_pf); "
        "atomicAdd(&tf_prof[3], (unsigned long long)tf_pn); }\n    if (tid == 0) tf_bulk_wait_read<0>();")
    return s


def main(cases: list[str]) -> None:
    from cuda.bindings import driver

    for case in cases:
        m, n, k, *rest = case.split(",")
        m, n, k = int(m), int(n), int(k)
        ep = epi.standard(m, n, "bf16", bias="col", activation="gelu") if rest == ["gelu"] else None
        p = g.GemmProblem(m, n, k, epilogue=ep)
        kk = compile_gemm(p, dataclasses.replace(g.default_schedule(p), defer_stores=False))
        src = dataclasses.replace(kk.source, source=instrument(kk.source.source))
        cubin, hit = cache.compile_cached(src.source, src.name, "sm_90a")
        kp = GemmKernel(src, cubin, hit)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        ops = {b.name: torch.randn(b.shape, device="cuda", dtype=torch.bfloat16) for b in (epi.operands(ep) if ep else ())}
        if not torch.equal(kp(x, w, **ops), kk(x, w, **ops)):
            raise SystemExit(f"{case}: the instrumented kernel gives other bits")
        torch.cuda.synchronize()
        _, dptr, _ = driver.cuModuleGetGlobal(kp._loaded[0][0], b"tf_prof")
        for _ in range(3):
            driver.cuMemsetD8(dptr, 0, 32)
            kp(x, w, **ops)
            torch.cuda.synchronize()
            buf = np.zeros(4, dtype=np.uint64)
            driver.cuMemcpyDtoH(buf.ctypes.data, dptr, 32)
            pm, pe, pf, pn = (int(v) for v in buf)
            print(f"{case}: per tile per warpgroup: main {pm / pn:,.0f} cycles, epilogue {pe / pn:,.0f} "
                  f"({100 * pe / (pm + pe):.1f}%), first stage {pf / pn:,.0f}; {pn} warpgroup tiles")


if __name__ == "__main__":
    main(sys.argv[1:] or ["8192,4096,4096", "8192,4096,4096,gelu"])
