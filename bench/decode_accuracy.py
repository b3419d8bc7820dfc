"""Decode-step logits of a random Llama through torch.compile(backend="tilefuse"), teacher-forced,
against float32 eager (DESIGN.md's 2x rule, step by step).

    python3 bench/decode_accuracy.py [--layers 8 --hidden 4096 --prompt 128 --new 16] [--json out.json]
                                     [--device cpu]

Greedy bf16 generation parts ways with eager's tokens at a near tie of the two best logits, and
a random model's logits are flat, so a count of equal tokens cannot tell rounding from a fault.
This script feeds every mode the same tokens (eager bf16's greedy choices) one step at a time
through a transformers DynamicCache, as `generate` does, and compares each step's logits:
- float32 eager: the reference;
- bf16 eager: the error the 2x rule allows twice of;
- bf16 tilefuse: prefill, then one-token decode steps (the M = 1 GEMMs, split-K and all).
It reports each step's error of both against the reference, the worst ratio, the top-1
agreement with the reference, and at every step where tilefuse's top token differs from eager
bf16's, the reference's margin between those two tokens (a near tie is a margin of about the
bf16 error). Prints a table last; the JSON carries the GPU's name.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", default="cuda", help="cpu: check the script (kernels run in the interpreter)")
    args = ap.parse_args()

    import torch

    sys.path.insert(0, os.environ.get("TILEFUSE_SRC", str(HERE.parent / "src")))
    from tilefuse.check import rel_error
    from tilefuse.frontend.backend import tilefuse_backend  # (the "tilefuse" name needs the package installed)
    from tilefuse.models import hf
    import transformers

    torch.manual_seed(0)
    cfg = hf.config("llama", args.layers, args.hidden, seq=args.prompt + args.new + 8)
    cfg.use_cache = True
    ref_model = hf.causal_lm(cfg).to(args.device, torch.float32).eval()
    bf16 = copy.deepcopy(ref_model).to(torch.bfloat16)
    compiled = copy.deepcopy(bf16)
    compiled.forward = torch.compile(compiled.forward, backend=tilefuse_backend)
    ids = torch.randint(0, cfg.vocab_size, (1, args.prompt), device=args.device)

    with torch.no_grad():
        seq = bf16.generate(ids, max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False,
                            pad_token_id=0)

        def step_logits(model):
            """Logits of the last position after the prompt and after each fed token."""
            cache = transformers.DynamicCache(config=cfg)
            out = model(input_ids=seq[:, :args.prompt], past_key_values=cache, use_cache=True)
            logits = [out.logits[0, -1].float()]
            for t in range(args.prompt, seq.shape[1] - 1):
                out = model(input_ids=seq[:, t:t + 1], past_key_values=cache, use_cache=True)
                logits.append(out.logits[0, -1].float())
            return logits

        ref, low, tf = step_logits(ref_model), step_logits(bf16), step_logits(compiled)

    rows = []
    for i, (r, lo, x) in enumerate(zip(ref, low, tf)):
        e_low, e_tf = rel_error(lo, r), rel_error(x, r)
        top_low, top_tf, top_ref = int(lo.argmax()), int(x.argmax()), int(r.argmax())
        rows.append({"step": i, "err_bf16_eager": e_low, "err_tilefuse": e_tf, "ratio": e_tf / e_low if e_low else None,
                     "passes_2x": e_tf <= 2 * e_low + 1e-5, "top_ref": top_ref, "top_bf16_eager": top_low,
                     "top_tilefuse": top_tf,
                     # how far apart the reference puts the two modes' choices, over its logits' scale
                     "ref_margin_rel": float((r[top_low] - r[top_tf]).abs() / r.std()) if top_low != top_tf else None})
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    result = {"gpu": gpu, "torch": torch.__version__, "transformers": transformers.__version__,
              "args": vars(args), "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"{gpu}: llama {args.layers} layers, hidden {args.hidden}, prompt {args.prompt}, {args.new} steps "
          f"teacher-forced on eager bf16's tokens; logits vs float32 eager")
    print(f"{'step':>4} {'err bf16 eager':>15} {'err tilefuse':>13} {'ratio':>6} {'2x':>3} "
          f"{'top ref/eager/tf':>22} {'ref margin':>10}")
    for r in rows:
        margin = "" if r["ref_margin_rel"] is None else f"{r['ref_margin_rel']:.4f}"
        print(f"{r['step']:>4} {r['err_bf16_eager']:15.3e} {r['err_tilefuse']:13.3e} {r['ratio']:6.2f} "
              f"{'y' if r['passes_2x'] else 'N':>3} {r['top_ref']:>6}/{r['top_bf16_eager']:>6}/{r['top_tilefuse']:>6}"
              f" {margin:>10}")
    worst = max(r["ratio"] for r in rows)
    agree = sum(r["top_tilefuse"] == r["top_ref"] for r in rows), sum(r["top_bf16_eager"] == r["top_ref"] for r in rows)
    print(f"worst ratio {worst:.2f}; all within 2x: {all(r['passes_2x'] for r in rows)}; top-1 as float32: "
          f"tilefuse {agree[0]}/{len(rows)}, bf16 eager {agree[1]}/{len(rows)}")


if __name__ == "__main__":
    main()
