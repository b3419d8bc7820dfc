"""The `tilefuse` command: compile, run, bench, and draw layouts."""
from __future__ import annotations

import argparse
import difflib
import sys
import time

EXAMPLE = 'torch.nn.RMSNorm(2048)(torch.randn(1, 32, 2048))'
DTYPES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32"}
DTYPE_SPELLINGS = {"bfloat16": "bf16", "fp16": "f16", "float16": "f16", "half": "f16", "fp32": "f32",
                   "float32": "f32", "float": "f32"}


def _dtype_name(text: str) -> str:
    """--dtype's value as DTYPES names it; PyTorch's and the fp spellings mean the same
    (fp16, float16, torch.half, ...), anything else is left for argparse's choices to refuse."""
    t = text.strip().lower().removeprefix("torch.")
    return DTYPE_SPELLINGS.get(t, t)


MODEL_DEFAULTS = {"layers": 2, "hidden": 256, "seq": 64, "batch": 1, "vocab": 1024, "output": "logits"}


def _model_options(args):
    """--model options take their defaults; with -c they mean nothing, so giving one is an error."""
    if not hasattr(args, "layers"):
        return
    given = [k for k in MODEL_DEFAULTS if getattr(args, k) is not None]
    if not getattr(args, "model", None):
        if given:
            raise ValueError(f"--{given[0]} is a --model option; a -c expression sets its own shapes")
        return
    for k, v in MODEL_DEFAULTS.items():
        if getattr(args, k) is None:
            setattr(args, k, v)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tilefuse", description="Compile PyTorch programs to fused CUDA kernels.")
    p.add_argument("--version", action="version", version=f"tilefuse {_version()}")
    sub = p.add_subparsers(dest="command", required=True)

    def program_args(sp, model: bool = False, diffs: bool = False):
        what = sp.add_mutually_exclusive_group(required=True) if model else sp
        what.add_argument("-c", "--expr", required=not model, metavar="EXPR",
                          help=f"a PyTorch expression; torch.randn(...) calls in it are the inputs (e.g. {EXAMPLE!r})")
        if model:
            what.add_argument("--model", choices=["llama", "qwen2", "gpt2", "mixtral"],
                              help="a transformers causal LM with random weights, run through "
                                   "torch.compile(backend='tilefuse') (needs transformers; mixtral: 8 experts, "
                                   "top-2, their grouped matmul in PyTorch)")
        sp.add_argument("--dtype", type=_dtype_name, choices=sorted(DTYPES),
                        help="cast inputs and weights to this dtype first (fp16, float16 and half name f16, "
                             "and likewise for the others)")
        sp.add_argument("--arch", help="GPU architecture to build for (sm_90a, sm_80; default: the current GPU's)")
        sp.add_argument("-v", "--verbose", action="count", default=0,
                        help="-v: tracebacks; -vv: also a diff for every rewrite that fired" if diffs
                        else "-v: a traceback with errors")

    def model_args(sp):
        m = sp.add_argument_group("--model options", "the model is built in --dtype, bf16 by default")
        m.add_argument("--layers", type=int, help=f"default {MODEL_DEFAULTS['layers']}")
        m.add_argument("--hidden", type=int, help=f"default {MODEL_DEFAULTS['hidden']}")
        m.add_argument("--seq", type=int, help=f"default {MODEL_DEFAULTS['seq']}")
        m.add_argument("--batch", type=int, help=f"default {MODEL_DEFAULTS['batch']}")
        m.add_argument("--vocab", type=int, help=f"default {MODEL_DEFAULTS['vocab']}")
        m.add_argument("--output", choices=["logits", "hidden", "loss"],
                       help="what the model returns (loss: with random labels; default logits)")

    c = sub.add_parser("compile", help="compile a program and print its stages",
                       description="Compile a program and print the chosen stages.")
    program_args(c, diffs=True)
    c.add_argument("--ir", action="append", choices=["graph", "loop", "schedule", "cuda", "sass"],
                   help="stage to print (repeatable); default: graph. sass: each kernel's machine code as "
                        "ptxas made it (needs nvdisasm: a CUDA toolkit, or pip install nvidia-cuda-nvdisasm)")
    r = sub.add_parser("run", help="run a program and check it against PyTorch",
                       description="Run a program (generated CUDA kernels on a GPU, the Loop IR interpreter "
                                   "without one) on fresh random inputs and compare it with PyTorch: within "
                                   "2x PyTorch's error against a float64 reference; an output of fewer than 16 "
                                   "values (a loss) is judged over enough input draws to give 16, and a mixture "
                                   "of experts' outputs over 16 draws together (a near tie of its router's scores "
                                   "routes by rounding, eager's too).")
    program_args(r, model=True)
    model_args(r)
    r.add_argument("--bench", action="store_true", help="on a GPU: time it against eager and torch.compile")
    r.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="where to run: the GPU's kernels, or the CPU interpreter (default: cuda when a GPU is visible)")
    r.add_argument("--seed", type=_seed_arg, default=None,
                   help="draw weights and inputs from this seed (default: a fresh one, printed, each run)")
    t = sub.add_parser("tune", help="tune each kernel's schedule on this GPU; later runs use the picks",
                       description="Search each distinct kernel's schedule knobs (SP-MCTS, or every candidate "
                                   "when few), measuring candidates in isolated worker processes; the picks go "
                                   "to the tuning cache that run, compile and tilefuse.compile read.")
    program_args(t, model=True)
    model_args(t)
    t.add_argument("--budget", type=int, default=64, help="candidates measured per kernel (default 64)")
    t.add_argument("--polish", type=int, default=24,
                   help="after the search, up to this many one-knob neighbours of the best (default 24; 0: none)")
    t.add_argument("--gpus", type=int, default=1, help="benchmark workers, one per local GPU (default 1)")
    t.add_argument("--exhaustive", action="store_true", help="measure every candidate")
    t.add_argument("--threshold", type=int, default=48,
                   help="measure every candidate when a kernel admits at most this many (default 48; map-reduce kernels with at most 256 distinct valid candidates are measured whole anyway)")
    t.add_argument("--force", action="store_true", help="re-tune kernels the cache already has")
    t.add_argument("--timeout", type=float, default=60.0, help="seconds before a candidate counts as hung")
    t.add_argument("--seed", type=_seed_arg, default=0, help="seed of the search and of --model's weights (default 0)")
    lay = sub.add_parser("layout", help="print or draw a CuTe layout", add_help=False)
    lay.add_argument("rest", nargs=argparse.REMAINDER)
    sub.add_parser("env", help="list the environment variables tilefuse reads, as set here",
                   description="List the TILEFUSE_* environment variables: each one's value in this "
                               "environment (or its default) and what it changes. Switches take 1/0, "
                               "on/off, true/false or yes/no.")
    return p


