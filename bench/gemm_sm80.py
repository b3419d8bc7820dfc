"""tilefuse's sm_80 GEMM (mma.sync + cp.async + ldmatrix) vs cuBLAS (torch.matmul) and vs
tilefuse's sm_90a GEMM, bf16, x @ W.T (B K-major), on whatever GPU this runs on.

    python3 bench/gemm_sm80.py [--json out.json] [--shapes 4096,4096,4096 ...]
        [--schedules 128x128x32s4w2x2,...]        # first one listed = "default" column
    python3 bench/gemm_sm80.py --precompile sm_90a  # fill the cubin cache only (no GPU needed)

The run also measures the ceiling this path is under: mma.sync m16n8k16 (bf16, f32
accumulate) issued back to back from registers by every SM, no memory traffic at all
("mma.sync peak"); each kernel's rate is reported as a fraction of it and of cuBLAS's.

Random normal inputs; every result is checked against a float32 reference (2x rule) before
it is timed. Times are medians of CUDA-event timings (triton.testing.do_bench); each
shape's kernels are timed back to back in one run, cuBLAS first. TFLOP/s counts 2*M*N*K.
Prints a table last.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from tilefuse.codegen.gemm_sm80 import Sm80Schedule, default_schedule  # noqa: E402
from tilefuse.codegen.gemm_sm90 import GemmProblem  # noqa: E402

SHAPES = [(4096, 4096, 4096), (8192, 4096, 4096)]
SCHEDULES = ["default", "128x128x32s4w2x2", "128x256x32s3w2x4", "256x128x32s3w4x2", "128x128x64s3w2x2",
             "128x256x64s3w2x4", "256x128x64s3w4x2", "128x128x32s5w2x2", "64x128x32s4w2x2"]


def parse_schedule(text: str, problem: GemmProblem) -> Sm80Schedule:
    """'128x256x32s3w2x4' -> tile 128x256x32, 3 stages, warps 2x4 (g<G>: group_m); 'default'."""
    if text == "default":
        return default_schedule(problem)
    m = re.fullmatch(r"(\d+)x(\d+)x(\d+)s(\d+)w(\d+)x(\d+)(?:g(\d+))?", text)
    if not m:
        raise SystemExit(f"bad schedule {text!r}; want like 128x256x32s3w2x4 (g8: group_m)")
    bm, bn, bk, s, wm, wn, gm = m.groups()
    return Sm80Schedule(int(bm), int(bn), int(bk), int(s), int(wm), int(wn), int(gm or 8))


PEAK_ITERS, PEAK_CHAINS, PEAK_THREADS = 2048, 8, 256


def _peak_source() -> tuple[str, str]:
    """A kernel that only issues mma.sync (PEAK_CHAINS independent accumulators per warp)."""
    from tilefuse.codegen import gemm_sm80

    name = "tf_mma_sync_peak"
    src = gemm_sm80._mma_fn("bf16") + f"""
extern "C" __global__ void __launch_bounds__({PEAK_THREADS}) {name}(float* out, int iters) {{
  const unsigned one = 0x3f803f80u ^ (threadIdx.x & 1u);   // bf16 pairs near 1.0
  const unsigned a[4] = {{one, one, one, one}}, b[2] = {{one, one}};
  float acc[{PEAK_CHAINS}][4] = {{}};
  for (int i = 0; i < iters; ++i) {{
    #pragma unroll
    for (int j = 0; j < {PEAK_CHAINS}; ++j) tf_mma(acc[j], a, b);
  }}
  float s = 0.f;
  #pragma unroll
  for (int j = 0; j < {PEAK_CHAINS}; ++j) s += acc[j][0] + acc[j][1] + acc[j][2] + acc[j][3];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}}
