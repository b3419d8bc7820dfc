"""Judging one random program: eager against tilefuse on fresh inputs, elementwise.

Stricter than the project's 2x rule (tilefuse.check): each element must be within 3x eager's
own error against a float64 reference plus a small relative tolerance, integers and bools
must be equal, NaN and inf patterns must match eager's or the reference's. So it also flags
differences the 2x rule allows (a value kept in f32 where eager rounds it to 16 bits, then
converted to an integer); read each finding before calling it a defect (fuzz/README.md)."""
import traceback
import warnings

import torch

import tilefuse
warnings.filterwarnings("ignore")
from tilefuse.frontend.capture import CaptureError

ULP = {torch.bfloat16: 2**-8, torch.float16: 2**-11, torch.float32: 2**-24, torch.float64: 2**-53}

def _leaves(x):
    return [t for t in torch.utils._pytree.tree_leaves(x) if isinstance(t, torch.Tensor)]

def ref64(fn, inputs):
    from tilefuse.check import float64_reference
    try:
        return _leaves(float64_reference(fn, inputs))
    except Exception:
        return None

def compare(e, t, r, name="", coarse=None):
    """e: eager, t: tilefuse, r: f64 reference (or None). returns problem string or None"""
    if not isinstance(t, torch.Tensor):
        return f"{name} not a tensor: {type(t)}"
    if t.dtype != e.dtype:
        return f"{name} dtype {t.dtype} != eager {e.dtype}"
    if tuple(t.shape) != tuple(e.shape):
        return f"{name} shape {tuple(t.shape)} != eager {tuple(e.shape)}"
    if not e.is_floating_point():
        if not torch.equal(t, e):
            bad = (t != e)
            return f"{name} int mismatch {int(bad.sum())}/{e.numel()}: eager {e[bad][:4].tolist()} tf {t[bad][:4].tolist()}"
        return None
    ed, td = e.double(), t.double()
    if r is not None and r.shape == e.shape and r.is_floating_point():
        rd = r.to(e.dtype).double()
        def pat(z): return torch.isnan(z), torch.isinf(z) & (z > 0), torch.isinf(z) & (z < 0)
        pt, pe, pr = pat(td), pat(ed), pat(rd)
        same_e = all(torch.equal(x, y) for x, y in zip(pt, pe))
        same_r = all(torch.equal(x, y) for x, y in zip(pt, pr))
        if not same_e and not same_r:
            return f"{name} nonfinite mismatch: nan eager {int(pe[0].sum())} ref {int(pr[0].sum())} tf {int(pt[0].sum())}; inf eager {int(pe[1].sum()+pe[2].sum())} ref {int(pr[1].sum()+pr[2].sum())} tf {int(pt[1].sum()+pt[2].sum())}"
        fin = torch.isfinite(ed) & torch.isfinite(td) & torch.isfinite(rd)
        if not same_e:
            fin &= torch.isfinite(r.double())
    else:
        nan_e, nan_t = torch.isnan(ed), torch.isnan(td)
        if not torch.equal(nan_e, nan_t):
            return f"{name} NaN mismatch eager {int(nan_e.sum())} tf {int(nan_t.sum())}"
        fin = torch.isfinite(ed) & torch.isfinite(td)
        if not torch.equal(ed[~fin & ~nan_e], td[~fin & ~nan_e]):
            return f"{name} inf mismatch"
    if fin.sum() == 0:
        return None
    ef, tf = ed[fin], td[fin]
    u = ULP[e.dtype]
    if coarse is not None and ULP[coarse] > u and e.dtype in (torch.float32, torch.float64):
        rtol0 = 4 * ULP[coarse]
    else:
        rtol0 = None
    if r is not None and r.shape == e.shape and r.is_floating_point():
        rf = r.double()[fin]
    else:
        rf = ef
    scale = rf.abs().max().item() + 1e-30
    rtol = rtol0 or {torch.float32: 1e-5, torch.float64: 1e-10}.get(e.dtype, 4 * u)
    atol = {torch.float32: 1e-6, torch.float64: 1e-12}.get(e.dtype, 1e-3 * u)
    terr = (tf - rf).abs(); eerr = (ef - rf).abs()
    lim = 3 * eerr + rtol * (rf.abs() + 1e-3 * scale) + atol
    if (terr > lim).any():
        i = (terr - lim).argmax()
        return f"{name} value mismatch ({e.dtype}): ref {rf[i].item()!r} eager {ef[i].item()!r} tf {tf[i].item()!r}"
    return None

