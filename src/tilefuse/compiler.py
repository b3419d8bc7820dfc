"""The pipeline, stage by stage: capture -> Graph IR -> rewrites -> plan -> Loop IR -> program."""
from __future__ import annotations

import operator
import sys
from dataclasses import dataclass, field

import torch

from . import collector, env
from .frontend.capture import export_and_log, to_graph
from .graph import ir
from .graph.fold import fold_weights
from .graph.rules.causal_mask import causal_masks
from .graph.rules.gqa_attention import repeated_kv_into_attention
from .graph.fusion import Plan, plan
from .graph.rewrites import Fired, run_rewrites
from .loop.lower import Lowered, lower_step
from .loop.lower_gemm import LoweredGemm, lower_gemm_step
from .runtime.program import Program, skeleton
from .tune.lookup import tuned_schedule


@dataclass
class Compiled:
    """Every stage of one compilation, printable, plus the runnable program."""

    captured: ir.Graph
    graph: ir.Graph
    fired: list[Fired]
    plan: Plan
    kernels: dict[str, Lowered]
    program: Program
    timings: dict = field(default_factory=dict)
    gemms: dict[str, LoweredGemm] = field(default_factory=dict)


def gemm_enabled(arch: str | None) -> bool:
    """Generated GEMMs are planned for sm_80 and newer targets (sm_90a: TMA + wgmma; others:
    cp.async + mma.sync) and for the CPU interpreter; TILEFUSE_GEMM=0 leaves every matmul to cuBLAS."""
    if not env.switch("TILEFUSE_GEMM"):
        return False
    if arch is None:
        if torch.cuda.is_available():
            return torch.cuda.get_device_capability() >= (8, 0)
        return True
    from .runtime.nvrtc import normalize_arch

    return int(normalize_arch(arch)[3:].rstrip("a")) >= 80


def lower_plan(graph: ir.Graph, p: Plan) -> tuple[dict[str, Lowered], dict[str, LoweredGemm]]:
    """Loop IR for every generated kernel of a plan: map-reduce kernels and GEMM epilogues."""
    kernels, gemms = {}, {}
    for step in p.steps:
        if step.family in ("mapreduce", "gemm"):
            _refuse_empty(graph, step)
        if step.family == "mapreduce":
            kernels[step.name] = lower_step(graph, step, f"tf_{step.name}")
            if kernels[step.name].walk and not step.note:
                step.note = kernels[step.name].walk
        elif step.family == "gemm":
            gemms[step.name] = lower_gemm_step(graph, step, f"tf_{step.name}_epilogue")
    return kernels, gemms


def _refuse_empty(graph: ir.Graph, step) -> None:
    """A generated kernel's loops need at least one element: a zero-size tensor in one (an
    empty batch, a slice of nothing) is refused by name, not left to a Loop IR verifier error."""
    for name in (*step.inputs, *step.nodes):
        n = graph[name]
        if 0 in n.type.shape:
            where = n.source or ("an input" if isinstance(n, ir.Input) else n.describe())
            raise ValueError(f"{name}: {n.type} has no elements ({where}); tilefuse's kernels do not take "
                             f"zero-size tensors")


def norm_partials_enabled() -> bool:
    """A norm's row sums in the producing GEMM's epilogue (graph/rules/rmsnorm_partials.py,
    layernorm_partials.py); on by default; TILEFUSE_NORM_PARTIALS=0 turns them off (to compare,
    bench/LOG_blocks.md)."""
    return env.switch("TILEFUSE_NORM_PARTIALS")


def rope_epilogue_enabled() -> bool:
    """RoPE moved into the Q/K projections' epilogues (graph/rules/rope_epilogue.py); on by
    default since it was checked and timed on an H100 (bench/LOG_blocks.md);
    TILEFUSE_ROPE_EPILOGUE=0 turns it off."""
    return env.switch("TILEFUSE_ROPE_EPILOGUE")


def _partials_target(arch: str | None) -> bool:
    """Whether GEMM epilogues may end in partial row reductions here: the sm_90a template
    renders them, the sm_80 one declines; without a GPU the interpreter runs them."""
    if arch is None:
        return not torch.cuda.is_available() or torch.cuda.get_device_capability() == (9, 0)
    from .runtime.nvrtc import normalize_arch

    return normalize_arch(arch) == "sm_90a"


