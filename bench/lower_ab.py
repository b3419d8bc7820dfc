"""What a new prompt length costs on the host before any kernel is built, as the backend pays it.

    python3 bench/lower_ab.py [--src DIR] [--model llama|qwen2|gpt2] [--layers 32] [--hidden 256]
                              [--gc natural|off]

A random transformers model (bf16) is exported once with a symbolic sequence length, as the
torch.compile backend does; then, for five new lengths, the export is instanced at the length
(`Symbolic.instance`) and compiled for sm_90a (`compile_stages`: capture, rewrites, plan,
lowering), each timed. `--src` takes another tree's src/ (to compare two versions, run one
process each, alternating). `--gc off` collects before and turns the collector off around each
timing (the spread left is the machine's); `natural` (the default) leaves Python's collector as
a user's process has it. Prints the minimum and median of each stage. No GPU needed.
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", default=str(HERE.parent / "src"))
    ap.add_argument("--model", default="llama", choices=("llama", "qwen2", "gpt2"))
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--gc", default="natural", choices=("natural", "off"))
    args = ap.parse_args()
    sys.path.insert(0, args.src)
    import torch
    from torch.export import Dim

    from tilefuse.compiler import compile_stages
    from tilefuse.frontend.capture import export
    from tilefuse.frontend.sizes import Symbolic
    from tilefuse.models import hf

    torch.manual_seed(0)
    cfg = hf.config(args.model, args.layers, args.hidden, seq=512)
    model = hf.CausalLM(hf.causal_lm(cfg).to(torch.bfloat16).eval())
    ids = torch.randint(0, cfg.vocab_size, (1, 128))
    with torch.no_grad():
        sym = Symbolic(export(model, (ids,), dynamic_shapes=({1: Dim.AUTO},)))
    state = dict(model.state_dict(keep_vars=True))
    inst_t, low_t = [], []
    with torch.no_grad():
        for seq in (64, 96, 80, 72, 88):
            ids = torch.randint(0, cfg.vocab_size, (1, seq))
            if args.gc == "off":
                gc.collect()
                gc.disable()
            t0 = time.perf_counter()
            inst = sym.instance((ids,), state)
            t1 = time.perf_counter()
            compile_stages(model, (ids,), arch="sm_90a", exported=inst)
            t2 = time.perf_counter()
            if args.gc == "off":
                gc.enable()
            inst_t.append(t1 - t0)
            low_t.append(t2 - t1)
    med = len(inst_t) // 2
    print(f"{args.src} {args.model} L{args.layers}: instance min {min(inst_t):.3f} median {sorted(inst_t)[med]:.3f}; "
          f"lower min {min(low_t):.3f} median {sorted(low_t)[med]:.3f}")


if __name__ == "__main__":
    main()
