"""Schedules of the tiled map kernel (codegen/tiles.py) side by side: the default (4 bytes of
output a thread), wider output vectors, other CTA sizes, on the same tensors in one process
(CUDA events, L2 flushed, 9 rotated rounds), each checked equal to the default's output; a
row kernel of the same maps on an input in order beside them (what the maps cost without the
transpose), and eager / torch.compile.

    python3 bench/tiles_probe.py

Writes $OUT/tiles_probe.json (or /tmp/tiles_probe.json); a line a case on stdout.
"""
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from program_schedules import beside_baselines, case_summary, launched, program_launch  # noqa: E402
import tilefuse  # noqa: E402
from tilefuse.analyze.bench import copy_bandwidth  # noqa: E402
from tilefuse.codegen import mapreduce  # noqa: E402
from tilefuse.runtime.launch import compile_kernel  # noqa: E402

CASES = {
    "map_then_transpose 64x4096x256": (lambda x: (x * 2 + 1).transpose(1, 2).contiguous(), [(64, 4096, 256)]),
    "sigmoid_transposed 64x4096x256": (lambda x: torch.sigmoid(x.transpose(1, 2)).contiguous() * 3, [(64, 4096, 256)]),
    "sigmoid_in_order 64x256x4096": (lambda x: torch.sigmoid(x) * 3, [(64, 256, 4096)]),
    "nchw_gelu 32x128x56x56": (lambda x, b: F.gelu(x.permute(0, 2, 3, 1) + b).contiguous(), [(32, 128, 56, 56), (128,)]),
    "odd 8x1000x1000": (lambda x: (x * 2 + 1).transpose(1, 2).contiguous(), [(8, 1000, 1000)]),
}


def main():
    copy = copy_bandwidth()
    out = {"gpu": torch.cuda.get_device_name(), "copy_bytes_per_s": copy, "cases": {}}
    for name, (fn, shapes) in CASES.items():
        torch.manual_seed(0)
        inputs = tuple(torch.randn(*s, device="cuda", dtype=torch.bfloat16) for s in shapes)
        prog = tilefuse.compile(fn, inputs)
        lowered, op, ptrs, outs = program_launch(prog, inputs)
        k = lowered.kernel
        d = mapreduce.default_schedule(k)
        variants = {"default": op.ck}
        if d.stage == "tiles":
            for label, s in (("vector x2", replace(d, vector=d.vector * 2)), ("vector x4", replace(d, vector=d.vector * 4)),
                             ("128 threads", replace(d, threads=128, group=128)),
                             ("512 threads", replace(d, threads=512, group=512)),
                             ("8 CTAs/SM", replace(d, min_blocks=8)),
                             ("vector x2, 8 CTAs/SM", replace(d, vector=d.vector * 2, min_blocks=8))):
                try:
                    variants[label] = compile_kernel(k, None, s)
                except ValueError as e:
                    print(f"{name} {label}: {e}")
        want = None
        for label, got in launched(variants, ptrs, outs):
            if want is None:
                want = got
            assert torch.equal(got, want), (name, label)
        per = beside_baselines(fn, inputs, variants, ptrs)
        out["cases"][name] = case_summary(name, d, inputs, outs, per, copy)
    Path(os.environ.get("OUT", "/tmp"), "tiles_probe.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
