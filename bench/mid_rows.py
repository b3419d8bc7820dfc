"""Row kernels of mid-length rows (512-6144 columns): the default schedule against another
tree's default (and, if asked, neighbouring layouts and torch.compile), on the same tensors.

    git archive REV src | tar -x -C /tmp/old
    python3 bench/mid_rows.py --against /tmp/old/src --json bench/results/s26/mid_rows_ab_h100.json
    python3 bench/mid_rows.py --cols 1024,3072 --neighbours --torch-compile

Each case is a bench/mapreduce.py program (plus add+layernorm) over `--elements` bf16
elements (rows = elements / columns). Rows: "default" (this tree's schedule), "previous"
(the default the tree at `--against` picks for the same program: computed there in a
subprocess), with `--neighbours` the default's group halved and doubled and the same
layout in registers, "copy" (x.copy_ into a preallocated tensor: the bandwidth floor for one
read and one write), with `--torch-compile` torch.compile's default mode. Every kernel's
outputs, written over NaN, are checked against eager's first. Timing: `analyze.bench.timings_ms` (CUDA events,
L2 flushed by a read) in `--rounds` rounds, the order rotated each round; each row's time is
its median over rounds. Prints a line per case; the JSON holds every round.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mapreduce  # noqa: E402

PROGRAMS = dict(mapreduce.PROGRAMS)


class AddLayerNorm(mapreduce.LayerNorm):
    def forward(self, x, res):
        h = x + res
        return h, self.ln(h)


PROGRAMS["add+layernorm"] = AddLayerNorm


def inputs_for(name, rows, cols, device="cuda"):
    if name.startswith("add+"):
        x = torch.randn(rows, cols, device=device, dtype=torch.bfloat16)
        return (x, torch.randn_like(x))
    if device == "cuda":
        return mapreduce.inputs_for(name, rows, cols)
    return tuple(t.cpu() for t in mapreduce.inputs_for(name, rows, cols))


def default_schedules(cases, arch: str = "sm_90a") -> dict:
    """{case: this tree's default schedule for `arch` as a dict}, from CPU tensors."""
    import tilefuse
    from tilefuse.codegen.mapreduce import default_schedule

    out = {}
    for case in cases:
        name, shape = case.split(":")
        R, C = (int(x) for x in shape.split("x"))
        x = torch.randn(R, C, dtype=torch.bfloat16)
        ins = (x, torch.randn_like(x)) if name.startswith("add+") else (x,)
        prog = tilefuse.compile(PROGRAMS[name](C).bfloat16(), ins)
        k = next(iter(prog.kernels.values())).kernel
        out[case] = dataclasses.asdict(default_schedule(k, arch))
    return out


def previous_defaults(src: str, cases, arch: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, str(Path(__file__).resolve().parent)]))
    res = subprocess.run([sys.executable, __file__, "--print-defaults", arch, *cases], env=env, capture_output=True,
                         text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def neighbours(s):
    from tilefuse.codegen.mapreduce import MapReduceSchedule as S

    out = [S(threads=256, group=g, vector=s.vector, stage="smem", min_blocks=4)
           for g in (s.group // 2, s.group * 2) if 16 <= g <= 256]
    return out + [S(threads=256, group=max(32, s.group), vector=s.vector, stage="regs", min_blocks=4)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--programs", default="layernorm,rmsnorm,softmax,add+rmsnorm,add+layernorm")
    ap.add_argument("--cols", default="512,768,1024,1536,2048,2560,3072,5120")
    ap.add_argument("--elements", type=int, default=1 << 25, help="elements per input (rows = elements / cols)")
    ap.add_argument("--against", help="another tree's src directory: its default schedules are timed too")
    ap.add_argument("--neighbours", action="store_true", help="also the default's neighbouring layouts")
    ap.add_argument("--torch-compile", action="store_true", help="also torch.compile (default mode)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    import tilefuse
    from program_schedules import program_launch
    from tilefuse.analyze.bench import fresh_compile, timings_ms
    from tilefuse.codegen.mapreduce import MapReduceSchedule
    from tilefuse.runtime.launch import CudaError, compile_kernel

    cases = [f"{n}:{args.elements // int(c)}x{c}" for c in args.cols.split(",") for n in args.programs.split(",")]
    from tilefuse.runtime.nvrtc import current_arch

    prev = previous_defaults(args.against, cases, current_arch()) if args.against else {}
    results = []
    for case in cases:
        name, shape = case.split(":")
        R, C = (int(v) for v in shape.split("x"))
        module = PROGRAMS[name](C).cuda().bfloat16()
        inputs = inputs_for(name, R, C)
        prog = tilefuse.compile(module, inputs)
        eager = module(*inputs)
        eager = [eager] if isinstance(eager, torch.Tensor) else list(eager)
        lowered, op, ptrs, outs = program_launch(prog, inputs)
        rows = {"default": op.ck.source.schedule}
        if case in prev:
            rows["previous"] = MapReduceSchedule(**prev[case])
        if args.neighbours:
            rows.update((f"neighbour {i}", s) for i, s in enumerate(neighbours(rows["default"])))
        calls, scheds = {}, {}
        for label, s in rows.items():
            same = next((k for k, v in scheds.items() if v == s), None)
            if same:  # the same schedule as an earlier row: timed once, reported under both
                scheds[label] = s
                continue
            try:
                ck = compile_kernel(lowered.kernel, schedule=s)
                for o in outs:
                    o.fill_(float("nan"))
                ck.launch_ptrs(0, ptrs)
                torch.cuda.synchronize()
            except (ValueError, CudaError) as e:
                print(f"  {case} {label} {s}: skipped ({e})", flush=True)
                continue
            for o, w in zip(outs, eager):  # every output against eager's (bf16: a few ulps at most)
                err = (o.float() - w.float()).abs().max().item()
                if not err <= 0.05 * w.float().abs().max().item():  # NaN fails too
                    raise SystemExit(f"{case} {label} {s}: differs from eager's output (max {err:.3g})")
            scheds[label] = s
            calls[label] = (lambda ck=ck: ck.launch_ptrs(0, ptrs))
        y = torch.empty_like(inputs[0])
        calls["copy"] = lambda: y.copy_(inputs[0])
        if args.torch_compile:
            compiled = fresh_compile(module)
            compiled(*inputs)
            calls["torch.compile"] = lambda: compiled(*inputs)
        keys = list(calls)
        per = {k: [] for k in keys}
        for rnd in range(args.rounds):
            for k in keys[rnd % len(keys):] + keys[:rnd % len(keys)]:
                per[k].append(statistics.median(timings_ms(calls[k], warmup=5, rep=30)) * 1e3)
        us = {k: statistics.median(v) for k, v in per.items()}
        for label, s in scheds.items():  # rows sharing a schedule share its time
            if label not in us:
                us[label] = us[next(k for k, v in scheds.items() if v == s and k in us)]
        line = f"{name:14s} {R:6d} x {C:5d}  default {us['default']:7.2f} us"
        if "previous" in us:
            line += f"  previous {us['previous']:7.2f} ({us['previous'] / us['default']:.3f}x)"
        if "torch.compile" in us:
            line += f"  torch.compile {us['torch.compile']:7.2f} ({us['torch.compile'] / us['default']:.3f}x)"
        best = min((k for k in us if k not in ("copy", "torch.compile")), key=us.get)
        line += f"  copy {us['copy']:6.2f}  best: {best}"
        print(line, flush=True)
        results.append({"case": case, "us": us, "rounds": per, "schedules": {k: str(v) for k, v in scheds.items()}})
        if args.json:
            Path(args.json).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                                   "rounds": args.rounds, "results": results}, indent=1))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--print-defaults"]:  # --print-defaults ARCH CASE...: run by previous_defaults
        print(json.dumps(default_schedules(sys.argv[3:], sys.argv[2])))
    else:
        with torch.no_grad():
            main()
