"""Greedy generation with a KV cache through torch.compile(backend=...): what each new size costs.

    python3 bench/generate.py [--layers 4 --hidden 1024 --prompt 128 --new 32] [--modes eager,tilefuse,inductor]
                              [--cache dynamic|static] [--window W] [--json out.json]

With the default dynamic cache, `model.generate` grows the cache by one token a step, so every
decode step is a new size for a compiler that specialises sizes. With `--cache static`
(transformers' `cache_implementation="static"`) the cache is preallocated at prompt + new
tokens and each step writes its token into it in place: every decode step is one size.
With `--window W` the model is a MistralForCausalLM of the same sizes whose every layer attends
to a sliding window of W tokens: its cache passes its length to each decode step as a Python int.
Mode `inductor-ro` is torch.compile's mode="reduce-overhead" (inductor with CUDA graphs, what
transformers itself compiles a static-cache decode step with); transformers' own compile is
turned off (`disable_compile`) in every mode, so each mode's compile is the only one. For each mode (one process each, with an empty
dynamo and cubin cache), a random transformers LlamaForCausalLM in bf16 generates twice
from the same random prompt:
- first: the wall time of the whole generate, every size compiled on the way;
- again: the same generate `--repeats` times more (after an untimed second one), the median
  timed: every size compiled and, for tilefuse, its CUDA graph captured (a program's second
  call captures, later calls replay); each repeat's time is in the JSON;
- other prompt: a prompt half as long, so every size is new (what each new size costs);
- `--lengths N,N,...`: then one generate at each of these prompt lengths, each new, timed (with
  lengths seen before, a new one shares the kernels whose schedule it shares);
and the peak GPU memory, the compiled variants and exports per graph (tilefuse; with
`tilefuse-nographs`, TILEFUSE_CUDA_GRAPHS=0: no CUDA-graph capture or replay), and how
many generated tokens equal eager's (bf16 greedy decoding may part ways at a near tie).
Prints a table last; the JSON carries the GPU's name.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def one(args) -> dict:
    """In this process: build the model, generate twice under `args.mode`, report."""
    import torch

    sys.path.insert(0, os.environ.get("TILEFUSE_SRC", str(HERE.parent / "src")))  # another tree's, to compare
    from tilefuse.models import hf

    if args.mask_skip:
        # transformers (5.24) skips building the causal mask of a one-token step under torch.compile
        # only where torch.compiler.is_exporting() is False while dynamo traces, which needs a newer
        # torch than 2.11 (pytorch#176499; 2.13 has it); before, dynamo made it True and every decode
        # step built an all-true mask from the cache's length in the graph. This gives transformers
        # the newer torch's answer; nothing here exports the model itself.
        import transformers.masking_utils as masking

        masking.is_torchdynamo_exporting = lambda: False
    torch.manual_seed(0)
    cfg = hf.config("llama", args.layers, args.hidden, seq=args.prompt + args.new + 8, kv_heads=args.kv_heads)
    cfg.use_cache = True
    if args.window:  # the same sizes as a Mistral: every layer attends to a sliding window
        import transformers

        keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "bos_token_id", "eos_token_id",
                "tie_word_embeddings")
        cfg = transformers.MistralConfig(**{k: getattr(cfg, k) for k in keep}, sliding_window=args.window,
                                         use_cache=True, attn_implementation="sdpa")
        model = transformers.MistralForCausalLM(cfg)
    else:
        model = hf.causal_lm(cfg)
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    model = model.to(args.device, torch.bfloat16).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, args.prompt), device=args.device)
    gen = dict(max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False, pad_token_id=0)
    if args.cache == "static":
        gen.update(cache_implementation="static", disable_compile=True)
    runners = []
    from tilefuse.frontend import backend as tb

    stages = _stage_timers() if args.stage_times else None

    def tilefuse_backend(gm, example_inputs, **kw):  # tilefuse's, keeping each graph's runner
        runners.append(tb.tilefuse_backend(gm, example_inputs, **kw))
        return runners[-1]

    if args.mode.startswith("tilefuse"):
        model.forward = torch.compile(model.forward, backend=tilefuse_backend)
    elif args.mode == "inductor-ro":
        model.forward = torch.compile(model.forward, mode="reduce-overhead")
    elif args.mode != "eager":
        model.forward = torch.compile(model.forward)
    times, tokens, each = [], None, []
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        for prompt in (ids,) * (2 + args.repeats) + (ids[:, args.prompt // 2:],):
            sync()
            t0 = time.perf_counter()
            seq = model.generate(prompt, **gen)
            sync()
            times.append(time.perf_counter() - t0)
            if stages is not None:
                stages["per_generate"].append({k: dict(v) for k, v in stages["now"].items()})
                stages["now"].clear()
            tokens = seq if tokens is None else tokens
            each.append(seq[0, -args.new:].tolist())
    steps = step_times(lambda: model.generate(ids, **gen)) if args.step_times and cuda else None
    new_lengths = []
    with torch.no_grad():  # more prompt lengths, each new: what a new length costs once others were seen
        for n in (int(x) for x in args.lengths.split(",") if x):
            sync()
            t0 = time.perf_counter()
            model.generate(torch.randint(0, cfg.vocab_size, (1, n), device=args.device), **gen)
            sync()
            new_lengths.append({"prompt": n, "s": time.perf_counter() - t0})
            if stages is not None:
                new_lengths[-1]["stage_times"] = {k: dict(v) for k, v in stages["now"].items()}
                stages["now"].clear()
    if args.profile:  # (the half prompt: its sizes all compiled; the first prompt's prefill would now compile
        # again, for the dynamic graph dynamo made at the half prompt)
        profile(args, lambda: model.generate(ids[:, args.prompt // 2:], **gen), sync)
    if args.profile_new:
        seen = {args.prompt, args.prompt - args.prompt // 2} | {int(x) for x in args.lengths.split(",") if x}
        n = next(n for n in range(args.prompt - args.prompt // 4, 0, -1) if n not in seen)  # (3/4, or below: unseen)
        profile_new(args, lambda: model.generate(torch.randint(0, cfg.vocab_size, (1, n), device=args.device), **gen),
                    sync)
    again = sorted(times[2:2 + args.repeats])
    out = {"mode": args.mode, "first_s": times[0], "again_s": again[len(again) // 2], "other_prompt_s": times[-1],
           "again_ms_per_token": again[len(again) // 2] / args.new * 1e3,
           "again_ms_per_token_each": [t / args.new * 1e3 for t in times[2:2 + args.repeats]],
           # (host-bound steps on a shared host: interference only adds time, so the fastest
           # repeat is the steadier figure for comparing two trees; the median stays the headline)
           "again_ms_per_token_min": again[0] / args.new * 1e3,
           "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan"),
           "weights_gib": sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30,
           "tokens": tokens[0, args.prompt:].tolist(),
           # (each generate's: the first runs every size's first call, the repeats their replays)
           "tokens_each": each}
    if stages is not None:
        out["stage_times"] = stages["per_generate"]
    if steps is not None:
        out["step_times"] = steps
    if new_lengths:
        out["new_lengths"] = new_lengths
    if runners:
        from collections import Counter

        info = [g for r in runners for v in r.variants.values() if v.program is not None
                for g in v.program.graph_info()]
        stats = Counter()
        for g in info:
            stats.update({k: v for k, v in g.items() if type(v) is int})
        out["cuda_graphs"] = {"signatures": len(info), "off": Counter(str(g["reason"]) for g in info if not g["graphs"]),
                              **stats}
        out["graphs"] = [{"variants": r.variants, "exports": getattr(r, "exports", None),
                          "resized": getattr(r, "resized", 0), "status": r.status, "reason": r.reason,
                          "calls_tilefuse": r.calls_tilefuse, "calls_eager": r.calls_eager, "events": r.events}
                         for r in tb.reports()]
    return out


def _stage_timers() -> dict:
    """Wrap the compile's stages (export and lowering, kernel builds, NVRTC) with timers that sum
    seconds and count calls per generate (and name NVRTC's kernels): where a first generate's time goes, which cProfile
    (the main thread only) cannot say while kernels build in worker threads. Patched by name, so
    another tree's (TILEFUSE_SRC) is timed the same way."""
    import threading
    from collections import defaultdict

    from tilefuse import compiler
    from tilefuse.frontend import backend
    from tilefuse.runtime import nvrtc, program

    lock, now = threading.Lock(), defaultdict(lambda: {"s": 0.0, "n": 0})

    def timed(owner, name, label):
        fn = getattr(owner, name)

        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                with lock:
                    now[label]["s"] += time.perf_counter() - t
                    now[label]["n"] += 1
                    if label.startswith("nvrtc"):  # which kernels a generate built
                        now[label].setdefault("names", []).append(str(a[1] if len(a) > 1 else k.get("name")))
        setattr(owner, name, wrapper)

    timed(nvrtc, "compile_cuda", "nvrtc (summed over threads)")
    timed(compiler, "compile_stages", "compile_stages")
    timed(program.Program, "prepare", "prepare (wall)")
    timed(backend.GraphRunner, "_compile", "variant compile (wall)")
    return {"now": now, "per_generate": []}


def step_times(generate) -> dict | None:
    """One more generate of the timed prompt, each call of a CUDA-graphed program (tilefuse's
    `graphs.Graphed`: the decode steps) bracketed by CUDA events: the GPU time from its input
    copies to its replay's end, the GPU's idle time before it (since the previous call's end),
    and the host time between calls' starts. Idle near zero: the GPU sets the pace; idle near
    the host interval less the GPU time: the host does. Medians over the decode steps, ms."""
    import statistics

    import torch

    from tilefuse.runtime import graphs

    marks = []
    call = graphs.Graphed.__call__

    def timed(self, tensors):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        host = time.perf_counter()
        start.record()
        try:
            return call(self, tensors)
        finally:
            end.record()
            marks.append((host, start, end))

    graphs.Graphed.__call__ = timed
    try:
        with torch.no_grad():
            generate()
        torch.cuda.synchronize()
    finally:
        graphs.Graphed.__call__ = call
    if len(marks) < 3:
        return None
    steps = marks[1:]  # (the first: the prefill)
    gpu = [s.elapsed_time(e) for _, s, e in steps]
    idle = [max(0.0, prev[2].elapsed_time(cur[1])) for prev, cur in zip(steps, steps[1:])]
    host = [(cur[0] - prev[0]) * 1e3 for prev, cur in zip(steps, steps[1:])]
    med = statistics.median
    return {"calls": len(steps), "gpu_ms": med(gpu), "gpu_idle_before_ms": med(idle), "host_interval_ms": med(host)}


def profile(args, generate, sync) -> None:
    """The half prompt again (every size seen and captured): host time by function (cProfile)
    and GPU time by kernel (torch.profiler), written to `args.profile`-<mode>.txt."""
    import cProfile
    import io
    import pstats

    import torch

    prof = cProfile.Profile()
    with torch.no_grad():
        generate()  # the half prompt's sizes were each called once: this captures their CUDA graphs
        generate()  # (a program's second call), so the profiled one replays them
    sync()
    with torch.no_grad():
        prof.enable()
        generate()
        sync()
        prof.disable()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as tp:
            generate()
            sync()
    text = io.StringIO()
    st = pstats.Stats(prof, stream=text)
    st.sort_stats("cumulative").print_stats(60)
    st.sort_stats("tottime").print_stats(40)
    text.write(tp.key_averages().table(sort_by="cuda_time_total" if args.device == "cuda" else "cpu_time_total",
                                       row_limit=40))
    Path(f"{args.profile}-{args.mode}.txt").write_text(text.getvalue())


def profile_new(args, generate, sync) -> None:
    """A generate of a prompt length not seen yet (3/4 of the first, or the next below it that
    no earlier generate used): host time by function
    (cProfile), so what one new prefill size costs is seen, into `args.profile_new`-<mode>.txt."""
    import cProfile
    import io
    import pstats

    import torch

    prof = cProfile.Profile()
    sync()
    with torch.no_grad():
        t0 = time.perf_counter()
        prof.enable()
        generate()
        sync()
        prof.disable()
        took = time.perf_counter() - t0
    text = io.StringIO()
    text.write(f"a new prompt length: {took:.2f} s (cProfile on)\n")
    st = pstats.Stats(prof, stream=text)
    st.sort_stats("cumulative").print_stats(90)
    st.sort_stats("tottime").print_stats(50)
    Path(f"{args.profile_new}-{args.mode}.txt").write_text(text.getvalue())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--modes", default="eager,tilefuse,tilefuse-nographs,inductor")
    ap.add_argument("--json", default=None)
    ap.add_argument("--kv-heads", type=int, default=None,
                    help="key/value heads (grouped-query attention when fewer than the query heads; default: as many)")
    ap.add_argument("--repeats", type=int, default=5,
                    help="the same generate, every size seen, this many times: its median is the per-token time "
                         "(one generate's time moves by more than a host-side change is worth)")
    ap.add_argument("--cache", choices=("dynamic", "static"), default="dynamic",
                    help="transformers' KV cache: grown a token a step (dynamic) or preallocated and written in "
                         "place (static: cache_implementation='static')")
    ap.add_argument("--mask-skip", action="store_true",
                    help="as with a torch newer than 2.11: transformers skips the all-true causal mask of a "
                         "one-token step under torch.compile (older torch builds it in every decode graph)")
    ap.add_argument("--profile-new", default=None, metavar="PREFIX",
                    help="after the timed generates, profile the host time of one generate of a prompt length "
                         "not seen yet (what a new size costs) into PREFIX-<mode>.txt")
    ap.add_argument("--profile", default=None, metavar="PREFIX",
                    help="after the timed generates, profile one more (host by function, GPU by kernel) "
                         "into PREFIX-<mode>.txt (GPU times per kernel want TILEFUSE_PDL=0)")
    ap.add_argument("--window", type=int, default=0,
                    help="a Mistral (every layer a sliding window of this many tokens) instead of a Llama")
    ap.add_argument("--lengths", default="", metavar="N,N,...",
                    help="after the runs, one generate at each of these prompt lengths (each new), timed")
    ap.add_argument("--stage-times", action="store_true",
                    help="time the compile's stages per generate (export and lowering, kernel builds, NVRTC summed "
                         "over threads) into the JSON")
    ap.add_argument("--step-times", action="store_true",
                    help="one more generate with each decode step's GPU time, the GPU's idle time before it and "
                         "the host time between steps (CUDA events around tilefuse's graphed calls) in the JSON: "
                         "whether the host or the GPU sets the pace")
    ap.add_argument("--device", default="cuda", help="cpu: check the script (kernels run in the interpreter)")
    ap.add_argument("--mode", help=argparse.SUPPRESS)  # the child process's one mode
    args = ap.parse_args()
    if args.mode:
        print(json.dumps(one(args)))
        return
    import torch

    rows, failed = [], []
    for mode in args.modes.split(","):
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, TILEFUSE_CACHE_DIR=cache)
            if mode == "tilefuse-nographs":
                env["TILEFUSE_CUDA_GRAPHS"] = "0"
            cmd = [sys.executable, __file__, "--mode", mode] + [f"--{k}={getattr(args, k)}" for k in
                                                                 ("layers", "hidden", "prompt", "new", "device",
                                                                  "cache", "window")]
            cmd += [f"--profile={args.profile}"] if args.profile else []
            cmd += [f"--profile-new={args.profile_new}"] if args.profile_new else []
            cmd += [f"--repeats={args.repeats}"]
            cmd += [f"--kv-heads={args.kv_heads}"] if args.kv_heads else []
            cmd += ["--mask-skip"] if args.mask_skip else []
            cmd += ["--stage-times"] if args.stage_times else []
            cmd += ["--step-times"] if args.step_times else []
            cmd += [f"--lengths={args.lengths}"] if args.lengths else []
            p = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if p.returncode != 0:  # said, and the other modes still run
                err = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
                print(f"{mode} failed: {err[-1] if err else p.returncode}", file=sys.stderr)
                failed.append({"mode": mode, "error": "\n".join(err[-30:])})
                continue
            rows.append(json.loads(p.stdout.strip().splitlines()[-1]))
    eager = next((r for r in rows if r["mode"] == "eager"), None)
    for r in rows:
        r["tokens_as_eager"] = (sum(a == b for a, b in zip(r["tokens"], eager["tokens"])) if eager else None)
    result = {"gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__, "args": vars(args), "rows": rows,
              "failed": failed}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"{result['gpu']}: {f'mistral (window {args.window})' if args.window else 'llama'} {args.layers} layers, hidden {args.hidden}, bf16, prompt {args.prompt}, "
          f"{args.new} new tokens, {args.cache} cache" + (f", {args.kv_heads} kv heads" if args.kv_heads else ""))
    print(f"{'mode':18} {'first s':>8} {'again s':>8} {'ms/token':>9} {'(min)':>6} {'other prompt s':>15} {'peak GiB':>9} "
          f"{'as eager':>9}  "
          f"per graph: variants (made with no compile)/exports/calls in tilefuse/calls in eager")
    for r in rows:
        ve = ",".join(f"{g['variants']}({g['resized']})/{g['exports']}/{g['calls_tilefuse']}/{g['calls_eager']}"
                      for g in r.get("graphs", []))
        print(f"{r['mode']:18} {r['first_s']:8.2f} {r['again_s']:8.3f} {r['again_ms_per_token']:9.2f} "
              f"{r.get('again_ms_per_token_min', float('nan')):6.2f} "
              f"{r['other_prompt_s']:15.2f} "
              f"{r['peak_gib']:9.2f} {r['tokens_as_eager']!s:>6}/{args.new}  {ve}")
    for r in rows:
        if r.get("new_lengths"):
            print(f"{r['mode']:18} new prompt lengths: "
                  + ", ".join(f"{x['prompt']}: {x['s']:.2f} s" for x in r["new_lengths"]))
    for f in failed:
        print(f"{f['mode']:18} failed: {f['error'].splitlines()[-1]}")
    for r in rows:
        if "cuda_graphs" in r:
            print(f"{r['mode']}: CUDA graphs {r['cuda_graphs']}")
    for r in rows:
        st = r.get("step_times")
        if st:
            print(f"{r['mode']}: decode steps (median of {st['calls']}): GPU {st['gpu_ms']:.3f} ms, GPU idle before "
                  f"{st['gpu_idle_before_ms']:.3f} ms, host between steps {st['host_interval_ms']:.3f} ms")


if __name__ == "__main__":
    main()
