"""Launch fixture map-reduce kernels once each (default schedule), for Nsight Compute.

    ncu --clock-control none --section SpeedOfLight --section Occupancy --section LaunchStats \\
        --metrics dram__bytes_read.sum,dram__bytes_write.sum -k regex:'rmsnorm|softmax' \\
        python3 bench/mapreduce_ncu.py rmsnorm:4096x65536 softmax:8192x262144

Each kernel is launched once, on random normal inputs; --clock-control none leaves the GPU's clocks as they are (the measurements are of the card
as found). Prints each kernel's schedule.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "cpu"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import loop_fixtures as fx  # noqa: E402
from mapreduce_kernels import make_inputs  # noqa: E402

from tilefuse import dtypes  # noqa: E402
from tilefuse.runtime.launch import compile_kernel  # noqa: E402


def main(cases: list[str]) -> None:
    for case in cases:
        name, shape = case.split(":")
        R, C = (int(x) for x in shape.split("x"))
        kernel = fx.BUILDERS[name](R, C, "bf16")
        ck = compile_kernel(kernel)
        inputs = make_inputs(kernel)
        outs = {b.name: torch.empty(b.shape, dtype=dtypes.to_torch(b.dtype), device="cuda") for b in kernel.outputs}
        args = [inputs[b.name] if b.role == "in" else outs[b.name] for b in kernel.params]
        ck(*args)  # the module is loaded before the launch, outside what ncu measures
        torch.cuda.synchronize()
        print(f"{name} {R}x{C}: {ck.source.schedule}, {ck.info.registers} registers, grid {ck.source.grid}", flush=True)
        del inputs, outs, args
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:])
