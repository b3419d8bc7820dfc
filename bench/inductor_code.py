"""Side by side for one bench/mapreduce.py case: the Triton code torch.compile generates and the
CUDA tilefuse generates, each launched a few times, for reading and for Nsight Compute.

    python3 bench/inductor_code.py rmsnorm:16384x8192 --out DIR
    ncu --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum,\\
        dram__bytes_write.sum,launch__grid_size,launch__block_size,launch__registers_per_thread \\
        python3 bench/inductor_code.py rmsnorm:16384x8192 --launches 3

Writes DIR/<case>.inductor.py (every source torch.compile produced, the launch configuration
included) and DIR/<case>.tilefuse.cu (each kernel's CUDA with its schedule). Used to find what
torch.compile's kernel does differently where it is ahead (bench/LOG.md).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mapreduce import PROGRAMS, inputs_for  # noqa: E402

import tilefuse  # noqa: E402
from tilefuse.analyze.bench import fresh_compile  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cases", nargs="+", help="name:RxC, as bench/mapreduce.py --cases")
    ap.add_argument("--out", default=None, help="write the generated sources here")
    ap.add_argument("--launches", type=int, default=3, help="launches of each compiled program after warm-up")
    args = ap.parse_args()
    from torch._inductor.utils import run_and_get_code

    for case in args.cases:
        name, shape = case.split(":")
        rows, cols = (int(x) for x in shape.split("x"))
        module = PROGRAMS[name](cols).cuda().bfloat16()
        inputs = inputs_for(name, rows, cols)
        compiled = fresh_compile(module)  # (what a user compiling at this shape gets)
        _, codes = run_and_get_code(compiled, *inputs)
        prog = tilefuse.compile(module, inputs)
        prog(*inputs)
        torch.cuda.synchronize()
        stem = case.replace(":", "_")
        if args.out:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / f"{stem}.inductor.py").write_text("\n\n# ----\n\n".join(codes))
            cu = []
            for key, ck in prog._compiled.items():
                src = getattr(ck, "source", None)
                cu.append(f"// {key[0]}: {getattr(src, 'schedule', '')}\n{getattr(src, 'source', '')}")
            (out / f"{stem}.tilefuse.cu").write_text("\n\n".join(cu))
        for _ in range(args.launches):
            compiled(*inputs)
            prog(*inputs)
        torch.cuda.synchronize()
        print(f"{case}: tilefuse {[str(getattr(ck.source, 'schedule', '')) for ck in prog._compiled.values()]}",
              flush=True)


if __name__ == "__main__":
    main()
