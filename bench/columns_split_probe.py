"""Probe: what layout reads a reduction over a dim that is not last at copy speed?

Hand-written CUDA (not tilefuse's kernels), to choose the column kernel's next layout before
building it. x is [B, C, D] bf16, reduced over C (x.sum(1)); a row is (b, d), C elements
D apart. Each CTA covers TX * V neighbouring rows of one b; a thread takes V neighbouring
rows (one V * 2-byte load a column), and the CTA's G warps-rows (threadIdx.y) split the row's
C elements between them, combining through shared memory. (V, G) = (1, 1) is today's column
kernel (a row a thread); G > 1 raises the threads a row, V > 1 widens the loads.

    python3 bench/columns_split_probe.py          # on a GPU; a line a (case, layout), best last

Writes $OUT/columns_split_probe.json (or /tmp/...).
"""
import json
import os
import sys
from pathlib import Path

import cupy
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from tilefuse.analyze.bench import copy_bandwidth, median_ms  # noqa: E402

SRC = r"""
#include <cuda_bf16.h>
template <int V, int G, int TX, int U>
__global__ void __launch_bounds__(TX * G) colsum(const __nv_bfloat16* __restrict__ x,
                                                 __nv_bfloat16* __restrict__ y, int C, int D) {
  __shared__ float part[G > 1 ? G : 1][TX * V];
  const int rows_cta = TX * V;
  const long long row0 = (long long)blockIdx.x * rows_cta;      // first row (b, d) of this CTA
  const long long b = row0 / D, d0 = row0 % D + threadIdx.x * V;
  const __nv_bfloat16* base = x + b * (long long)C * D + d0;
  float acc[V];
#pragma unroll
  for (int v = 0; v < V; ++v) acc[v] = 0.f;
  int c = threadIdx.y;
  for (; c + (U - 1) * G < C; c += U * G) {
    __nv_bfloat16 buf[U][V];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const __nv_bfloat16* p = base + (long long)(c + u * G) * D;
      if constexpr (V == 8) *reinterpret_cast<uint4*>(buf[u]) = __ldg(reinterpret_cast<const uint4*>(p));
      else if constexpr (V == 4) *reinterpret_cast<uint2*>(buf[u]) = __ldg(reinterpret_cast<const uint2*>(p));
      else if constexpr (V == 2) *reinterpret_cast<unsigned*>(buf[u]) = __ldg(reinterpret_cast<const unsigned*>(p));
      else buf[u][0] = p[0];
    }
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int v = 0; v < V; ++v) acc[v] += __bfloat162float(buf[u][v]);
  }
  for (; c < C; c += G) {
    const __nv_bfloat16* p = base + (long long)c * D;
#pragma unroll
    for (int v = 0; v < V; ++v) acc[v] += __bfloat162float(p[v]);
  }
  if constexpr (G > 1) {
#pragma unroll
    for (int v = 0; v < V; ++v) part[threadIdx.y][threadIdx.x * V + v] = acc[v];
    __syncthreads();
    if (threadIdx.y != 0) return;
#pragma unroll
    for (int v = 0; v < V; ++v) {
      float s = 0.f;
#pragma unroll
      for (int g = 0; g < G; ++g) s += part[g][threadIdx.x * V + v];
      acc[v] = s;
    }
  }
  __nv_bfloat16 out[V];
#pragma unroll
  for (int v = 0; v < V; ++v) out[v] = __float2bfloat16(acc[v]);
  __nv_bfloat16* q = y + b * (long long)D + d0;
#pragma unroll
  for (int v = 0; v < V; ++v) q[v] = out[v];
}
"""

CASES = {  # name: (B, C, D)
    "mean dim 1 64x512x1024": (64, 512, 1024),
    "amax-sized 16x256x4096": (16, 256, 4096),
    "LN-sized 32x96x3136": (32, 96, 3136),
    "few rows 1x1000x16384 (log_softmax dim 0)": (1, 1000, 16384),
    "few rows 1x4096x4096 (x.sum(0))": (1, 4096, 4096),
}
LAYOUTS = [  # (V, G, TX, U)
    (1, 1, 128, 32), (1, 2, 64, 16), (1, 4, 32, 16), (1, 8, 32, 8),
    (2, 1, 128, 16), (2, 4, 32, 16), (2, 8, 32, 8),
    (4, 1, 64, 16), (4, 4, 32, 8), (4, 8, 32, 8), (4, 16, 32, 4),
    (8, 1, 32, 8), (8, 4, 32, 8), (8, 8, 32, 4), (8, 16, 16, 4), (8, 32, 8, 4),
]


def main():
    names = [f"colsum<{v}, {g}, {tx}, {u}>" for v, g, tx, u in LAYOUTS]
    mod = cupy.RawModule(code=SRC, options=("-std=c++17", "--use_fast_math"), name_expressions=names)
    gpu = torch.cuda.get_device_name()
    copy_bps = copy_bandwidth()
    rows = []
    for case, (B, C, D) in CASES.items():
        x = torch.randn(B, C, D, device="cuda", dtype=torch.bfloat16)
        ref = x.float().sum(1)
        nbytes = x.numel() * 2 + B * D * 2
        t_torch = median_ms(lambda: x.sum(1))
        line = [f"{case}: torch.sum {t_torch * 1e3:.1f} us ({nbytes / (t_torch * 1e-3) / copy_bps:.0%})"]
        res = {"case": case, "shape": [B, C, D], "torch_us": t_torch * 1e3, "layouts": []}
        for (v, g, tx, u), nm in zip(LAYOUTS, names):
            rows_cta = tx * v
            if D % rows_cta:
                continue
            y = torch.full((B, D), float("nan"), device="cuda", dtype=torch.bfloat16)
            fn = mod.get_function(nm)
            grid = (B * D // rows_cta,)
            args = (x.data_ptr(), y.data_ptr(), cupy.int32(C), cupy.int32(D))
            call = lambda: fn(grid, (tx, g), args)  # noqa: E731
            call()
            torch.cuda.synchronize()
            err = ((y.float() - ref).abs() / (ref.abs() + 1)).max().item()
            ok = err < 0.02
            t = median_ms(call)
            frac = nbytes / (t * 1e-3) / copy_bps
            res["layouts"].append({"V": v, "G": g, "TX": tx, "U": u, "us": t * 1e3, "copy_frac": frac, "ok": ok})
        best = min(res["layouts"], key=lambda r: r["us"])
        for r in res["layouts"]:
            line.append(f"  V{r['V']} G{r['G']} TX{r['TX']} U{r['U']}: {r['us']:.1f} us {r['copy_frac']:.0%}"
                        + ("" if r["ok"] else " WRONG"))
        line.append(f"  best V{best['V']} G{best['G']} TX{best['TX']}: {best['us']:.1f} us ({best['copy_frac']:.0%}),"
                    f" torch {res['torch_us']:.1f}")
        print("\n".join(line), flush=True)
        rows.append(res)
    out = Path(os.environ.get("OUT", "/tmp")) / "columns_split_probe.json"
    out.write_text(json.dumps({"gpu": gpu, "copy_Bps": copy_bps, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
