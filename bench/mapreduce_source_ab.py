"""A one-kernel bench/mapreduce.py program's kernel as this tree renders it against the same
kernel as another revision rendered it: same launch, same tensors, interleaved rounds of
CUDA-event timings (L2 flushed by a read), 7 rounds, alternating which goes first.

On the CPU, with the old revision's `src` first on PYTHONPATH (e.g. `git archive REV src |
tar -x -C /tmp/old`), save its default kernels' sources:

    PYTHONPATH=/tmp/old/src python3 bench/mapreduce_source_ab.py dump old.json layernorm:16384x8192

then, in this tree on the GPU:

    python3 bench/mapreduce_source_ab.py run old.json layernorm:16384x8192

Each kernel's output is compared with the program's first (the max difference is printed:
a different reduction order may round differently); then "AB case: new .. us, old .. us".
The dump keeps each source's launch (grid, block, shared memory, cluster): until session 53 the
old source was launched with this tree's, which is wrong wherever the two trees' default
schedules differ. (That was not what put session 52's LayerNorm 32768 x 256 "old" row 11.7 off
the program: the two sources there differ only by the compensated mean, on the same launch.
Not understood.)
"""
import dataclasses
import json
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

def dump(path, cases):
    import torch
    from mapreduce import PROGRAMS
    import tilefuse
    from tilefuse.codegen import mapreduce as mr
    out = {}
    for case in cases:
        name, shape = case.split(":")
        R, C = (int(v) for v in shape.split("x"))
        module = PROGRAMS[name](C).bfloat16()
        x = torch.randn(R, C, dtype=torch.bfloat16)
        inputs = {"add+rmsnorm": (x, torch.randn_like(x)),
                  "cross_entropy": (x, torch.randint(0, C, (R,)))}.get(name, (x,))
        prog = tilefuse.compile(module, inputs)
        k = next(iter(prog.kernels.values())).kernel
        src = mr.render(k, mr.default_schedule(k, "sm_90a"), "sm_90a")
        # the launch the source was rendered for: its schedule may differ from this tree's
        out[case] = {"source": src.source, "grid": src.grid, "block": src.block, "smem_bytes": src.smem_bytes,
                     "cluster": src.cluster, "params": src.params, "workspace_bytes": src.workspace_bytes}
    Path(path).write_text(json.dumps(out))

def run(path, cases):
    import torch
    from program_schedules import program_case
    from tilefuse.analyze.bench import timings_ms
    from tilefuse.runtime import cache
    from tilefuse.runtime.launch import CompiledKernel, compile_kernel
    old = json.loads(Path(path).read_text())
    for case in cases:
        R = int(case.split(":")[1].split("x")[0])
        _, _, wants, lowered, _, ptrs, outs = program_case(case)
        want = wants[-1]
        new = compile_kernel(lowered.kernel)
        src = new.source
        saved = old[case] if isinstance(old[case], dict) else {"source": old[case]}  # (files before session 53: text)
        osrc_text = saved["source"]
        if "grid" not in saved:
            print(f"{case}: the saved source has no launch shape; the old kernel is launched with this tree's "
                  f"(wrong where the schedules differ: dump it again)", flush=True)
        if tuple(saved.get("params", src.params)) != tuple(src.params):
            raise SystemExit(f"{case}: the old kernel takes {saved['params']}, this tree's {src.params}: not one launch")
        # the old source's entry point (its name may differ: a source taking its row count as an
        # argument is named by its text), and whether it takes the count (a trailing `int tf_rows`)
        oname, oparams = re.search(r'extern "C" __global__ void __launch_bounds__\([^)]*\)\n(\w+)\(([^)]*)\)', osrc_text).groups()
        orows = R if "tf_rows" in oparams else None
        cub, _ = cache.compile_cached(osrc_text, oname, new.arch)
        shape = {f: tuple(saved[f]) if isinstance(saved[f], list) else saved[f]
                 for f in ("grid", "block", "smem_bytes", "cluster", "workspace_bytes") if f in saved}
        oldk = CompiledKernel(kernel=lowered.kernel, arch=new.arch,
                              source=dataclasses.replace(src, source=osrc_text, name=oname, rows=orows, **shape),
                              cubin=cub, cache_hit=False)
        for label, ck in (("new", new), ("old", oldk)):
            outs[-1].fill_(float("nan")); ck.launch_ptrs(0, ptrs); torch.cuda.synchronize()
            err = (outs[-1].float() - want.float()).abs().max().item()
            print(f"{case} {label}: max |diff| vs program {err:.3g}, regs {ck.cubin.info.registers}", flush=True)
        per = {"new": [], "old": []}
        calls = {"new": lambda: new.launch_ptrs(0, ptrs), "old": lambda: oldk.launch_ptrs(0, ptrs)}
        for rnd in range(7):
            for lab in (("new", "old") if rnd % 2 == 0 else ("old", "new")):
                per[lab].append(statistics.median(timings_ms(calls[lab], warmup=10, rep=50)) * 1e3)
        n, o = statistics.median(per["new"]), statistics.median(per["old"])
        print(f"AB {case}: new {n:.2f} us, old {o:.2f} us, new/old {n / o:.4f}  rounds new {[round(x,2) for x in per['new']]} old {[round(x,2) for x in per['old']]}", flush=True)

if __name__ == "__main__":
    cmd, path, *cases = sys.argv[1:]
    if cmd == "dump":
        dump(path, cases)
    else:
        with __import__("torch").no_grad():
            run(path, cases)