"""
    return name, src


def mma_peak_tflops(arch: str) -> float:
    """Dense mma.sync m16n8k16 bf16 rate of this GPU, TFLOP/s (median of CUDA events)."""
    import ctypes

    import torch
    from cuda.bindings import driver

    from tilefuse.runtime import cache
    from tilefuse.runtime.launch import _drv, _raw_stream

    name, src = _peak_source()
    cubin, _ = cache.compile_cached(src, name, arch)
    torch.zeros(1, device="cuda")  # the primary context
    module = _drv(driver.cuModuleLoadData(cubin.data), "cuModuleLoadData")
    func = _drv(driver.cuModuleGetFunction(module, name.encode()), "cuModuleGetFunction")
    blocks = torch.cuda.get_device_properties(0).multi_processor_count * 8
    out = torch.empty(blocks * PEAK_THREADS, device="cuda")
    ptr, iters = ctypes.c_void_p(out.data_ptr()), ctypes.c_int(PEAK_ITERS)
    params = (ctypes.c_void_p * 2)(ctypes.addressof(ptr), ctypes.addressof(iters))

    def run():
        err = driver.cuLaunchKernel(func, blocks, 1, 1, PEAK_THREADS, 1, 1, 0,
                                    driver.CUstream(_raw_stream(0)), ctypes.addressof(params), 0)
        _drv(err, "launch of the mma.sync peak kernel")

    ms = median_ms(run)
    flops = blocks * PEAK_THREADS // 32 * PEAK_ITERS * PEAK_CHAINS * 16 * 8 * 16 * 2
    return flops / ms / 1e9


def median_ms(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=150, return_mode="median")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=[",".join(map(str, s)) for s in SHAPES])
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("--no-sm90", action="store_true", help="skip the sm_90a kernel column")
    ap.add_argument("--json")
    ap.add_argument("--precompile", metavar="ARCH", help="only fill the cubin cache for ARCH")
    args = ap.parse_args()
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes]
    names = args.schedules.split(",")

    if args.precompile:
        from tilefuse.codegen import gemm_sm90
        from tilefuse.runtime import cache
        from tilefuse.runtime.gemm_sm80 import precompile

        items = [(GemmProblem(*s), parse_schedule(n, GemmProblem(*s)), args.precompile) for s in shapes for n in names]
        t = time.time()
        precompile(items)
        if not args.no_sm90 and args.precompile in ("sm_90", "sm_90a"):
            for s in shapes:
                src = gemm_sm90.render(GemmProblem(*s))
                cache.compile_cached(src.source, src.name, "sm_90a")
        from tilefuse.runtime import cache as _c

        _c.compile_cached(_peak_source()[1], _peak_source()[0], args.precompile)
        print(f"compiled {len(items)} sm_80-style kernels for {args.precompile} in {time.time() - t:.1f} s")
        return

    import torch

    from tilefuse.check import rel_error
    from tilefuse.runtime.gemm import compile_gemm
    from tilefuse.runtime.gemm_sm80 import compile_gemm_sm80

    gpu = torch.cuda.get_device_name()
    from tilefuse.runtime import nvrtc

    peak = mma_peak_tflops(nvrtc.current_arch())
    print(f"mma.sync m16n8k16 bf16 peak (registers only): {peak:.0f} TFLOP/s", flush=True)
    rows = []
    for (m, n, k) in shapes:
        p = GemmProblem(m, n, k, "bf16")
        flops = 2 * m * n * k
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        ref = a.float() @ w.float().T
        base = rel_error((a @ w.T).float(), ref)
        t_cublas = median_ms(lambda: a @ w.T)
        kernels = []
        if not args.no_sm90 and torch.cuda.get_device_capability() >= (9, 0):
            kernels.append(("sm90 default", compile_gemm(p)))
        for name in names:
            kernels.append((f"sm80 {name}" if name != "default" else f"sm80 default ({default_schedule(p)})",
                            compile_gemm_sm80(p, parse_schedule(name, p))))
        for label, g in kernels:
            out = g(a, w)
            torch.cuda.synchronize()
            err = rel_error(out.float(), ref)
            ok = bool(torch.isfinite(out).all()) and err <= 2 * base + 1e-5
            t = median_ms(lambda: g(a, w)) if ok else float("nan")
            regs = g.info.registers
            rows.append(dict(gpu=gpu, m=m, n=n, k=k, kernel=label, ok=ok, err=err, torch_err=base, ms=t,
                             tflops=flops / t / 1e9, cublas_ms=t_cublas, cublas_tflops=flops / t_cublas / 1e9,
                             ratio_vs_cublas=t_cublas / t, registers=regs,
                             of_mma_sync_peak=flops / t / 1e9 / peak))
            print(f"{m}x{n}x{k} {label:<58} {'ok ' if ok else 'BAD'} {t:7.3f} ms {flops / t / 1e9:6.0f} TFLOP/s "
                  f"{t_cublas / t:5.2f}x cuBLAS ({t_cublas:.3f} ms, {flops / t_cublas / 1e9:.0f} TFLOP/s) regs {regs}",
                  flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(gpu=gpu, torch=torch.__version__, mma_sync_peak_tflops=peak,
                                                   rows=rows), indent=1))
    print(f"\n{gpu}: bf16 x @ W.T, median of CUDA events; ratio = cuBLAS time / ours (same run)")
    print(f"mma.sync peak measured in this run: {peak:.0f} TFLOP/s")
    print(f"{'shape':<16} {'kernel':<58} {'ms':>8} {'TFLOP/s':>8} {'vs cuBLAS':>9} {'of mma.sync peak':>16}")
    for r in rows:
        print(f"{r['m']}x{r['n']}x{r['k']:<6} {r['kernel']:<58} {r['ms']:8.3f} {r['tflops']:8.0f} "
              f"{r['ratio_vs_cublas']:8.2f}x {r['of_mma_sync_peak']:15.0%}")
    for (m, n, k) in shapes:
        r = next(r for r in rows if (r["m"], r["n"], r["k"]) == (m, n, k))
        print(f"{m}x{n}x{k:<6} {'cuBLAS (torch.matmul)':<58} {r['cublas_ms']:8.3f} {r['cublas_tflops']:8.0f}")


if __name__ == "__main__":
    main()