def _version():
    from . import __version__

    return __version__


def _seed_arg(text: str) -> int:
    """A --seed: an integer torch.manual_seed takes (0 to 2^63 - 1)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 0 <= v < 2**63:
        raise argparse.ArgumentTypeError(f"{v} is out of range: a seed is 0 to 2^63 - 1")
    return v


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "layout":
        from .layout.draw import main as layout_main

        return layout_main(argv[1:])
    args = _parser().parse_args(argv)
    try:
        _model_options(args)
        if args.command == "compile":
            return cmd_compile(args)
        if args.command == "env":
            return cmd_env()
        if args.command == "tune":
            from .tune.command import run as cmd_tune

            return cmd_tune(args, _tune_stages)
        return cmd_run(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader left (`| head`): stop quietly, as Unix tools do
        return closed_pipe()
    except Exception as e:  # one clear line unless -v
        if getattr(args, "verbose", 0):
            raise
        print(f"tilefuse: error: {type(e).__name__}: {e}" if not _known(e) else f"tilefuse: error: {e}",
              file=sys.stderr)
        return 1


def cmd_env() -> int:
    """The variables of tilefuse.env as a table; a value a switch would refuse is marked, and
    makes the exit status 1, so that a script can check its settings before a long run."""
    from rich.markup import escape
    from rich.table import Table

    from . import env

    table = Table(title="tilefuse environment variables", title_justify="left")
    for col in ("variable", "value", "what it changes"):
        table.add_column(col, overflow="fold")
    bad = 0
    for name, shown, what in env.table():
        problem = env.check(name)
        if problem:
            bad += 1
            shown = f"{escape(shown)} [red]invalid: {escape(problem.split(': ', 1)[-1])}[/]"
        else:
            shown = escape(shown)
        table.add_row(name, shown, escape(what))
    make_console().print(table)
    return 1 if bad else 0


def make_console():
    """The subcommands' rich console. It raises BrokenPipeError when stdout's reader leaves
    (rich's default exits with status 1 from inside print), so that main stops quietly with
    status 0."""
    from rich.console import Console

    def broken():
        raise BrokenPipeError

    console = Console(highlight=False, soft_wrap=True)
    console.on_broken_pipe = broken
    return console


def closed_pipe() -> int:
    """Exit status after stdout's reader has gone: stdout pointed at /dev/null, so that Python's
    own flush at exit does not fail again."""
    import os

    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return 0


def _known(e) -> bool:
    from .frontend.capture import CaptureError
    from .frontend.expr import ExprError

    known = (CaptureError, ExprError, ValueError)
    try:
        from .runtime.nvrtc import CompileError

        known += (CompileError,)
    except ImportError:
        pass
    return isinstance(e, known)


def _build(args):
    import torch

    from .compiler import compile_stages
    from .frontend.expr import parse

    dtype = getattr(torch, DTYPES[args.dtype]) if args.dtype else None
    module, inputs, specs = parse(args.expr, dtype)
    stages = compile_stages(module, inputs, expr=args.expr, arch=args.arch)
    return module, inputs, specs, stages


def _tune_stages(args) -> list:
    """The compiled stages `tune` works on: the -c program's, or each dynamo graph's of a model
    run once on the GPU through torch.compile(backend="tilefuse")."""
    if not getattr(args, "model", None):
        return [_build(args)[3]]
    import torch

    from . import models
    from .frontend import backend as tb

    built = models.build(args.model, args.layers, args.hidden, args.seq, args.batch,
                         getattr(torch, DTYPES[args.dtype or "bf16"]), output=args.output, device="cuda",
                         vocab=args.vocab, seed=args.seed)
    tb.register()
    torch._dynamo.reset()
    tb.reset()
    with torch.no_grad():
        torch.compile(built.model, backend="tilefuse")(*built.inputs)
    stages = [r.stages for r in tb.reports() if r.stages is not None]
    if not stages:
        raise ValueError(f"--model {args.model}: no graph compiled through tilefuse; "
                         "TILEFUSE_LOG=summary says why")
    return stages


def cmd_compile(args) -> int:
    console = make_console()
    _, _, _, st = _build(args)
    if args.verbose >= 2:
        if not st.fired:
            console.print("(-vv: no rewrite fired; the graph below is the captured one)")
        for f in st.fired:
            console.print(f"[bold]rewrite {f.rule}[/bold]")
            for line in difflib.unified_diff(f.before.splitlines(), f.after.splitlines(), lineterm="", n=1):
                console.print(line, markup=False)
    if "sass" in (args.ir or ()):
        from .runtime import sass

        if not sass.available():
            raise ValueError("--ir sass needs nvdisasm: install a CUDA toolkit, or pip install nvidia-cuda-nvdisasm")
    for stage in args.ir or ["graph"]:
        if stage != "graph" and not st.kernels and not st.gemms:
            console.print(f"(--ir {stage}: no generated kernels; every step runs in PyTorch, as --ir graph shows)",
                          markup=False)
            continue
        if stage == "graph":
            console.print(str(st.graph), markup=False)
            console.print()
            console.print(str(st.plan), markup=False)
        elif stage == "loop":
            for lk in st.kernels.values():
                console.print(str(lk.kernel), markup=False)
                console.print()
            for lg in st.gemms.values():
                console.print(f"// GEMM {_gemm_shape(lg)}: its epilogue (acc = A @ B in fp32)", markup=False)
                console.print(str(lg.epilogue), markup=False)
                console.print()
        else:
            from .codegen.mapreduce import render
            from .loop.canon import named_by_structure
            from .tune.lookup import choose

            printed, rendered = set(), {}
            for lk in st.kernels.values():
                choice = choose(lk.kernel, args.arch or _default_arch())  # tuned (cache hit) or heuristic default
                sched = choice.schedule
                if stage == "schedule":
                    console.print(f"{lk.kernel.name}: {sched}  (source: {choice.note})", markup=False)
                    continue
                # the source the program builds: names made from what the kernel computes
                built = named_by_structure(lk.kernel)
                if (built, sched) not in rendered:  # (steps equal but for their names render once)
                    rendered[built, sched] = render(built, sched, arch=args.arch or _default_arch())
                src = rendered[built, sched]
                params = ", ".join(f"{b.name} = {a.name}" for a, b in zip(lk.kernel.params, built.params))
                rows = f", tf_rows = {src.rows}" if src.rows is not None else ""
                rows += f", tf_s = {src.period}" if src.period is not None else ""
                if src.source in printed:  # (one source serves every row count: codegen.mapreduce.rows_free)
                    console.print(f"// ---- {lk.kernel.name}: built as {src.name} ({params}{rows}), printed above",
                                  markup=False)
                    continue
                printed.add(src.source)
                console.print(f"// ---- {lk.kernel.name}: built as {src.name} ({params}{rows}): grid {src.grid} "
                              f"block {src.block} smem {src.smem_bytes}B cluster {src.cluster}", markup=False)
                _print_source(console, stage, src.source, src.name, args.arch or _default_arch())
            _print_gemms(console, st, stage, args.arch or _default_arch())
    return 0


def _print_source(console, stage: str, source: str, name: str, arch: str):
    """--ir cuda: the CUDA C++; --ir sass: what ptxas made of it (compiled for `arch` as
    programs build it; registers and spills first)."""
    if stage != "sass":
        console.print(source, markup=False)
        return
    from .runtime import nvrtc, sass

    cubin = nvrtc.compile_cuda(source, name, nvrtc.normalize_arch(arch))
    info = cubin.info
    console.print(f"// {info.registers} registers, {info.spill_stores} bytes spilled, {info.smem_bytes} B static "
                  f"shared memory", markup=False)
    console.print(sass.disassemble(cubin.data), markup=False)


def _gemm_shape(lg) -> str:
    s = lg.spec
    return f"{s.batch}x{s.m}x{s.n}x{s.k}" if s.batch > 1 else f"{s.m}x{s.n}x{s.k}"


def _print_gemms(console, st, stage: str, arch: str):
    from .codegen import gemm_sm80, gemm_sm90, gemv
    from .runtime.nvrtc import arch_number, normalize_arch
    from .tune.lookup import choose_gemm

    arch = normalize_arch(arch)

    def show(lg, sched, note: str, render, header: str):
        if stage == "schedule":
            console.print(f"{lg.epilogue.name} (GEMM {_gemm_shape(lg)}, {arch}): {sched}  (source: {note})",
                          markup=False)
        else:
            src = render()
            console.print(f"// ---- {src.name} ({lg.epilogue.name}): GEMM {_gemm_shape(lg)}{header(src)}", markup=False)
            _print_source(console, stage, src.source, src.name, arch)

    for lg in st.gemms.values():
        problem = lg.problem()
        if gemv.takes(problem) and arch_number(arch) >= 80:  # up to 8 rows of A: the GEMV (codegen/gemv.py)
            sched = gemv.for_arch(gemv.default_schedule(problem), arch)
            show(lg, sched, "heuristic default; TILEFUSE_GEMV=0 runs the tile template",
                 lambda: gemv.render(problem, sched, arch), lambda src: f" as a GEMV for {arch}, block {src.block}")
        elif arch != "sm_90a":  # the cp.async / mma.sync kernel (docs/gemm_sm80.md)
            sched = gemm_sm80.default_schedule(problem)
            show(lg, sched, "heuristic default", lambda: gemm_sm80.render(problem, sched, arch),
                 lambda src: f" for {arch}")
        else:
            choice = choose_gemm(problem, "sm_90a")  # tuned (cache hit) or the heuristic default
            sched = choice.schedule if choice.tuned else gemm_sm90.default_schedule(problem)
            show(lg, sched, choice.note, lambda: gemm_sm90.render(problem, sched),
                 lambda src: f", block {src.block} smem {src.smem_bytes}B cluster {src.cluster}")


def _default_arch() -> str:
    import torch

    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"sm_{major}{minor}" + ("a" if major == 9 else "")
    return "sm_90a"


def cmd_run(args) -> int:
    if getattr(args, "model", None):
        return cmd_run_model(args)
    import torch
    from rich.markup import escape
    from rich.table import Table

    from .check import Results, check_outputs, flatten, float64_reference

    console = make_console()
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda, but no CUDA GPU is visible")
    seed = _seed(args)
    torch.manual_seed(seed)  # the expression's module weights are drawn in _build
    t0 = time.perf_counter()
    module, _, specs, st = _build(args)
    prog = st.program
    if device == "cuda":
        prog.prepare("cuda")
    compile_s = time.perf_counter() - t0
    dtype = getattr(torch, DTYPES[args.dtype]) if args.dtype else None

    def make_inputs(s: int) -> list:
        torch.manual_seed(s)
        xs = [spec.make({"torch": torch}) for spec in specs]
        return [(x.to(dtype) if dtype and x.is_floating_point() else x).to(device) for x in xs]

    # inputs the program writes in place (x.add_(1)) are judged too, after the call; each of the
    # three runs gets its own copies of the inputs, so no run sees another's writes
    written = [st.graph.inputs.index(x) for x in st.graph.writes]

    def run(xs) -> Results:
        mine, theirs = [x.clone() for x in xs], [x.clone() for x in xs]
        ref_in = [x.double() if x.is_floating_point() else x.clone() for x in xs]  # written in place by the reference
        outs = flatten(prog(*mine))
        with torch.no_grad():
            eager = flatten(module(*theirs))
        ref = flatten(float64_reference(module, ref_in))
        return Results(outs + [mine[i] for i in written], ref + [ref_in[i] for i in written],
                       eager + [theirs[i] for i in written])

    inputs = make_inputs(seed)
    module = module.to(device)
    first = run(inputs)
    drawn = random_ops(st.graph)
    names = [f"out{i}" for i in range(len(first.outs) - len(written))]
    names += [f"{st.graph.writes[k]}, written" for k in range(len(written))]
    # a random program differs from PyTorch by design: judged on nothing, so no more draws
    checks = check_outputs(names, first, None if drawn else lambda k: run(make_inputs(_draw_seed(seed, k))))
    where = "CUDA kernels" if device == "cuda" else "the Loop IR interpreter (no GPU)"
    table = Table(title=escape(f"tilefuse run: {args.expr}  [{where}]"))  # a title is markup: [..] would vanish
    for col in ("output", "shape", "error", "torch error", "bound", "result"):
        table.add_column(col)
    ok = True
    for c, o in zip(checks, first.outs):
        ok &= c.ok or bool(drawn)
        table.add_row(*_row(c, o), "[yellow]not checked[/yellow]" if drawn else _verdict(c))
    console.print(table)
    _print_draws(console, checks)
    if drawn:
        console.print(f"not checked: the program draws random numbers ({', '.join(drawn)}), so its outputs "
                      f"differ from PyTorch's by design")
    console.print(f"compile: {compile_s * 1e3:.0f} ms; {len(st.kernels)} fused kernel(s), {len(st.gemms)} GEMM(s), "
                  f"{sum(s.family == 'extern' and not s.view for s in st.plan.steps)} extern(s); seed {seed} (--seed {seed} "
                  f"repeats this run)")
    if args.bench:
        if device != "cuda":
            console.print("--bench needs a GPU; skipped")
        else:
            from .analyze.bench import bench_program

            prog.forget_graphs()  # (the check's calls passed copies of the inputs: timed, the same tensors each call)
            console.print(bench_program(prog, module, inputs, st))
    return 0 if ok else 2


def _seed(args) -> int:
    """--seed, or a fresh seed for this run (printed with the results, so a failure can be repeated)."""
    import random

    return args.seed if args.seed is not None else random.randrange(1 << 31)


def _draw_seed(seed: int, k: int) -> int:
    """The seed of input draw k >= 1 of a run whose own inputs come from `seed` (see
    check.check_outputs): hashed from both, since PyTorch's CPU generator reads only a seed's
    low 32 bits and seed + k would draw the next run's inputs."""
    import random

    return random.Random(f"{seed}/{k}").getrandbits(31)


def _row(c, out) -> list[str]:
    """A check's table cells before its verdict: name, shape, error, PyTorch's error, bound."""
    return [c.name, str(tuple(out.shape)), f"{c.error:.2e}", f"{c.torch_error:.2e}", f"{c.bound:.2e}"]


def _verdict(c) -> str:
    word = "[green]pass[/green]" if c.ok else "[red]FAIL[/red]"
    return word + (f" over {c.draws} draws" if c.draws > 1 else "") + (f" {c.note}" if c.note else "")


def _print_draws(console, checks, routed: bool = False) -> None:
    """Say which outputs were judged over several input draws, and why."""
    from .check import VALUES

    many = [c for c in checks if c.draws > 1]
    if many and routed:
        console.print(f"{', '.join(c.name for c in many)}: checked over {many[0].draws} input draws together "
                      f"(a mixture of experts routes a token whose router scores nearly tie by their rounding, "
                      f"eager's too: how often that happens is judged, not one draw's luck)")
    elif many:
        console.print(f"{', '.join(c.name for c in many)}: checked over {many[0].draws} input draws (an output "
                      f"of fewer than {VALUES} values is judged on its values from several draws together: "
                      f"one draw's rounding error is too much a matter of luck)")


RANDOM_OPS = {"dropout", "native_dropout", "feature_dropout", "alpha_dropout", "bernoulli", "rand", "randn",
              "randint", "rand_like", "randn_like", "randint_like", "randperm", "multinomial", "normal", "uniform",
              "exponential", "poisson", "cauchy", "log_normal", "geometric", "random", "rrelu",
              "rrelu_with_noise"}


def random_ops(graph) -> list[str]:
    """The ops of a program that draw random numbers (they run in PyTorch, as externs)."""
    from .graph import ir

    return sorted({n.target for n in graph.nodes if isinstance(n, ir.Extern)
                   and n.target.split(".")[1].rstrip("_") in RANDOM_OPS})


def cmd_run_model(args) -> int:
    """A transformers model through torch.compile(backend="tilefuse"): check, summary, optional bench."""
    import torch
    from rich.markup import escape
    from rich.table import Table

    from . import models
    from .check import VALUES, Results, check_outputs, flatten, float64_reference
    from .frontend import backend as tb

    console = make_console()
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda, but no CUDA GPU is visible")
    dtype = getattr(torch, DTYPES[args.dtype or "bf16"])
    seed = _seed(args)
    built = models.build(args.model, args.layers, args.hidden, args.seq, args.batch, dtype, output=args.output,
                         device=device, vocab=args.vocab, seed=seed)
    model, inputs = built.model, built.inputs
    tb.register()
    torch._dynamo.reset()
    tb.reset()
    compiled = torch.compile(model, backend="tilefuse")

    def run(xs) -> Results:
        with torch.no_grad():
            outs, eager = flatten(compiled(*xs)), flatten(model(*xs))
        return Results(outs, flatten(float64_reference(model, xs)), eager)

    with torch.no_grad():
        t0 = time.perf_counter()
        out = flatten(compiled(*inputs))
        if device == "cuda":
            torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
        eager = flatten(model(*inputs))
    first = Results(out, flatten(float64_reference(model, inputs)), eager)
    names = [args.output] if len(out) == 1 else [f"{args.output}{i}" for i in range(len(out))]
    draws = VALUES if built.routed else 1
    with console.status("") as status:
        def progress(k, n):
            status.update(f"checking: input draw {k + 1} of {n}")

        checks = check_outputs(names, first, lambda k: run(built.fresh_inputs(_draw_seed(seed, k))), draws, progress)
    where = "CUDA kernels" if device == "cuda" else "the Loop IR interpreter (no GPU)"
    shape = f"{args.layers} layers, hidden {args.hidden}, batch {args.batch} x seq {args.seq}, vocab {args.vocab}"
    table = Table(title=escape(f"tilefuse run --model {args.model} ({shape}, {args.dtype or 'bf16'}) [{where}]"))
    for col in ("output", "shape", "error", "torch error", "bound", "result"):
        table.add_column(col)
    for c, o in zip(checks, out):
        table.add_row(*_row(c, o), _verdict(c))
    console.print(table)
    _print_draws(console, checks, built.routed)
    console.print(f"first call (compile + run): {compile_s:.2f} s; seed {seed} (--seed {seed} repeats this run)")
    console.print(tb.summary(), markup=False)
    if args.bench:
        if device != "cuda":
            console.print("--bench needs a GPU; skipped")
        else:
            from .analyze.bench import median_ms, sustained_ms, sustained_timing

            params = list(model.parameters())
            weights = sum(p.numel() * p.element_size() for p in params)
            tokens = inputs[0].numel()  # the ids: every weight meets every token once (2 FLOPs)
            l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
            # a matrix-bound model too large for L2 sets the GPU's clock by its power: each is timed
            # back to back at its own steady clock (analyze.bench), else single calls, L2 flushed
            sustained = sustained_timing(2 * sum(p.numel() for p in params) * tokens, weights, l2)
            timed = sustained_ms if sustained else median_ms
            how = ("ms per forward back to back, each after 1 s of its own (the GPU's steady clock)" if sustained
                   else "median of single forwards, L2 flushed before each")
            with torch.no_grad():
                tf_ms = timed(lambda: compiled(*inputs))
                eager_ms = timed(lambda: model(*inputs))
                torch._dynamo.reset()
                tc = torch.compile(model)
                t0 = time.perf_counter()
                tc(*inputs)
                torch.cuda.synchronize()
                tc_compile_s = time.perf_counter() - t0
                tc_ms = timed(lambda: tc(*inputs))
            bt = Table(title=f"{torch.cuda.get_device_name()}: {how}; same run")
            for col in ("", "ms", "tilefuse speedup", "first call s"):
                bt.add_column(col)
            bt.add_row("tilefuse", f"{tf_ms:.3f}", "1.00", f"{compile_s:.1f}")
            bt.add_row("eager", f"{eager_ms:.3f}", f"{eager_ms / tf_ms:.2f}", "-")
            bt.add_row("torch.compile", f"{tc_ms:.3f}", f"{tc_ms / tf_ms:.2f}", f"{tc_compile_s:.1f}")
            console.print(bt)
    return 0 if all(c.ok for c in checks) else 2


if __name__ == "__main__":
    sys.exit(main())
