"""Host time of a decode step on the thin path (each kernel and extern launched from Python, no
CUDA graph), by kind of step, against eager's forward of the same step.

    python3 bench/thin_path.py [--layers 4 --hidden 1024 --prompt 128 --new 16] [--json out.json]
                               [--graphs] [--device cpu]

A random transformers LlamaForCausalLM in bf16 generates `--new` tokens through
`torch.compile(backend=tilefuse)` with TILEFUSE_CUDA_GRAPHS=0, twice to make every size, then
again with each `Runner` step timed on the host (`time.perf_counter_ns` around the call: the
launch work, not the GPU's time). The backend's call for each graph (`GraphRunner.__call__`:
sizes, variant, prologue, the program) is timed the same way. With `--graphs` CUDA graphs stay
on, so the timed generate replays them (its sizes were called twice before): the backend call is
then the replay path's host time, and no Runner step runs. The same generate in eager is timed
with a forward hook. Prints a table last (microseconds a decode step).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", default="cuda", help="cpu: check the script (kernels run in the interpreter)")
    ap.add_argument("--graphs", action="store_true", help="CUDA graphs on: time the replay path's host work")
    args = ap.parse_args()
    if not args.graphs:
        os.environ["TILEFUSE_CUDA_GRAPHS"] = "0"
    sys.path.insert(0, os.environ.get("TILEFUSE_SRC", str(HERE.parent / "src")))
    import torch

    from tilefuse.frontend import backend as tb
    from tilefuse.models import hf
    from tilefuse.runtime import runner as rn

    torch.manual_seed(0)
    cfg = hf.config("llama", args.layers, args.hidden, seq=args.prompt + args.new + 8)
    cfg.use_cache = True
    model = hf.causal_lm(cfg).to(args.device, torch.bfloat16).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, args.prompt), device=args.device)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    gen = dict(max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False, pad_token_id=0)

    def timed_generate():
        sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, **gen)
        sync()
        return (time.perf_counter() - t0) / args.new * 1e6

    # eager: the forward's host time per step (the hook pair brackets the module call)
    eager_fwd: list = []
    starts: list = []
    h1 = model.register_forward_pre_hook(lambda m, a: starts.append(time.perf_counter_ns()))
    h2 = model.register_forward_hook(lambda m, a, o: eager_fwd.append(time.perf_counter_ns() - starts[-1]))
    timed_generate()
    eager_fwd.clear()
    eager_step = timed_generate()
    h1.remove(), h2.remove()
    eager_fwd_us = sorted(eager_fwd[1:])[len(eager_fwd[1:]) // 2] / 1e3  # (the prefill left out)


    by_kind: dict = defaultdict(int)
    counts: dict = defaultdict(int)
    runs: list = []
    plain_run = rn.Runner.run

    def kind(op) -> str:
        name = type(op).__name__.lstrip("_")
        if name == "Extern":
            n = op.node
            return f"extern {getattr(n, 'target', None) or type(n).__name__}" + (" (view)" if op.strided else "")
        return name

    recording = [False]

    def run(self, tensors):
        if not recording[0]:
            return plain_run(self, tensors)
        t_all = time.perf_counter_ns()
        env = self.base.copy()
        env[:self.n_inputs] = tensors
        for op in self.ops:
            t = time.perf_counter_ns()
            op(env)
            k = kind(op)
            by_kind[k] += time.perf_counter_ns() - t
            counts[k] += 1
        out = [env[i].clone() if c else rn._unviewed(env[i]) for i, c in self.outputs]
        for i, v in self.copies:
            tensors[i].copy_(env[v])
        runs.append((len(self.ops), time.perf_counter_ns() - t_all))
        return out

    calls: list = []
    plain_call = tb.GraphRunner.__call__

    def call(self, *a):
        if not recording[0]:
            return plain_call(self, *a)
        t = time.perf_counter_ns()
        out = plain_call(self, *a)
        calls.append(time.perf_counter_ns() - t)
        return out

    tb.GraphRunner.__call__ = call  # (a class attribute: looked up at each call)
    rn.Runner.run = run  # (before compiling: a program keeps its runner's bound method)
    model.forward = torch.compile(model.forward, backend=tb.tilefuse_backend)
    timed_generate()  # every size made
    timed_generate()
    recording[0] = True
    tf_step = timed_generate()
    recording[0] = False
    plain_step = timed_generate()
    steps = [r for r in runs if r[0] == max(n for n, _ in runs)]  # the decode step's program (the most ops)
    total = sorted(t for _, t in steps)[len(steps) // 2] / 1e3 if steps else float("nan")
    backend_us = sum(calls) / args.new / 1e3  # every graph's call, per forward
    # per forward (generate makes `new` of them: the prefill and new - 1 decode steps)
    rows = sorted(((k, by_kind[k] / args.new / 1e3, counts[k] / args.new) for k in by_kind), key=lambda r: -r[1])
    result = {"gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__, "args": vars(args),
              "eager_step_us": eager_step, "eager_forward_us": eager_fwd_us, "tilefuse_step_us": plain_step, "tilefuse_step_timed_us": tf_step,
              "runner_run_us": total, "runs": len(runs), "backend_calls_us_per_forward": backend_us, "by_kind_us_per_forward": {k: [us, n] for k, us, n in rows}}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"{result['gpu']}: llama {args.layers} layers, hidden {args.hidden}, bf16, prompt {args.prompt}, "
          f"{args.new} new tokens, {'CUDA graphs replayed' if args.graphs else 'no CUDA graphs'}; us a decode step (host)")
    print(f"eager generate step {eager_step:8.1f}   eager forward {eager_fwd_us:8.1f}")
    print(f"tilefuse generate step {plain_step:8.1f} ({tf_step:.1f} with the timers)   backend calls {backend_us:8.1f}   "
          f"Runner.run (median) {total:8.1f}  ({len(runs)} runs)")
    print(f"{'kind':48} {'us/fwd':>8} {'ops/fwd':>8} {'us/op':>7}")
    for k, us, n in rows:
        print(f"{k[:48]:48} {us:8.1f} {n:8.1f} {us / n if n else 0:7.1f}")


if __name__ == "__main__":
    main()
