"""Would storing add+RMSNorm's h = x + res in the pass that reduces it (as soon as each chunk
is computed) instead of in the output pass, beside the normed output, be faster? A probe,
not a feature: the rendered CUDA is edited as text (the rounded sum is packed and stored in
the reduction's chunk loop; the output pass no longer stores it) and timed against the
source as rendered, under the default layout and a row per 64 threads, on the program's own
tensors, with torch.compile beside them (9 rotated rounds, CUDA events, L2 flushed). The
edit expects the default smem-staged kernels at 1024 columns (at 768 its pattern is not
found and the probe stops).

    python3 bench/early_store_probe.py add+rmsnorm:16384x1024 add+rmsnorm:32768x1024

Writes $OUT/early.json (or /tmp/early.json). Session 26: 1.4-2.4% faster under the default
layout (bench/LOG.md, results/s26/add_rmsnorm_early_store_h100.json).
"""
import re, statistics, sys, json, os
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parent))
from program_schedules import program_case, rotated_rounds, with_source
from tilefuse.analyze.bench import fresh_compile
from tilefuse.runtime.launch import compile_kernel
from tilefuse.codegen.mapreduce import MapReduceSchedule as S

def early(src):
    head, tail = src.split("// ---- map over the row", 1)
    rd = head.rindex("// ---- reduce")
    pre, red = head[:rd], head[rd:]
    m = re.search(r"const float (v_c\d+) = tf_round_bf16\((v_v\d+)\);\n", red)
    assert m, "no rounded add in the reduce pass"
    red = red.replace(m.group(0), m.group(0) + f"      tf_put_bf16(add_e, v, {m.group(1)});\n", 1)
    i = red.index("    #pragma unroll\n    for (int v = 0; v < 8; ++v) {")
    red = red[:i] + "    unsigned add_e[4] = {0u, 0u, 0u, 0u};\n" + red[i:]
    # close of the v loop inside the j loop of the reduce pass: the first "    }\n  }\n" after i
    k = red.index("\n    }\n  }\n", i)
    red = red[:k] + "\n    }\n    if (row_ok) { tf_st16(g_add + b_add + c0, add_e + 0); }\n  }\n" + red[k + len("\n    }\n  }\n"):]
    tail = re.sub(r"\s*tf_put_bf16\(add_o, v, v_c\d+\);", "", tail)
    tail = re.sub(r"\n\s*if \(row_ok\) \{ tf_st16\(g_add \+ b_add \+ c0, add_o \+ 0\); \}", "", tail)
    tail = tail.replace("    unsigned add_o[4] = {0u, 0u, 0u, 0u};\n", "")
    return pre + red + "// ---- map over the row" + tail

def main():
    res = []
    for case in sys.argv[1:]:
        module, inputs, want, lowered, op, ptrs, outs = program_case(case)
        base = op.ck.source.schedule
        calls = {}
        for s in [base, S(threads=256, group=64, vector=8, stage="smem", min_blocks=4)]:
            ck = compile_kernel(lowered.kernel, schedule=s)
            ek = with_source(ck, early(ck.source.source))
            for lab, k in ((str(s), ck), (str(s) + " EARLY", ek)):
                for o in outs: o.fill_(float("nan"))
                k.launch_ptrs(0, ptrs); torch.cuda.synchronize()
                errs = [(o.float() - w.float()).abs().max().item() for o, w in zip(outs, want)]
                print(case, lab, "errs", errs, "regs", k.cubin.info.registers, flush=True)
                assert all(e <= 0.05 for e in errs), errs
                calls[lab] = (lambda k=k: k.launch_ptrs(0, ptrs))
        compiled = fresh_compile(module); compiled(*inputs)
        calls["torch.compile"] = lambda: compiled(*inputs)
        per = rotated_rounds(calls)
        tc = statistics.median(per["torch.compile"])
        print(f"\n{case}")
        for us, k in sorted((statistics.median(v), k) for k, v in per.items()):
            print(f"  {us:8.2f} us {tc/us:.3f}x t.c.  {k}")
        res.append({"case": case, "rounds": per})
        Path(os.environ.get("OUT", "/tmp") + "/early.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "results": res}, indent=1))

with torch.no_grad():
    main()