def compile_stages(fn, example_inputs, *, expr: str | None = None, arch: str | None = None,
                   exported=None, in_torch: frozenset = frozenset()) -> Compiled:
    """`exported`: fn's torch.export for these inputs, when the caller has it (frontend.sizes).
    `in_torch`: maps to run in PyTorch (graph.fusion.plan)."""
    try:
        with collector.paused():  # (its full collections walked the whole process: collector.py)
            return _stages(fn, example_inputs, expr, arch, exported, in_torch)
    except RecursionError:
        import sys

        from .frontend.capture import CaptureError

        # the passes walk dependency chains with stacks of their own (tests/cpu/test_deep_programs.py);
        # should one still recurse as deep as a chain of ops, say so, not a stack dump
        raise CaptureError(f"{expr or getattr(fn, '__name__', type(fn).__name__)}: its chain of dependent ops is "
                           f"too long for tilefuse's passes (Python's recursion limit, "
                           f"{sys.getrecursionlimit()}, ran out)") from None


def _stages(fn, example_inputs, expr: str | None, arch: str | None, exported=None,
            in_torch: frozenset = frozenset()) -> Compiled:
    import time

    t0 = time.perf_counter()
    ep, said = (exported, "") if exported is not None else export_and_log(fn, example_inputs, expr=expr)
    t1 = time.perf_counter()
    captured = to_graph(ep, expr=expr)
    sys.stderr.write(said)
    graph, fired = run_rewrites(captured)
    gemm = gemm_enabled(arch)
    if gemm:  # the transformer glue moves into GEMM epilogues (weights folded here, once)
        from .graph.rules import run_coda

        graph, more = run_coda(graph)
        fired = fired + more
    # after CODA: it folds what the rules built, too; a causal mask known by then becomes
    # is_causal; grouped-query attention reads k and v before their repeat
    # attention written out in ops (transformers' eager attention) becomes SDPA first
    from .graph.rules.eager_attention import eager_attention_as_sdpa

    graph, more = run_rewrites(graph, (eager_attention_as_sdpa, fold_weights, causal_masks,
                                       repeated_kv_into_attention))
    fired = fired + more
    if gemm and rope_epilogue_enabled():  # needs the folded cos/sin tables
        from .graph.rules.rope_epilogue import rope_into_projection
        from .graph.rules.rope_rotate_half import rotate_half_to_pairs

        # HF's rotate-half form becomes the adjacent-pair one on permuted weights first
        graph, more = run_rewrites(graph, (rotate_half_to_pairs, rope_into_projection))
        fired = fired + more
    # what rotate-half RoPE left (HF's at a decode step: its k goes into the cache): neg's as
    # signs, then the cat of the two halves as a roll, which the kernel reading it reads in place
    # (RoPE after a q/k norm is computed in the norm's order, and a roll of the norm's output
    # moves below the norm's maps, onto q itself: one kernel)
    from .graph.rules.cat_maps import cats_as_maps, stacks_as_maps
    from .graph.rules.cat_roll import rotated_cat_as_roll
    from .graph.rules.permute_lift import maps_in_source_order
    from .graph.rules.roll_sink import rolls_into_maps
    from .graph.rules.cat_signs import negated_pieces_as_signs
    from .graph.rules.gather_sink import gathers_through_maps, split_gathers
    from .graph.rules.reshape_hoist import leading_reshapes_into_maps
    from .graph.rules.apart_reductions import reductions_in_runs
    from .graph.rules.merged_reductions import merged_reductions
    from .graph.rules.permute_sink import permutes_into_maps, results_in_eager_layout, transposed_results_as_copies
    from .graph.rules.result_copies import result_views_as_copies
    from .graph.rules.slice_sink import slices_into_maps
    from .graph.rules.small_reductions import short_reductions_as_maps

    # then a permute of a map's result moves onto its arguments, where the kernel reads them in
    # place: those of results PyTorch lays out permuted too, computed in that order; a result
    # still transposed is copied by a kernel reading it in tiles. A reduction over dims apart
    # (`x.mean((0, 2, 3))`) first becomes one a run of neighbouring dims; one over neighbouring
    # dims, one over a dim of a reshape (`x.mean((2, 3))`), which the planner takes;
    # one over a short dim that is not the last (a mixture of experts' sum over its top k), maps;
    # slices of a map (the halves of a masked gate/up product) are maps of slices; a gather of
    # a map (experts' rows back in token order), the map of gathered arguments; a reshape of
    # the tokens' rows ([T, D] -> [B, S, D]), a reshape of the tensors those maps read
    graph, more = run_rewrites(graph, (reductions_in_runs, merged_reductions, short_reductions_as_maps, slices_into_maps,
                                       split_gathers, gathers_through_maps, leading_reshapes_into_maps,
                                       negated_pieces_as_signs, rotated_cat_as_roll, maps_in_source_order, rolls_into_maps, stacks_as_maps, cats_as_maps,
                                       results_in_eager_layout,
                                       permutes_into_maps, transposed_results_as_copies, result_views_as_copies))
    fired = fired + more
    if gemm and _partials_target(arch):  # GEMM-epilogue partials: the sm_90a template (or the interpreter)
        from .graph.rules.lmhead_ce import lmhead_ce_partials
        from .graph.rules.layernorm_partials import layernorm_partials
        from .graph.rules.rmsnorm_partials import rmsnorm_partials

        rules = ((lmhead_ce_partials, rmsnorm_partials, layernorm_partials) if norm_partials_enabled()
                 else (lmhead_ce_partials,))
        graph, more = run_rewrites(graph, rules)
        fired = fired + more
    p = plan(graph, gemm=gemm, partials=_partials_target(arch), in_torch=in_torch)
    kernels, gemms = lower_plan(graph, p)
    t2 = time.perf_counter()
    program = Program(graph, p, kernels, out_spec=ep.call_spec.out_spec, arch=arch, schedules=tuned_schedule,
                      gemms=gemms)
    return Compiled(captured, graph, fired, p, kernels, program,
                    {"export_s": t1 - t0, "lower_s": t2 - t1}, gemms)


