"""Would loading a row kernel's column vectors (a norm's weight and bias) together with the row,
before its reductions, instead of in the output pass after them, be faster? A probe, not a
feature: the rendered CUDA is edited as text (each `<name>_c` chunk load of the map pass
becomes a read of `<name>_h[j]`, loaded above the first reduction) and timed against the
source as rendered, under four layouts, on the program's own tensors, with torch.compile and
a copy beside them (7 rotated rounds, CUDA events, L2 flushed).

    python3 bench/column_loads_probe.py layernorm:16384x1024 rmsnorm:16384x1024

Writes $OUT/hoist.json (or /tmp/hoist.json). Session 26: 0 to 3% on LayerNorm at 1024
columns depending on the layout (bench/LOG.md, results/s26/column_loads_hoisted_h100.json).
"""
import dataclasses, re, statistics, sys, json, os
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parent))
from mapreduce import PROGRAMS, inputs_for
from program_schedules import program_launch
import tilefuse
from tilefuse.analyze.bench import fresh_compile, timings_ms
from tilefuse.runtime import cache
from tilefuse.runtime.launch import CompiledKernel, compile_kernel
from tilefuse.codegen.mapreduce import MapReduceSchedule as S

LOAD = re.compile(r"^(\s*)unsigned (\w+)_c\[(\d+)\];\n\s*if \(row_ok\) \{ (tf_ld\d+)\(\2_c \+ 0, ([^;]*)\); \} else \{[^\n]*\}\n", re.M)

def hoist(src):
    m = re.search(r"for \(int j = 0; j < (\d+); \+\+j\) \{\n\s*const int c0 = \(p \+ j \* (\d+)\) \* (\d+);", src)
    nch = int(m.group(1))
    marker = "  // ---- row values that depend on no reduction"
    if marker not in src:
        marker = src[src.index("  // ---- reduce"):].split("\n")[0]
    # only loads in the map pass (after the last reduction): those of weights
    head, tail = src.split("// ---- map over the row", 1)
    loads = {}
    def sub(mm):
        ind, name, w, fn, addr = mm.groups()
        loads[name] = (w, fn, addr)
        return f"{ind}const unsigned* {name}_c = {name}_h[j];\n"
    tail = LOAD.sub(sub, tail)
    pre = ""
    for name, (w, fn, addr) in loads.items():
        pre += (f"  unsigned {name}_h[{nch}][{w}];\n  #pragma unroll\n  for (int j = 0; j < {nch}; ++j) {{\n"
                f"    const int c0 = (p + j * {m.group(2)}) * {m.group(3)};\n"
                f"    if (row_ok) {{ {fn}({name}_h[j], {addr}); }} else {{ " + " ".join(f"{name}_h[j][{i}] = 0u;" for i in range(int(w))) + " }\n  }\n")
    head = head.replace(marker, pre + marker, 1)
    return head + "// ---- map over the row" + tail, list(loads)

def main():
    cases = sys.argv[1:]
    res = []
    for case in cases:
        name, shape = case.split(":")
        R, C = (int(v) for v in shape.split("x"))
        module = PROGRAMS[name](C).cuda().bfloat16()
        inputs = inputs_for(name, R, C)
        prog = tilefuse.compile(module, inputs)
        want = prog(*inputs); want = want if isinstance(want, torch.Tensor) else want[-1]
        lowered, op, ptrs, outs = program_launch(prog, inputs)
        base = op.ck.source.schedule
        scheds = [base, S(threads=128, group=64, vector=8, min_blocks=8), S(threads=128, group=32, vector=8, min_blocks=8),
                  S(threads=256, group=32, vector=8, min_blocks=4)]
        calls = {}
        for s in scheds:
            try:
                ck = compile_kernel(lowered.kernel, schedule=s)
            except ValueError as e:
                print("skip", s, e); continue
            hs, names = hoist(ck.source.source)
            cub, _ = cache.compile_cached(hs, ck.source.name, ck.arch)
            hk = CompiledKernel(kernel=lowered.kernel, arch=ck.arch, source=dataclasses.replace(ck.source, source=hs), cubin=cub, cache_hit=False)
            for lab, k in ((str(s), ck), (str(s) + " HOIST " + ",".join(names), hk)):
                outs[-1].fill_(float("nan")); k.launch_ptrs(0, ptrs); torch.cuda.synchronize()
                err = (outs[-1].float() - want.float()).abs().max().item()
                print(f"{case} {lab}: err {err:.3g} regs {k.cubin.info.registers} spills {k.cubin.info.spill_stores}", flush=True)
                assert err <= 0.05 * want.float().abs().max().item()
                calls[lab] = (lambda k=k: k.launch_ptrs(0, ptrs))
        compiled = fresh_compile(module); compiled(*inputs)
        calls["torch.compile"] = lambda: compiled(*inputs)
        y = torch.empty_like(inputs[0]); calls["copy"] = lambda: y.copy_(inputs[0])
        keys = list(calls); per = {k: [] for k in keys}
        for rnd in range(7):
            for k in keys[rnd % len(keys):] + keys[:rnd % len(keys)]:
                per[k].append(statistics.median(timings_ms(calls[k], warmup=10, rep=50)) * 1e3)
        tc = statistics.median(per["torch.compile"])
        print(f"\n{case}")
        rows = sorted(((statistics.median(v), k) for k, v in per.items()))
        for us, k in rows:
            print(f"  {us:8.2f} us {tc/us:.3f}x t.c.  {k}")
        res.append({"case": case, "rows": {k: v for k, v in per.items()}})
        Path(os.environ.get("OUT", "/tmp") + "/hoist.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "results": res}, indent=1))

with torch.no_grad():
    main()