def _through_backend(fn, example, fresh):
    """The program under torch.compile(backend="tilefuse"): compiled on a call with the example
    inputs, then called on the fresh ones (a replay where it can), then on the example again, so
    a result overwritten by a later call shows as a mismatch. Graphs tilefuse refuses run in
    eager there, visibly in the backend's reports; here they simply pass."""
    from tilefuse.frontend import backend

    backend.register()  # from a source tree on PYTHONPATH the entry point is not installed
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="tilefuse", dynamic=False)
    with torch.no_grad():
        compiled(*[x.clone() for x in example])
        out = compiled(*[x.clone() for x in fresh])
        compiled(*[x.clone() for x in example])
    return out


def check_sizes(fn, example, others, coarse=None):
    """The program under torch.compile(backend="tilefuse") with dynamo's default shape handling:
    called at the example's sizes, then at each of `others` (inputs where one dim size, the same
    in every input holding it, is another). Dynamo's second compile is symbolic, so the later
    sizes go through tilefuse's size variants (one symbolic export instantiated per size, or a
    program made with no compile); each later call is judged against eager at its sizes, and a
    last call at the example's sizes again (the first size's variant, picked once more)."""
    from tilefuse.frontend import backend

    others = list(others) + [example]
    eagers = []
    for inputs in others:
        try:
            with torch.no_grad():
                eagers.append(fn(*[x.clone() for x in inputs]))
        except Exception as ex:
            return "skip", f"eager at other sizes: {type(ex).__name__}: {str(ex)[:100]}"
    backend.register()
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="tilefuse")
    outs = []
    try:
        with torch.no_grad():
            compiled(*[x.clone() for x in example])  # (not judged: the last of `others` is this size again)
            for inputs in others:
                outs.append(compiled(*[x.clone() for x in inputs]))
    except torch._dynamo.exc.TorchRuntimeError as ex:
        return "skip", f"dynamo: {str(ex).splitlines()[0][:200]}"
    except Exception as ex:
        return "crash", "backend sizes " + "".join(traceback.format_exception(ex)[-6:])
    for inputs, eager, out in zip(others, eagers, outs):
        st, msg = _judge(fn, inputs, eager, out, coarse)
        if st != "ok":
            return st, f"at {[tuple(x.shape) for x in inputs]}: {msg}"
    return "ok", ""


def check(fn, example, fresh=None, verbose=True, coarse=None, backend=False):
    """returns (status, msg): status in ok/skip/bad/crash. backend=True runs the program under
    torch.compile(backend="tilefuse") instead of tilefuse.compile."""
    fresh = fresh if fresh is not None else example
    try:
        with torch.no_grad():
            eager = fn(*[x.clone() for x in fresh])
    except Exception as ex:
        return "skip", f"eager: {type(ex).__name__}: {str(ex)[:100]}"
    if backend:
        try:
            out = _through_backend(fn, example, fresh)
        except torch._dynamo.exc.TorchRuntimeError as ex:  # dynamo's own tracing (a meta kernel eager lacks
            # or disagrees with: `bool >> int`), before any backend runs: PyTorch's, not tilefuse's
            return "skip", f"dynamo: {str(ex).splitlines()[0][:200]}"
        except Exception as ex:
            return "crash", "backend " + "".join(traceback.format_exception(ex)[-6:])
        return _judge(fn, fresh, eager, out, coarse)
    try:
        prog = tilefuse.compile(fn, tuple(x.clone() for x in example))
    except CaptureError as ex:
        return "skip", f"capture: {str(ex)[:200]}"
    except (ValueError, NotImplementedError) as ex:
        msg = str(ex)
        return "crash" if "internal" in msg else "skip", f"compile {type(ex).__name__}: {msg[:300]}"
    except Exception as ex:
        return "crash", "compile " + "".join(traceback.format_exception(ex)[-6:])
    try:
        out = prog(*[x.clone() for x in fresh])
    except Exception as ex:
        return "crash", "run " + "".join(traceback.format_exception(ex)[-6:])
    return _judge(fn, fresh, eager, out, coarse)


def _judge(fn, fresh, eager, out, coarse):
    el, tl = _leaves(eager), _leaves(out)
    if len(el) != len(tl):
        return "bad", f"{len(tl)} outputs vs {len(el)}"
    rl = ref64(fn, [x.clone() for x in fresh]) or [None] * len(el)
    if len(rl) != len(el):
        rl = [None] * len(el)
    for i, (e, t, r) in enumerate(zip(el, tl, rl)):
        p = compare(e, t, r, f"out{i}", coarse)
        if p:
            return "bad", p
    return "ok", ""
