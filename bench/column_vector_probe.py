"""Would a column kernel that gives each thread V neighbouring rows (one vector load of V
elements a column) beat today's row a thread (2-byte loads, a warp reading 64 bytes a column)?
A probe, not a feature: hand-written kernels for `x.mean(1)` over [B, S, D] bf16, each thread
taking V neighbouring outputs d and every G-th s (G threads a warp apart, partials met in
shared memory), timed beside tilefuse's program, eager and torch.compile on the same tensors
(CUDA events, L2 flushed by a read, medians of 3 rotated rounds).

    python3 bench/column_vector_probe.py [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import statistics

import cupy as cp
import torch

import tilefuse
from tilefuse.analyze.bench import fresh_compile, timings_ms

SHAPES = [(16, 512, 4096), (64, 512, 1024), (8, 2048, 4096), (256, 128, 2048)]
VECTOR = {1: "unsigned short", 2: "unsigned", 4: "uint2", 8: "uint4"}


def source(V: int, G: int, S: int, D: int) -> str:
    words = max(1, V // 2)
    U = min(S // G, (32 if G < 32 else 16) // words)
    return f"""
extern "C" __global__ void __launch_bounds__({32 * G})
colmean(const unsigned short* __restrict__ x, unsigned short* __restrict__ out, int groups) {{
  const int lane = threadIdx.x % 32, y = threadIdx.x / 32;
  const int g = blockIdx.x * 32 + lane;  // this thread's V outputs: d0 .. d0 + V - 1 of batch b
  const bool ok = g < groups;
  const long long b = g / ({D // V}), d0 = (long long)(g % {D // V}) * {V};
  const {VECTOR[V]}* p = (const {VECTOR[V]}*)(x + b * {S * D}LL + d0);
  float acc[{V}];
  #pragma unroll
  for (int k = 0; k < {V}; ++k) acc[k] = 0.0f;
  // U loads in flight a thread, then their sums
  for (int j0 = 0; j0 < {S // G}; j0 += {U}) {{
    unsigned w[{U}][{words}];
    #pragma unroll
    for (int u = 0; u < {U}; ++u) {{
      const int s = y + (j0 + u) * {G};
      if (ok) {{ *({VECTOR[V]}*)w[u] = __ldg(p + (long long)s * {D // V}); }} else {{ w[u][0] = 0; }}
    }}
    #pragma unroll
    for (int u = 0; u < {U}; ++u) {{
      #pragma unroll
      for (int k = 0; k < {V}; ++k) {{
        const unsigned e = w[u][k / 2];
        acc[k] += __uint_as_float((k & 1) ? (e & 0xffff0000u) : (e << 16));
      }}
    }}
  }}
  __shared__ float red[{G}][{V}][32];
  #pragma unroll
  for (int k = 0; k < {V}; ++k) red[y][k][lane] = acc[k];
  __syncthreads();
  if (y < {V} && ok) {{  // thread (lane, y) finishes output d0 + y
    float t = 0.0f;
    #pragma unroll
    for (int i = 0; i < {G}; ++i) t += red[i][y][lane];
    t *= {1.0 / S!r}f;
    unsigned short h; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(t));
    out[b * {D} + d0 + y] = h;
  }}
  if ({V} > {G} && ok && y == 0) {{
    for (int k = {G}; k < {V}; ++k) {{
      float t = 0.0f;
      for (int i = 0; i < {G}; ++i) t += red[i][k][lane];
      t *= {1.0 / S!r}f;
      unsigned short h; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(t));
      out[b * {D} + d0 + k] = h;
    }}
  }}
}}
"""


def median_us(fn) -> float:
    return statistics.median(timings_ms(fn, warmup=10, rep=40)) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    a = ap.parse_args()
    gpu = torch.cuda.get_device_name()
    results = []
    for B, S, D in SHAPES:
        x = torch.randn(B, S, D, device="cuda", dtype=torch.bfloat16)
        want = x.float().mean(1)
        fn = lambda t: t.mean(1)  # noqa: E731
        prog = tilefuse.compile(fn, (x,))
        tc = fresh_compile(fn)
        tc(x)
        calls = {"tilefuse": lambda: prog(x), "eager": lambda: fn(x), "torch.compile": lambda: tc(x)}
        out = torch.empty(B, D, device="cuda", dtype=torch.bfloat16)
        for V in (1, 2, 4, 8):
            for G in (4, 8, 16, 32):
                if S // G < 2 or S % G:
                    continue
                k = cp.RawKernel(source(V, G, S, D), "colmean", options=("-arch=sm_90a", "-std=c++17"))
                groups = B * D // V
                grid = ((groups + 31) // 32,)
                out.fill_(float("nan"))

                def launch(k=k, grid=grid, G=G, groups=groups):
                    k(grid, (32 * G,), (cp.uint64(x.data_ptr()), cp.uint64(out.data_ptr()), cp.int32(groups)))

                launch()
                torch.cuda.synchronize()
                err = (out.float() - want).abs().max().item()
                if not err < 0.02:
                    raise SystemExit(f"V{V} G{G} at {B}x{S}x{D}: max |diff| {err}")
                calls[f"V{V}G{G}"] = launch
        per = {n: [] for n in calls}
        names = list(calls)
        for rnd in range(3):
            for n in names[rnd % len(names):] + names[:rnd % len(names)]:
                per[n].append(median_us(calls[n]))
        row = {"shape": [B, S, D], "us": {n: statistics.median(v) for n, v in per.items()}}
        results.append(row)
        us = row["us"]
        best = min((n for n in us if n.startswith("V")), key=us.get)
        print(f"{B}x{S}x{D}: tilefuse {us['tilefuse']:.1f} t.c {us['torch.compile']:.1f} eager {us['eager']:.1f}"
              f"  best probe {best} {us[best]:.1f}  V1 best {min(v for n, v in us.items() if n.startswith('V1G')):.1f}",
              flush=True)
        print("   " + "  ".join(f"{n} {v:.1f}" for n, v in us.items() if n.startswith("V")), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"gpu": gpu, "rows": results}, f, indent=1)


if __name__ == "__main__":
    with torch.no_grad():
        main()