_VERSION = operator.attrgetter("_version")


class WeightGuard:
    """Whether the tensors a program took its weights from still hold what it compiled.

    Weights are read once, and rewrites fold some into new tensors (RMSNorm's gamma into the
    next matmul's weight, say), so a program must not outlive an in-place update of one
    (`optimizer.step()`, `load_state_dict`, `with torch.no_grad(): w.mul_(2)`): its version
    counter moves. A module's parameter or buffer replaced by another tensor is caught too, and
    a module switched between training and eval mode (`model.eval()` after compiling a module
    made in training mode, as nn.Modules are): the module itself and each submodule whose
    forward depends on the mode (dropout, batch norm) are watched.
    Calling the guard returns "" while everything is as compiled, else what changed.
    """

    def __init__(self, fn, graph: ir.Graph):
        # parameters made under torch.inference_mode() keep no version counter: _guarded gives up
        self.tensors, self.versions, self.names = [], [], []
        # (a module's _parameters, _buffers or _modules, key, what was there when compiled, what a change means)
        self.slots = []
        self._linked = set()
        module = fn if isinstance(fn, torch.nn.Module) else None
        # (a module, its mode when compiled, its name): checked every call, so only those whose mode
        # is known to change what they compute, and the module itself (`model.eval()` flips all)
        self.modes = [] if module is None else [
            (m, m.training, name) for name, m in module.named_modules() if not name or isinstance(m, _MODAL)]
        for node in graph.nodes:
            if not isinstance(node, ir.Weight) or node.name not in graph.weights:
                continue
            t = graph.weights[node.name]
            if not isinstance(t, torch.Tensor):
                continue
            self.tensors.append(t)  # detached from the original: it shares its version counter
            self.versions.append(t._version)
            self.names.append(node.source or node.name)
            if module is not None and node.source:
                self._slot(module, node.source, t)

    def _slot(self, module, target: str, t: torch.Tensor):
        """Watch the tensor's place in the module, and each submodule on the way to it: a layer
        replaced (`model[2] = nn.Linear(...)`) leaves the old one's tables as they were."""
        prefix, _, key = target.rpartition(".")
        owner, links, path = module, [], []
        for part in prefix.split(".") if prefix else ():
            child = getattr(owner, "_modules", {}).get(part)
            if child is None:
                return
            path.append(part)
            links.append((owner._modules, part, child, f"module {'.'.join(path)} was replaced by another module"))
            owner = child
        for table in (owner._parameters, owner._buffers):
            orig = table.get(key)
            if isinstance(orig, torch.Tensor) and orig.data_ptr() == t.data_ptr():
                for link in links:
                    if (id(link[0]), link[1]) not in self._linked:
                        self._linked.add((id(link[0]), link[1]))
                        self.slots.append(link)
                self.slots.append((table, key, orig, f"weight {target} was replaced by another tensor"))
                return

    def __call__(self) -> str:
        # every call pays this (~0.2 us a weight on a CPU core), so the common answer is found in bulk
        if list(map(_VERSION, self.tensors)) == self.versions and all(
                [table.get(key) is orig for table, key, orig, _ in self.slots]) and all(
                [m.training == mode for m, mode, _ in self.modes]):
            return ""
        for t, v, name in zip(self.tensors, self.versions, self.names):
            if t._version != v:
                return f"weight {name} was updated in place"
        for m, mode, name in self.modes:
            if m.training != mode:
                return f"{f'module {name}' if name else 'the module'} was switched to " \
                       f"{'training' if m.training else 'eval'} mode"
        return next(why for table, key, orig, why in self.slots if table.get(key) is not orig)


