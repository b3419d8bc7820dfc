"""Host time, per-call and sustained GPU time of fused GEMMs, called directly and as CUDA graphs.

    python3 bench/fused_host_probe.py

8192 x 11008 x 4096, bf16: the plain GEMM, residual and bias+GELU epilogues, cuBLAS and cuBLAS +
residual, each also captured in a CUDA graph (no host time); 2 rounds. Session 23 asked
whether `bench/gemm.py --fused --timing sustained` was host-bound (it was not: 5-54 us of host
time a call against ~1 ms of GPU time). Prints one line per measurement.
"""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
import torch
from tilefuse.analyze.bench import host_us, sustained_ms, median_ms
from tilefuse.codegen import epilogue as epi
from tilefuse.codegen.gemm_sm90 import GemmProblem
from tilefuse.runtime.gemm import compile_gemm
import torch.nn.functional as F
m, n, k = 8192, 11008, 4096
x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
r = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
plain = compile_gemm(GemmProblem(m, n, k, "bf16"), None)
res = compile_gemm(GemmProblem(m, n, k, "bf16", epilogue=epi.standard(m, n, "bf16", residual=True)), None)
gelu = compile_gemm(GemmProblem(m, n, k, "bf16", epilogue=epi.standard(m, n, "bf16", bias="col", activation="gelu")), None)
fns = {"plain": lambda: plain(x, w), "residual": lambda: res(x, w, residual=r), "bias+gelu": lambda: gelu(x, w, bias=b),
       "cublas": lambda: F.linear(x, w), "cublas+res": lambda: F.linear(x, w) + r}
graphs = {}
for name, f in fns.items():
    f(); torch.cuda.synchronize()
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        f()
    graphs[name + "[graph]"] = g.replay
allf = {**fns, **graphs}
for rnd in range(2):
    for name, f in allf.items():
        print(f"{rnd} {name:18} host {host_us(f, reps=20):7.1f} us  per-call {median_ms(f)*1e3:7.1f} us  sustained {sustained_ms(f, 0.4, 0.8)*1e3:7.1f} us", flush=True)
