"""What compiling one more prompt length costs on the host, stage by stage, with no GPU.

    python3 bench/new_size_cost.py [--model llama|qwen2|gpt2] [--layers 4 --hidden 1024 --seqs 128,96]
                                   [--instance] [--no-build] [--profile out.txt]

Under `generate`, each new prompt length is a new size of the prefill graph: tilefuse
instantiates the symbolic export (`--instance`; by default each length is exported on its own), captures, rewrites, plans and lowers it, then renders and
builds each kernel (NVRTC, through the content-addressed cubin cache). This times those stages
for a random 4-layer Llama (hidden 1024, bf16, sm_90a; `--model` for another) at each length of `--seqs` in one
process, as the backend meets them: the first length pays the cold caches, later ones show
what a new size costs. One thread, so the stages do not share the time (the backend builds
kernels in parallel threads). Each distinct kernel is rendered and built once, as a program
does (`kernels`: how many; the layers of a model share theirs: equal GEMM problems, and map-reduce
kernels equal but for names). `--profile` writes a cProfile
of the last length.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama", choices=("llama", "qwen2", "gpt2"))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--seqs", default="128,96")
    ap.add_argument("--profile", default=None, metavar="FILE")
    ap.add_argument("--no-build", action="store_true", help="render only: no NVRTC")
    ap.add_argument("--instance", action="store_true",
                    help="export once with a symbolic length and instance it per length, as the backend does "
                         "(default: a torch.export per length)")
    args = ap.parse_args()
    import os

    os.environ.setdefault("TILEFUSE_CACHE_DIR", tempfile.mkdtemp(prefix="tf-newsize-"))
    sys.path.insert(0, os.environ.get("TILEFUSE_SRC", str(HERE.parent / "src")))  # another tree's, to compare
    import torch

    from tilefuse.compiler import compile_stages
    from tilefuse.frontend.capture import export
    from tilefuse.models import hf
    from tilefuse.tune.lookup import tuned_schedule

    try:  # what a program builds: the kernel under names made from what it computes
        from tilefuse.loop.canon import named_by_structure as named
    except ImportError:  # (a tree from before session 39 built each kernel under its own names)
        def named(k):
            return k

    torch.manual_seed(0)
    cfg = hf.config(args.model, args.layers, args.hidden, seq=512)
    model = hf.CausalLM(hf.causal_lm(cfg).to(torch.bfloat16).eval())
    print(f"{args.layers}-layer {args.model}, hidden {args.hidden}, bf16, sm_90a; cubin cache {os.environ['TILEFUSE_CACHE_DIR']}")
    symbolic = None
    if args.instance:  # the backend's way: one export with a symbolic length, instanced per length
        from torch.export import Dim

        from tilefuse.frontend.sizes import Symbolic

        ids = torch.randint(0, cfg.vocab_size, (1, int(args.seqs.split(",")[0])))
        with torch.no_grad():
            t = time.perf_counter()
            symbolic = Symbolic(export(model, (ids,), dynamic_shapes=({1: Dim.AUTO},)))
            state = dict(model.state_dict(keep_vars=True))
        print(f"one symbolic export: {time.perf_counter() - t:.2f} s{'; ' + symbolic.why_not if symbolic.why_not else ''}")
    stage = "instance" if symbolic is not None else "export"
    print(f"{'seq':>5} {stage:>8} {'lower':>7} {'render mr':>10} {'render gemm':>12} {'build (render+NVRTC)':>21} "
          f"{'kernels':>8} {'hits':>5}")
    for i, seq in enumerate(int(s) for s in args.seqs.split(",")):
        ids = torch.randint(0, cfg.vocab_size, (1, seq))
        prof = cProfile.Profile() if args.profile and i == len(args.seqs.split(",")) - 1 else None
        with torch.no_grad():
            t0 = time.perf_counter()
            ep = symbolic.instance((ids,), state) if symbolic is not None else None
            ep = ep if ep is not None else export(model, (ids,))
            t1 = time.perf_counter()
            if prof:
                prof.enable()
            c = compile_stages(model, (ids,), arch="sm_90a", exported=ep)
            t2 = time.perf_counter()
            prog = c.program
            t_mr = t_gemm = t_build = 0.0
            hits = n = 0
            from tilefuse.codegen import gemm_sm90, mapreduce
            from tilefuse.runtime import gemm as rgemm
            from tilefuse.runtime import launch

            seen = set()  # (a program renders and builds each distinct kernel once: runtime.program._shared)
            for s in prog.plan.steps:
                if s.family in ("mapreduce", "gemm"):
                    what = named(prog.kernels[s.name].kernel) if s.family == "mapreduce" else prog.gemms[s.name].problem()
                    if what in seen:
                        continue
                    seen.add(what)
                if s.family == "mapreduce":
                    k = named(prog.kernels[s.name].kernel)
                    sched = tuned_schedule(k, "sm_90a", torch.device("cpu"))
                    a = time.perf_counter()
                    mapreduce.render(k, sched or mapreduce.default_schedule(k, "sm_90a"), "sm_90a")
                    t_mr += time.perf_counter() - a
                    build = lambda: launch._build(k, "sm_90a", sched)[2]  # noqa: E731
                elif s.family == "gemm":
                    problem = prog.gemms[s.name].problem()
                    a = time.perf_counter()
                    gemm_sm90.render(problem, None)
                    t_gemm += time.perf_counter() - a
                    build = lambda: rgemm.compile_gemm(problem, None, "sm_90a").cache_hit  # noqa: E731
                else:
                    continue
                n += 1
                if not args.no_build:
                    a = time.perf_counter()
                    hits += bool(build())
                    t_build += time.perf_counter() - a
            if prof:
                prof.disable()
        print(f"{seq:5d} {t1 - t0:8.2f} {t2 - t1:7.2f} {t_mr:10.2f} {t_gemm:12.2f} {t_build:21.2f} {n:8d} {hits:5d}")
        if prof:
            text = io.StringIO()
            st = pstats.Stats(prof, stream=text)
            st.sort_stats("cumulative").print_stats(70)
            st.sort_stats("tottime").print_stats(40)
            Path(args.profile).write_text(text.getvalue())


if __name__ == "__main__":
    main()