# modules whose forward computes something else in training mode than in eval mode
_MODAL = (torch.nn.modules.dropout._DropoutNd, torch.nn.modules.batchnorm._NormBase)


def _guarded(graph: ir.Graph, fn) -> WeightGuard | None:
    try:
        guard = WeightGuard(fn, graph)
    except RuntimeError:  # inference tensors keep no version counter: nothing to check against
        return None
    return guard if guard.tensors or guard.modes else None


def compile(fn, example_inputs, *, arch: str | None = None, graphs: bool | None = None):
    """Compile a callable or nn.Module for these example inputs; returns a callable like it.

    The result runs generated CUDA kernels on CUDA tensors and the Loop IR interpreter on
    CPU tensors. Shapes and dtypes are fixed to the examples'. On CUDA, a program of two or
    more launches replays a captured CUDA graph after the first call (`graphs=False` or
    TILEFUSE_CUDA_GRAPHS=0 turns that off; `graphs=True` replays single-kernel programs too,
    which the default leaves out: their graph saves no host launch and costs GPU time; the
    graphs of a process hold at most TILEFUSE_GRAPH_MEMORY of a device, a quarter by default,
    past which new programs launch their kernels one by one); a result you still hold is never
    overwritten by a later call. A module's parameter or buffer
    updated in place after compiling (`optimizer.step()`, `load_state_dict`), or replaced, or the
    module switched between training and eval mode (`model.eval()`; the mode compiled is the
    module's at compile time: nn.Modules are made in training mode),
    compiles the program again at its next call, with a warning (updates through `.data`, and
    tensors a plain function closes over, are not seen: compile again after changing those).
    An input the program writes in place (`cache.index_copy_(...)`, `x.add_(1)`) holds the new
    value after each call, as in eager; inputs that share memory with a written one are refused.
    """
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if isinstance(example_inputs, dict):  # (a tuple of it would be its keys)
        raise TypeError("example_inputs is a dict: pass the positional inputs as a tuple, "
                        "(x,) or (x, y); a dict of tensors may be one of them, ({'x': x},)")
    c = compile_stages(fn, tuple(example_inputs), arch=arch)
    if graphs is not None:
        c.program.graphs = graphs
    cuda = [x.device for x in example_inputs if isinstance(x, torch.Tensor) and x.is_cuda]
    if cuda:
        c.program.prepare(cuda[0])
    c.program.stages = c
    c.program.inputs = skeleton(tuple(example_inputs))
    # a module's weight updated in place (or replaced) compiles again at the next call: a value
    # folded at compile time is not served stale. Only a module's: the tensors a plain function
    # closes over are exported as constants that share their memory but not their version counter.
    c.program.guard = _guarded(c.captured, fn) if isinstance(fn, torch.nn.Module) else None
    c.program.rebuild = lambda args: compile(fn, args, arch=arch, graphs=graphs)
    return c.program
