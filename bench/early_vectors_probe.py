"""Would loading a norm's column vectors (LayerNorm's weight and bias, RMSNorm's weight) before
the row's reduction, instead of in the output pass after it, make short rows faster? A probe,
not a feature: the rendered CUDA is edited as text (`hoist`: each row's vector chunks loaded
into registers ahead of its reduction, where their latency hides under the row's own loads;
the output pass reads the registers) and timed against the source as rendered, on the
program's own tensors, with torch.compile beside them (9 rotated rounds, CUDA events, L2
flushed). Session 46 saw LayerNorm 32768 x 256 at 0.951x torch.compile on an H200 with the
tuner's whole space no better (12.56 against 12.70 us): in the rendered kernel each row's
vector loads wait for its shuffle tree, a load latency on every row's critical path.

    python3 bench/early_vectors_probe.py layernorm:32768x256 add+rmsnorm:32768x256 rmsnorm:32768x256 \
        layernorm:32768x4096

Writes $OUT/early_vectors.json (or /tmp/early_vectors.json). Predicted: a few percent at 256
columns (one L2 or L1 round trip out of a row's ~2 us life), nothing at long rows.
"""
import json
import os
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

def hoist(src: str) -> str:
    """`src` with each row block's output-pass column-vector loads moved ahead of its reduction
    (ValueError where the kernel has no such loads, or not in the form this edit knows)."""
    marks = list(re.finditer(r"^( *)// ---- map over the row[^\n]*\n", src, re.M))
    if not marks:
        raise ValueError("no output pass ('map over the row') in this kernel")
    done = 0
    for mark in reversed(marks):
        ind = mark.group(1)
        red = src.rindex(f"{ind}// ---- reduce", 0, mark.start())
        loop = re.compile(rf"{ind}#pragma unroll\n{ind}for \(int j = 0; j < (\d+); \+\+j\) \{{\n"
                          rf"{ind}  (const int c0 = [^\n]*;)[^\n]*\n").match(src, mark.end())
        if loop is None:
            raise ValueError("the output pass is not one unrolled loop over the row's chunks")
        end = src.find(f"\n{ind}}}\n", loop.end())  # the j loop's close (its body is indented further)
        body = src[loop.end():end]
        loads = list(re.finditer(rf"{ind}  unsigned (\w+)_c\[(\d+)\];\n{ind}  if \(row_ok\) \{{ (tf_ld\d+)"
                                 rf"\(\1_c \+ 0, (g_\1 \+ b_\1 \+ c0)\); \}} else \{{ [^}}]* \}}\n", body))
        if not loads:
            continue
        n, c0 = loop.group(1), loop.group(2)
        pre = "".join(f"{ind}unsigned {m.group(1)}_h[{n}][{m.group(2)}];\n" for m in loads)
        pre += (f"{ind}#pragma unroll\n{ind}for (int j = 0; j < {n}; ++j) {{  // the vectors first "
                f"(early_vectors_probe)\n{ind}  {c0}\n")
        for m in loads:
            b, words, ld, addr = m.groups()
            zero = " ".join(f"{b}_h[j][{i}] = 0u;" for i in range(int(words)))
            pre += f"{ind}  if (row_ok) {{ {ld}({b}_h[j], {addr}); }} else {{ {zero} }}\n"
        pre += f"{ind}}}\n"
        for m in loads:
            body = body.replace(m.group(0), f"{ind}  const unsigned* {m.group(1)}_c = {m.group(1)}_h[j];\n")
        src = src[:red] + pre + src[red:loop.end()] + body + src[end:]
        done += 1
    if not done:
        raise ValueError("no column vector is loaded in the output pass")
    return src


def main():
    import torch
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from program_schedules import program_case, rotated_rounds, with_source

    from tilefuse.analyze.bench import fresh_compile
    from tilefuse.runtime.launch import compile_kernel

    res = []
    for case in sys.argv[1:]:
        module, inputs, want, lowered, op, ptrs, outs = program_case(case)
        ck = compile_kernel(lowered.kernel, schedule=op.ck.source.schedule)
        try:
            es = hoist(ck.source.source)
        except ValueError as e:
            print(f"{case}: {e}; skipped", flush=True)
            continue
        ek = with_source(ck, es)
        calls, got = {}, {}
        for lab, k in (("as rendered", ck), ("vectors first", ek)):
            for o in outs:
                o.fill_(float("nan"))
            k.launch_ptrs(0, ptrs)
            torch.cuda.synchronize()
            got[lab] = [o.clone() for o in outs]
            # (the program's outputs in its own order: each kernel output against those of its size)
            diff = max(min((o.float().flatten() - w.float().flatten()).abs().max().item()
                           for w in want if w.numel() == o.numel()) for o in outs)
            print(case, lab, "| max |difference| from the program's output:", diff, "| shapes",
                  [tuple(o.shape) for o in outs], [tuple(w.shape) for w in want], "| regs", k.cubin.info.registers,
                  "spills", k.cubin.info.spill_stores, flush=True)
            calls[lab] = (lambda k=k: k.launch_ptrs(0, ptrs))
        # the edit moves loads, not arithmetic: the same bits, whatever the program's own launch gave
        assert all(torch.equal(a, b) for a, b in zip(got["as rendered"], got["vectors first"])), \
            f"{case}: the hoisted source's outputs differ from the rendered one's"
        compiled = fresh_compile(module)
        compiled(*inputs)
        calls["torch.compile"] = lambda: compiled(*inputs)
        per = rotated_rounds(calls)
        tc = statistics.median(per["torch.compile"])
        print(f"\n{case}  ({ck.source.schedule})")
        for us, k in sorted((statistics.median(v), k) for k, v in per.items()):
            print(f"  {us:8.2f} us {tc / us:.3f}x t.c.  {k}")
        res.append({"case": case, "schedule": str(ck.source.schedule), "rounds_us": per})
        Path(os.environ.get("OUT", "/tmp") + "/early_vectors.json").write_text(
            json.dumps({"gpu": torch.cuda.get_device_name(), "results": res}, indent=1))


if __name__ == "__main__":
    import torch

    with torch.no_grad():
        main()
