"""The correctness rule of DESIGN.md: within 2x PyTorch's own low-precision error.

Errors are relative Frobenius norms against a float64 reference; for integer and bool outputs,
the fraction of elements that differ from it (an output equal to PyTorch's passes). A NaN where
the reference has none never passes.

A float output of fewer than VALUES elements (a mean loss) is judged over several input draws,
as the vector of its values (`check_outputs`): one value carries one random rounding error, and
PyTorch's is sometimes near 0 by luck, which made the bound the floor and failed correct
Llama losses in up to 3 runs in 10. Each float output is judged on at least VALUES values, a
scalar over 16 draws; larger outputs on one draw, as before.

A program that makes discrete choices from rounded values (a mixture of experts routing each
token to the top k of its router's scores) is judged over several draws too (`draws=`): a
score within an ulp of the next routes otherwise under any change of rounding, eager's
included, and a token routed otherwise carries an error far above rounding. On one draw,
whether eager happened to route every token as float64 does decided the verdict (a Mixtral at
`tilefuse run --model mixtral`'s sizes failed 2 seeds in 8 on the CPU while eager routed a
token otherwise than float64 in 4 of the 8); over 16 draws together it is how often each does.
Large outputs are then judged draw by draw and their errors combined (`combine_draws`), so no
draw's tensors are kept.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, replace
from typing import Callable, NamedTuple, Sequence

import torch

FLOOR = 1e-5  # a tiny relative floor, so exact-in-f32 programs are not held to zero error
VALUES = 16  # a float output is judged on at least this many values: a smaller one over several input draws


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    error: float
    torch_error: float
    bound: float
    note: str = ""
    draws: int = 1  # input draws whose values were judged together (see check_outputs)


def rel_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| (Frobenius), or ||x - ref|| where ref is 0. Both are scaled first by
    the power of two nearest ref's largest magnitude (exact): unscaled, float64 values beyond
    ~1e154 squared to inf and the error came out NaN (an f64 output of 1e306 could not pass),
    and values below ~1e-162 squared to 0."""
    x, ref = x.double().cpu(), ref.double().cpu()
    big = ref.abs().max().item() if ref.numel() else 0.0
    if 0 < big < float("inf"):
        scale = math.ldexp(1.0, -math.frexp(big)[1])
        x, ref = x * scale, ref * scale
    denom = ref.norm().item()
    diff = (x - ref).norm().item()
    return diff / denom if denom > 0 else diff  # (ref all zero: nothing was scaled)


def compare(name: str, out: torch.Tensor, ref64: torch.Tensor, torch_out: torch.Tensor) -> Check:
    if tuple(out.shape) != tuple(ref64.shape):
        return Check(name, False, float("inf"), 0.0, 0.0, f"shape {tuple(out.shape)} != {tuple(ref64.shape)}")
    if not out.is_floating_point():
        return _compare_exact(name, out.cpu(), ref64.to(out.dtype).cpu(), torch_out.cpu())
    o, r, t = out.double().cpu(), ref64.double().cpu(), torch_out.double().cpu()
    nan_out = torch.isnan(o) & ~torch.isnan(r) & ~torch.isnan(t)  # (PyTorch's own NaN: judged below)
    if nan_out.any():
        return Check(name, False, float("nan"), 0.0, 0.0, f"{int(nan_out.sum())} NaN where the reference has none")
    # where the reference itself is NaN or infinite, the output must be the same, or PyTorch's
    # value (`sqrt` of a float64 -1e-11 that f16 rounds to -0 is NaN in the reference alone); the
    # error is measured on the finite rest (a NaN there would otherwise make every error NaN)
    finite = torch.isfinite(r)
    same = (o == r) | (torch.isnan(o) & torch.isnan(r)) | (o == t) | (torch.isnan(o) & torch.isnan(t))
    if not same[~finite].all():
        bad = int((~same & ~finite).sum())
        return Check(name, False, float("nan"), 0.0, 0.0, f"{bad} element(s) differ where the reference is not finite")
    # a finite reference beyond the output dtype's range rounds to +-inf there: the output must
    # be that, or PyTorch's value (an inf error there would make the bound inf, passing anything)
    over = finite & (r.abs() > torch.finfo(out.dtype).max)
    n_over = int(over.sum())
    if n_over:
        rounded = r[over].to(out.dtype).double()
        bad = int(((o[over] != rounded) & (o[over] != t[over])).sum())
        if bad:
            return Check(name, False, float("nan"), 0.0, 0.0,
                         f"{bad} element(s) differ where the reference overflows {_dt(out)}")
        finite = finite & ~over
    # where PyTorch's own result is not finite but the reference is (an overflow inside its
    # chain of ops), PyTorch has no error to measure the output by: the output there counts in
    # its error unless it is PyTorch's value, and PyTorch's error is measured on the rest
    torch_off = finite & ~torch.isfinite(t)
    if torch_off.any():
        mine = finite & ~(torch_off & ((o == t) | (torch.isnan(o) & torch.isnan(t))))
        err, terr = rel_error(o[mine], r[mine]), rel_error(t[finite & ~torch_off], r[finite & ~torch_off])
    else:
        err, terr = rel_error(o[finite], r[finite]), rel_error(t[finite], r[finite])
    bound = 2 * terr + FLOOR
    note = f"{n_over} element(s) beyond {_dt(out)}'s range, as PyTorch" if n_over else ""
    if torch_off.any():
        note = (note + "; " if note else "") + f"PyTorch not finite at {int(torch_off.sum())} element(s)"
    return Check(name, err <= bound, err, terr, bound, note)


