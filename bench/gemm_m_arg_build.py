"""NVRTC time of GEMMs taking M as an argument against the same kernels with M baked
(`m_arg=False`): one compile each, alternating, twice, no cubin cache. (The GPU machine's
NVRTC gives a source it compiled before in this process back in ~0.04 s: there, only each
variant's first time measures a build.)

    python3 bench/gemm_m_arg_build.py [M,N,K[,kind] ...]     # kinds as bench/gemm_m_arg_ab.py
"""
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gemm_m_arg_ab import case  # noqa: E402

from tilefuse.codegen import gemm_sm90 as g  # noqa: E402
from tilefuse.runtime import nvrtc  # noqa: E402

SHAPES = ["3000,4096,4096", "3000,4096,4096,residual", "3000,22016,4096,swiglu", "3000,4096,11008,rmsnorm",
          "1500,4096,4096"]


def main():
    for text in sys.argv[1:] or SHAPES:
        p, _ = case(text)
        s = g.default_schedule(p)
        times = {"baked": [], "arg": []}
        for lab in ("baked", "arg", "arg", "baked"):
            src = g._render(replace(p, m_arg=False) if lab == "baked" else p, s)
            t = time.perf_counter()
            nvrtc.compile_cuda(src.source, src.name, "sm_90a")
            times[lab].append(time.perf_counter() - t)
        print(f"{text:26s} baked {' '.join(f'{x:5.2f}' for x in times['baked'])} s  "
              f"arg {' '.join(f'{x:5.2f}' for x in times['arg'])} s  {s}", flush=True)


if __name__ == "__main__":
    main()
