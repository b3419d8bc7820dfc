"""Hash every kernel tilefuse renders for a fixed set of programs, to show that a refactor
changes no plan or generated code (CPU only; no GPU needed).

    PYTHONPATH=/tmp/old/src python3 bench/render_hashes.py /tmp/old.json   # git archive REV src | tar -x -C /tmp/old
    python3 bench/render_hashes.py /tmp/new.json
    python3 bench/render_hashes.py --diff /tmp/old.json /tmp/new.json

Programs: tests/cpu/test_lower.py's PROGRAMS at three shapes in f32 and bf16, a Llama block, a
2-layer Llama, and HF Llama, Qwen2 and GPT-2 (2 layers, logits and loss). For each map-reduce
kernel the hash covers its Loop IR and its CUDA for sm_90a and sm_80 under the default (or
tuned) schedule; for each GEMM, its epilogue's Loop IR. Session 24: 206 kernels.
"""
import hashlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def hashes() -> dict:
    import torch

    sys.path.insert(0, str(ROOT / "tests" / "cpu"))
    from test_lower import PROGRAMS

    from tilefuse.codegen.mapreduce import render
    from tilefuse.compiler import compile_stages
    from tilefuse.models import hf
    from tilefuse.models.llama import llama, llama_block
    from tilefuse.tune.lookup import choose

    out = {}

    def record(tag, c):
        for name, lk in c.program.kernels.items():
            txt = str(lk.kernel)
            for arch in ("sm_90a", "sm_80"):
                try:
                    txt += render(lk.kernel, choose(lk.kernel, arch).schedule, arch=arch).source
                except Exception as e:  # a kernel one target declines: its refusal is part of the output
                    txt += "ERR " + type(e).__name__
            out[f"{tag}/{name}"] = hashlib.sha1(txt.encode()).hexdigest()
        for name, lg in (c.program.gemms or {}).items():
            out[f"{tag}/{name}/epi"] = hashlib.sha1(str(lg.epilogue).encode()).hexdigest()

    torch.manual_seed(0)
    for pname, (mk, mkin) in PROGRAMS.items():
        for rows, cols in [(3, 1000), (7, 4097), (5, 256)]:
            for dt in (torch.float32, torch.bfloat16):
                record(f"{pname}:{rows}x{cols}:{dt}", compile_stages(mk(cols, dt), tuple(mkin(rows, cols, dt))))
    b = llama_block(256, 688, 4).to(torch.bfloat16)
    record("block", compile_stages(b, (torch.randn(2, 64, 256, dtype=torch.bfloat16),)))
    m = llama(1000, 2, 256, 688, 4).to(torch.bfloat16)
    record("llama", compile_stages(m, (torch.randint(0, 1000, (2, 64)),)))
    for name in ("llama", "qwen2", "gpt2"):
        for o in ("logits", "loss"):
            built = hf.build(name, 2, 64, 16, 2, torch.bfloat16, output=o)
            record(f"hf_{name}_{o}", compile_stages(built.model, built.inputs))
    return out


def main(argv):
    if argv[:1] == ["--diff"]:
        a, b = (json.loads(Path(p).read_text()) for p in argv[1:3])
        changed = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
        print(f"{len(a)} / {len(b)} kernels; {len(changed)} differ")
        for k in changed:
            print("  ", k)
        return 1 if changed else 0
    if len(argv) != 1 or argv[0].startswith("-"):  # (`--help` is no output path)
        raise SystemExit(__doc__)
    out = hashes()
    Path(argv[0]).write_text(json.dumps(out, indent=0, sort_keys=True))
    print(len(out), "kernels")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