def draws_needed(torch_out: torch.Tensor) -> int:
    """Input draws that give a float output VALUES values: one draw of a few values cannot judge
    it, since PyTorch's own error (and the bound with it) can be near 0 by luck. 1 for integer
    outputs, which are judged element by element."""
    n = torch_out.numel()
    return -(-VALUES // n) if torch_out.is_floating_point() and 0 < n < VALUES else 1


def compare_draws(name: str, outs: Sequence[torch.Tensor], refs: Sequence[torch.Tensor],
                  torch_outs: Sequence[torch.Tensor]) -> Check:
    """`compare` on one output's values over several input draws, stacked: the same rule on
    enough values for PyTorch's error to be a fair yardstick."""
    for o, r, t in zip(outs, refs, torch_outs):
        if tuple(o.shape) != tuple(r.shape):
            return compare(name, o, r, t)
    stacked = (torch.stack([x.cpu() for x in xs]) for xs in (outs, refs, torch_outs))
    return replace(compare(name, *stacked), draws=len(outs))


def ref_norm(ref: torch.Tensor) -> float:
    """||ref|| over its finite elements (what `compare` measures errors against), in float64."""
    r = ref.double().cpu()
    r = r[torch.isfinite(r)]
    big = r.abs().max().item() if r.numel() else 0.0
    return big * (r / big).norm().item() if big > 0 else 0.0


def combine_draws(name: str, checks: Sequence[Check], norms: Sequence[float]) -> Check:
    """The checks of one output on several draws as one check of the draws stacked: relative
    errors weighed back to absolute ones by each draw's reference norm, their squares summed (as
    `compare_draws` on the stacked tensors, without keeping them). A draw that failed for what
    no error measures (a NaN, a value past the dtype's range) fails the whole."""
    for k, c in enumerate(checks):
        if not c.ok and not math.isfinite(c.error):
            return replace(c, note=f"draw {k}: {c.note}", draws=len(checks))
    den = math.fsum(n * n for n in norms)

    def pooled(errs):
        num = math.fsum((e * n) ** 2 if den > 0 else e * e for e, n in zip(errs, norms))
        return math.sqrt(num / den) if den > 0 else math.sqrt(num)

    err, terr = pooled([c.error for c in checks]), pooled([c.torch_error for c in checks])
    bound = 2 * terr + FLOOR
    notes = "; ".join(dict.fromkeys(c.note for c in checks if c.note))
    return Check(name, err <= bound, err, terr, bound, notes, draws=len(checks))


class Results(NamedTuple):
    """One input draw's outputs, in order: the program's, the float64 reference's, PyTorch's."""

    outs: Sequence[torch.Tensor]
    refs: Sequence[torch.Tensor]
    torch_outs: Sequence[torch.Tensor]


def check_outputs(names: Sequence[str], first: Results, draw: Callable[[int], Results] | None,
                  draws: int = 1, progress: Callable[[int, int], None] | None = None) -> list[Check]:
    """Each output by the 2x rule, on the run's own inputs (`first`); a float output of fewer than
    VALUES elements over as many input draws as the smallest needs (`draws_needed`), `draw(k)`
    giving the results of draw k >= 1. With `draws` > 1 (a program routing by rounded values:
    module docstring) every float output is judged over at least that many draws, the large ones
    draw by draw, combined (`combine_draws`). `draw` runs only where more than one draw is
    needed; None judges every output on `first`. `progress(k, n)` is called before draw k."""
    n = max(max((draws_needed(t) for t in first.torch_outs), default=1), draws) if draw else 1
    small = [i for i, t in enumerate(first.torch_outs) if draws_needed(t) > 1] if n > 1 else []
    pooled = [i for i, t in enumerate(first.torch_outs)
              if n > 1 and draws > 1 and i not in small and t.is_floating_point()]
    values = {i: [tuple(x[i] for x in first)] for i in small}
    per_draw = {i: [(compare(names[i], *(x[i] for x in first)), ref_norm(first.refs[i]))] for i in pooled}
    for k in range(1, n):
        if progress:
            progress(k, n)
        results = draw(k)
        for i in small:  # keep the small outputs only: the others may be large
            values[i].append(tuple(x[i] for x in results))
        for i in pooled:
            per_draw[i].append((compare(names[i], *(x[i] for x in results)), ref_norm(results.refs[i])))
    checks = []
    for i, (name, o, r, t) in enumerate(zip(names, *first)):
        if i in values:
            checks.append(compare_draws(name, *zip(*values[i])))
        elif i in per_draw:
            checks.append(combine_draws(name, *zip(*per_draw[i])))
        else:
            checks.append(compare(name, o, r, t))
    return checks


def _compare_exact(name: str, out: torch.Tensor, ref: torch.Tensor, torch_out: torch.Tensor) -> Check:
    """Integer and bool outputs: errors are the fractions of elements that differ from the
    reference. One equal to PyTorch's own passes (in bf16, `x > 0.3` decides a few elements
    otherwise than float64 does, in eager too); otherwise every element must be the reference's
    or PyTorch's, and the 2x rule holds on those fractions, so a program exact in float64 must
    match exactly, and a value neither gives never passes."""
    n = max(out.numel(), 1)
    eager = torch_out.to(out.dtype)
    err = int((out != ref).sum()) / n
    terr = int((eager != ref).sum()) / n
    if torch.equal(out, eager):
        return Check(name, True, err, terr, 2 * terr, "same as PyTorch" if err else "")
    stray = int(((out != ref) & (out != eager)).sum())
    note = f"{int(round(err * n))} element(s) differ" + (f", {stray} from both" if stray else "") if err else ""
    return Check(name, err <= 2 * terr and not stray, err, terr, 2 * terr, note)


def float64_reference(fn, inputs):
    """Run `fn` with its weights and float inputs in float64, all the way through.

    Casts the program makes itself (`x.to(torch.bfloat16)`, `.half()`, `.float()`, `type_as`,
    a `dtype=` argument) keep float64 values float64: a reference rounded to bf16 at its end
    would equal eager's own bf16 result, make PyTorch's error 0 and the 2x bound the floor,
    and fail any correct kernel whose sum order rounds one element the other way. Floats made
    from integers are float64 too, by a cast (`randint(...).bfloat16()`) or by promotion
    (`cos` of an int tensor, under float64 as the default dtype): until then such a program's
    reference was eager itself, and `F.instance_norm(randint(...).bfloat16())` FAILed with a
    correctly rounded result (error 3e-3 against PyTorch's 0).
    """
    fn64 = copy.deepcopy(fn).double() if isinstance(fn, torch.nn.Module) else fn
    args = [x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs]
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with torch.no_grad(), _KeepFloat64():
            return fn64(*args)
    finally:
        torch.set_default_dtype(default)


_CASTS = {torch.Tensor.to, torch.Tensor.type, torch.Tensor.type_as, torch.Tensor.bfloat16, torch.Tensor.half,
          torch.Tensor.float, torch.Tensor.double}


def _grouped_mm64(a, b, offs=None, bias=None, out_dtype=None):
    """torch._grouped_mm in float64, which PyTorch's own takes only in 16- and 32-bit floats (a
    mixture of experts' layers in transformers call it): rows offs[i-1]:offs[i] of a 2-D `a`
    times expert b[i], or a batch of products of 3-D operands."""
    if a.dim() == 2 and b.dim() == 3 and offs is not None:
        out = a.new_zeros(a.shape[0], b.shape[-1])
        start = 0
        for i, end in enumerate(offs.tolist()):
            out[start:end] = a[start:end] @ b[i]
            start = end
    elif a.dim() == 3 and b.dim() == 3 and offs is None:
        out = a @ b
    else:
        raise NotImplementedError(f"grouped_mm of {a.dim()}-D by {b.dim()}-D operands in float64")
    return out if bias is None else out + bias


_GROUPED = {torch._grouped_mm} | ({torch.nn.functional.grouped_mm} if hasattr(torch.nn.functional, "grouped_mm")
                                  else set())


class _KeepFloat64(torch.overrides.TorchFunctionMode):
    """Float casts of float64 tensors return them unchanged, and of integer and bool tensors
    give float64 (exact); float `dtype=` arguments become float64; where a float64 tensor meets
    a lower-precision float one (an integer tensor cast with `.float()`, say, then a matmul with
    a float64 buffer, as transformers' rotary embedding does), the other is raised to float64
    too rather than failing the op."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        tensors = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        if any(t.dtype == torch.float64 for t in tensors) or (tensors and not any(t.is_floating_point() for t in tensors)):
            if isinstance(kwargs.get("dtype"), torch.dtype) and kwargs["dtype"].is_floating_point:
                kwargs["dtype"] = torch.float64
            if func not in _CASTS and any(t.is_floating_point() and t.dtype != torch.float64 for t in tensors):
                def up(x):
                    return x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x
                args, kwargs = torch.utils._pytree.tree_map(up, (args, kwargs))
            if func in _GROUPED:
                return _grouped_mm64(*args, **kwargs)
            if func in _CASTS and args and isinstance(args[0], torch.Tensor) and (
                    args[0].dtype == torch.float64 or not args[0].is_floating_point()):
                out = func(*args, **kwargs)
                if isinstance(out, torch.Tensor) and out.is_floating_point():
                    return args[0].to(device=out.device, dtype=torch.float64)
                return out
        return func(*args, **kwargs)


def flatten(x) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(x) if isinstance(t, torch.Tensor)]


def _dt(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")
