"""Random programs: `def f(a, b, c)` built line by line from about 300 PyTorch ops and forms
(maps, reductions, views, casts, comparisons, norms, losses, small matmuls, in-place ops),
each line kept only if eager runs it. Inputs mix float, integer and bool dtypes and odd
shapes; special values (zeros, halves, large and tiny magnitudes) appear on purpose.
`BIG = True` draws rows of 1000 to 70001 elements (vector loads, cluster rows) and larger
matmuls; `MAXN` caps every value's element count."""
import random, torch, math
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

FD = ["torch.float32", "torch.float64", "torch.bfloat16", "torch.float16"]
ID = ["torch.int32", "torch.int64", "torch.uint8", "torch.int8"]
ALLD = FD + ID + ["torch.bool"]

MAXN = 20000
BIG = False
def rand_shape(r):
    if BIG:
        k = r.choice([1, 2, 2, 2, 3])
        sizes = [1, 3, 8, 64, 127, 256, 1000, 2048, 4099]
        for _ in range(20):
            sh = [r.choice(sizes) for _ in range(k)]
            if r.random() < 0.25: sh[-1] = r.choice([8192, 16383, 33000, 65536, 70001])
            n = 1
            for v in sh: n *= v
            if n <= MAXN // 4: return tuple(sh)
        return (r.choice(sizes),)
    k = r.choice([0, 1, 1, 2, 2, 2, 3, 3, 4])
    return tuple(r.choice([1, 1, 2, 3, 4, 5, 7, 8, 13, 16, 33]) for _ in range(k))

def other_sizes(example, r, device):
    """Two sets of fresh inputs where one dim size of the example (above 1, so dynamo makes it
    symbolic) is another, in every input holding it; None when no dim is above 1."""
    dims = sorted({d for x in example for d in x.shape if d > 1})
    if not dims:
        return None
    d = r.choice(dims)
    return [[make_input(r, tuple(new if s == d else s for s in x.shape), str(x.dtype)).to(device) for x in example]
            for new in (d + 2, d + 5)]


def make_input(r, shape, dt, seed=None):
    g = torch.Generator().manual_seed(seed if seed is not None else r.randrange(1 << 30))
    dtype = eval(dt)
    kind = r.choice(["normal", "normal", "wide", "small", "special"])
    if dtype.is_floating_point:
        x = torch.randn(shape, generator=g, dtype=torch.float64)
        if kind == "wide": x = x * 100
        if kind == "small": x = x * 0.01
        if kind == "special":
            m = torch.rand(shape, generator=g)
            x = torch.where(m < 0.1, torch.zeros(()), x)
            x = torch.where((m > 0.1) & (m < 0.15), torch.round(x * 2) / 2, x)
        return x.to(dtype)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype == torch.uint8:
        return torch.randint(0, 256 if kind == "wide" else 10, shape, generator=g, dtype=dtype)
    if dtype == torch.int8:
        return torch.randint(-128 if kind == "wide" else -5, 128 if kind == "wide" else 6, shape, generator=g, dtype=dtype)
    lo, hi = (-(1 << 30), 1 << 30) if kind == "wide" else (-10, 11)
    return torch.randint(lo, hi, shape, generator=g, dtype=dtype)

def scal(r, ints=False):
    c = r.random()
    if c < 0.3 or ints: return repr(r.choice([0, 1, 2, 3, -1, -2, 5, 7, 100, 255, 300, -129]))
    if c < 0.4: return repr(r.choice([True, False]))
    return repr(r.choice([0.5, -0.5, 1.5, 2.0, 0.0, -3.25, 1e-3, 1e5, 0.1, 2049.0, 1e-8, float("inf")]) if r.random() < 0.95 else "float('nan')")

def dimarg(r, rank):
    if rank == 0: return r.choice([0, -1])
    return r.randrange(-rank, rank)

NAMES = {"torch": torch, "F": F, "math": math}  # what a generated line may name
PEAK = 1 << 28  # elements: a line any of whose ops makes a value larger is never run on real tensors


class _Largest(TorchDispatchMode):
    """Records the largest value any op makes (on meta tensors: shapes only, no memory)."""
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def too_big(line, env):
    """Whether `line` would make a value its size check rejects (> MAXN elements, outside a
    tuple) or a temporary of more than PEAK elements: found on meta tensors, so a line that
    broadcasts two large values is refused before it takes gigabytes. A line meta tensors
    cannot run (data-dependent sizes, .item()) is left to the real run, as before."""
    meta = {k: v.to("meta") for k, v in env.items()}
    mode, val = _Largest(), None
    try:
        with torch.no_grad(), mode:
            val = eval(line, dict(NAMES), meta)
    except Exception:
        pass
    return mode.largest > PEAK or (isinstance(val, torch.Tensor) and val.numel() > MAXN)


class Gen:
    def __init__(self, seed):
        self.r = random.Random(seed)
        self.seed = seed

    def build(self, nlines=None):
        r = self.r
        nin = r.choice([1, 1, 2, 2, 3])
        base = rand_shape(r)
        self.vars = {}
        self.env = {}
        self.inputs_desc = []
        names = "abc"[:nin]
        for i, n in enumerate(names):
            dt = r.choice(FD * 3 + ID + ["torch.bool"])
            if r.random() < 0.6:
                sh = base
            elif r.random() < 0.5 and base:  # broadcastable
                sh = tuple(s if r.random() < 0.6 else 1 for s in base)
                sh = sh[r.randrange(len(sh) + 1):] if r.random() < 0.3 else sh
            else:
                sh = rand_shape(r)
            self.inputs_desc.append((sh, dt))
            self.env[n] = make_input(r, sh, dt)
        self.args = list(names)
        self.lines = []
        nlines = nlines or r.randint(3, 10)
        tries = 0
        while len(self.lines) < nlines and tries < 200:
            tries += 1
            line = self.gen_line()
            if line is None: continue
            v = f"v{len(self.lines)}"
            if too_big(line, self.env):
                continue
            try:
                with torch.no_grad():
                    val = eval(line, dict(NAMES), dict(self.env))
            except Exception:
                continue
            if isinstance(val, (tuple, list)):
                if not all(isinstance(t, torch.Tensor) for t in val) or not val: continue
                k = r.randrange(len(val))
                line = f"({line})[{k}]"
                val = val[k]
            if not isinstance(val, torch.Tensor): continue
            if val.numel() > MAXN or val.numel() == 0: continue
            self.env[v] = val
            self.lines.append(f"{v} = {line}")
        if not self.lines: return None
        outs = [f"v{len(self.lines)-1}"]
        if r.random() < 0.3 and len(self.lines) > 1:
            outs.append(r.choice([f"v{i}" for i in range(len(self.lines) - 1)]))
        self.src = f"def f({', '.join(names)}):\n" + "".join(f"    {l}\n" for l in self.lines) + f"    return {', '.join(outs)}\n"
        return self.src

    def pick(self, pred=lambda t: True):
        c = [k for k, v in self.env.items() if pred(v)]
        if not c: return None
        # prefer recent
        return c[-1] if self.r.random() < 0.65 else self.r.choice(c)

    def gen_line(self):
        r = self.r
        x = self.pick()
        t = self.env[x]
        rank = t.dim()
        y = self.pick()
        cat = r.choice(["bin", "bin", "scal", "un", "un", "red", "red", "view", "view", "cast", "cmp", "misc", "nn", "mm", "inplace",
                        "late"])
        if cat == "bin":
            op = r.choice(["+", "-", "*", "/", "**", "%", "//"] + ["torch.maximum", "torch.minimum", "torch.fmod", "torch.remainder",
                            "torch.atan2", "torch.logical_and", "torch.logical_or", "torch.logical_xor", "&", "|", "^",
                            "torch.bitwise_and", "torch.bitwise_or", "torch.bitwise_xor", "torch.hypot", "torch.copysign",
                            "torch.true_divide", "torch.floor_divide", "torch.sub", "torch.rsub", "torch.mul"])
            if op[0].isalpha(): return f"{op}({x}, {y})"
            return f"{x} {op} {y}"
        if cat == "scal":
            s = scal(r)
            op = r.choice(["+", "-", "*", "/", "**", "%", "//", "&", "|", "<<", ">>"])
            if r.random() < 0.4: return f"{s} {op} {x}"
            if r.random() < 0.2: return f"torch.{r.choice(['add', 'sub'])}({x}, {y}, alpha={scal(r)})"
            if r.random() < 0.2: return f"torch.{r.choice(['maximum', 'minimum', 'fmod', 'remainder', 'pow', 'div', 'mul', 'rsub'])}({x}, {s})"
            return f"{x} {op} {s}"
        if cat == "un":
            op = r.choice(["exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "abs", "neg", "sign", "floor", "ceil", "round", "trunc",
                           "exp2", "log2", "log1p", "expm1", "sin", "cos", "erf", "reciprocal", "relu", "logical_not", "bitwise_not",
                           "square", "frac", "sgn", "isnan", "isinf", "isfinite", "signbit", "nan_to_num", "sinh", "atan", "erfinv",
                           "log10", "positive"])
            if r.random() < 0.3:
                fop = r.choice([f"F.silu({x})", f"F.gelu({x})", f"F.gelu({x}, approximate='tanh')", f"F.relu({x})",
                                f"F.leaky_relu({x}, {r.choice([0.01, 0.2, 2.0])})", f"F.hardtanh({x})",
                                f"F.hardtanh({x}, {r.choice([-2.0, -0.5, 0.])}, {r.choice([0.5, 1.0, 3.0])})",
                                f"torch.clamp({x}, min={scal(r)})", f"torch.clamp({x}, max={scal(r)})",
                                f"torch.clamp({x}, {scal(r)}, {scal(r)})", f"torch.clamp({x}, min={y})", f"torch.clamp({x}, {y}, {self.pick()})",
                                f"F.elu({x})", f"F.softplus({x})", f"F.mish({x})", f"F.hardswish({x})", f"F.hardsigmoid({x})",
                                f"F.relu6({x})", f"F.selu({x})", f"F.logsigmoid({x})", f"F.softsign({x})", f"F.tanhshrink({x})",
                                f"torch.round({x}, decimals={r.choice([1, 2, -1])})", f"torch.round({x} * 0.5)",
                                f"{x}.abs()", f"-{x}", f"~{x}", f"torch.lerp({x}, {y}, 0.3)",
                                f"torch.addcmul({x}, {y}, {self.pick()}, value=0.5)", f"torch.addcdiv({x}, {y}, {self.pick()}, value=2)",
                                f"torch.xlogy({x}, {y})", f"torch.clamp_min({x}, {scal(r)})", f"torch.clamp_max({x}, {scal(r)})"])
                return fop
            return f"torch.{op}({x})"
        if cat == "red":
            op = r.choice(["sum", "mean", "amax", "amin", "prod", "var", "std", "norm", "logsumexp", "softmax", "log_softmax",
                           "argmax", "argmin", "any", "all", "max", "min", "cumsum", "cumprod", "nansum", "count_nonzero", "var_mean", "std_mean", "logcumsumexp"] + (["aminmax", "cummax"] if r.random() < 0.1 else []))
            d = dimarg(r, rank)
            kd = r.choice([True, False])
            if op in ("softmax", "log_softmax"):
                dt = f", dtype={r.choice(FD)}" if r.random() < 0.3 else ""
                return f"torch.{op}({x}, {d}{dt})"
            if op in ("cumsum", "cumprod", "logcumsumexp", "cummax"):
                dt = f", dtype={r.choice(FD + ['torch.int64'])}" if r.random() < 0.2 and op in ("cumsum", "cumprod") else ""
                return f"torch.{op}({x}, {d}{dt})"
            form = r.random()
            if op in ("sum", "mean", "nansum", "prod") and r.random() < 0.3:
                dt = r.choice(FD + ["torch.int64", "torch.int32"])
                if op == "prod":
                    return f"torch.prod({x}, {d}, keepdim={kd}, dtype={dt})" if form < 0.5 else f"torch.prod({x}, dtype={dt})"
                return f"torch.{op}({x}, dim={d if form < 0.5 else [d, dimarg(r, rank)] if rank > 1 else d}, keepdim={kd}, dtype={dt})" if form < 0.8 else f"torch.{op}({x}, dtype={dt})"
            if op in ("var", "std", "var_mean", "std_mean"):
                c = r.choice(["", ", unbiased=False", ", correction=0", ", correction=2", ", unbiased=True"])
                if form < 0.3: return f"torch.{op}({x}{c})"
                dd = d if form < 0.7 or rank < 2 else (d, dimarg(r, rank))
                return f"torch.{op}({x}, dim={dd}, keepdim={kd}{c})"
            if op == "norm":
                p = r.choice(["", ", p=1", ", p=2", ", p=float('inf')", ", p=3"])
                return f"torch.norm({x}{p})" if form < 0.3 else f"torch.norm({x}, dim={d}, keepdim={kd}{p})"
            if op in ("max", "min", "median"):
                return f"torch.{op}({x})" if form < 0.3 else f"torch.{op}({x}, dim={d}, keepdim={kd})"
            if op == "prod" or op == "argmax" or op == "argmin":
                return f"torch.{op}({x})" if form < 0.3 else f"torch.{op}({x}, dim={d}, keepdim={kd})"
            if form < 0.25: return f"torch.{op}({x})"
            if form < 0.4 and rank > 1:
                return f"torch.{op}({x}, dim={(d, (d + 1) % rank - rank if r.random() < 0.5 else (d+1) % rank)}, keepdim={kd})"
            if form < 0.5 and op in ("sum", "mean", "amax", "amin"):
                return f"{x}.{op}({d})"
            return f"torch.{op}({x}, dim={d}, keepdim={kd})"
        if cat == "view":
            n = t.numel()
            sh = list(t.shape)
            ch = r.random()
            if rank == 0:
                return r.choice([f"{x}.reshape(1, 1)", f"{x}.unsqueeze(0)", f"{x}.expand(3, 2)", f"{x}.view(-1)", f"{x}[None]"])
            d = dimarg(r, rank)
            cands = [
                f"{x}.reshape({n})", f"{x}.reshape(-1, {sh[-1]})", f"{x}.view({', '.join(map(str, sh[::-1])) if n == math.prod(sh) else n})",
                f"{x}.permute({', '.join(map(str, r.sample(range(rank), rank)))})", f"{x}.transpose({d}, {dimarg(r, rank)})",
                f"{x}.unsqueeze({r.randrange(-rank-1, rank+1)})", f"{x}.squeeze()", f"{x}.squeeze({d})", f"{x}.flatten()",
                f"{x}.flatten({d})" , f"{x}.T" if rank == 2 else f"{x}.mT" if rank > 2 else f"{x}.t()",
                f"{x}.expand({', '.join(str(s if s != 1 else r.choice([1, 3, 4])) for s in sh)})",
                f"{x}.expand({r.choice([2, 3])}, {', '.join(['-1'] * rank)})",
                f"{x}.narrow({d}, {r.randrange(sh[d])}, 1)",
                f"{x}.select({d}, {r.randrange(-sh[d], sh[d])})",
                f"{x}[{', '.join([':'] * r.randrange(rank))}{r.choice(['::2', '1::3', '-3:', ':-1', '1:', '2:5:2', '-1', '0', 'None', '...'])}]",
                f"{x}[..., {r.choice(['::2', '1:', '-1', 'None', ':1'])}]",
                f"{x}.contiguous()", f"{x}.clone()", f"{x}.movedim({d}, {dimarg(r, rank)})", f"{x}.unflatten({d}, ({sh[d]}, 1))",
                f"torch.cat([{x}, {x}], {d})", f"torch.cat([{x}, {y}], {d})", f"torch.stack([{x}, {x}], {r.randrange(-rank-1, rank+1)})",
                f"torch.stack([{x}, {y}], {d})",
                f"torch.split({x}, {r.choice([1, 2, 3])}, {d})", f"torch.chunk({x}, {r.choice([2, 3, 4])}, {d})",
                f"torch.unbind({x}, {d})", f"{x}.split([1, {sh[d]-1}], {d})" if sh[d] > 1 else f"{x}.split(1, {d})",
                f"torch.flip({x}, [{d}])", f"torch.roll({x}, {r.choice([1, -1, 2])}, {d})", f"{x}.repeat({', '.join(str(r.choice([1, 2])) for _ in sh)})",
                f"torch.tril({x})" if rank >= 2 else f"{x}.unsqueeze(0)", f"torch.triu({x}, 1)" if rank >= 2 else f"{x}[None]",
                f"{x}.index_select({d}, torch.tensor([{r.randrange(sh[d])}, 0]))",
                f"{x}[torch.tensor([{r.randrange(sh[d])}, {r.randrange(sh[d])}])]" if sh[0] > 0 else f"{x}",
                f"torch.gather({x}, {d}, torch.zeros({tuple(sh)}, dtype=torch.int64))",
                f"{x}.swapaxes(0, -1)", f"{x}.view({', '.join(map(str, sh))}, 1)", f"{x}.expand_as({y})", f"torch.broadcast_to({x}, {tuple(self.env[y].shape)})",
                f"{x}.diagonal()" if rank >= 2 else f"{x}.unsqueeze(-1)",
                f"{x}.unfold({d}, 1, 1)",
            ]
            return r.choice(cands)
        if cat == "cast":
            dt = r.choice(ALLD)
            return r.choice([f"{x}.to({dt})", f"{x}.to({dt}) + {y}" if r.random() < 0.5 else f"{x}.to({dt})", f"{x}.float()", f"{x}.half()",
                             f"{x}.bfloat16()", f"{x}.long()", f"{x}.int()", f"{x}.bool()", f"{x}.double()", f"{x}.type_as({y})", f"{x}.byte()", f"{x}.char()"])
        if cat == "cmp":
            op = r.choice(["==", "!=", "<", "<=", ">", ">="])
            o = y if r.random() < 0.6 else scal(r)
            if r.random() < 0.4:
                return f"torch.where({x} {op} {o}, {r.choice([x, y, scal(r)])}, {r.choice([x, y, scal(r)])})"
            if r.random() < 0.2:
                return f"{x}.masked_fill({x} {op} {o}, {scal(r)})"
            if r.random() < 0.15:
                return f"torch.isclose({x}, {y})"
            return f"{x} {op} {o}"
        if cat == "misc":
            return r.choice([f"torch.zeros_like({x}) + {y}", f"torch.ones_like({x})", f"torch.full_like({x}, {scal(r)})",
                             f"torch.arange({max(1, t.shape[-1] if rank else 3)}) * {x}", f"torch.arange({max(1, t.shape[-1] if rank else 3)}, dtype=torch.float32) + {x}",
                             f"{x} * torch.tensor({scal(r)})", f"{x} + torch.tensor([{scal(r)}])", f"torch.where({x} > 0, {x}, torch.zeros(()))",
                             f"{x}.sum() * {y}",
                             f"torch.outer({x}.flatten()[:5], {y}.flatten()[:4])", f"torch.dist({x}, {y})",
                             f"torch.tensor({scal(r)}) * {x}", f"{x}.exp().sum({dimarg(r, rank)}, keepdim=True).log()",
                             f"{x} - {x}.mean({dimarg(r, rank)}, keepdim=True)", f"{x} / {x}.sum({dimarg(r, rank)}, keepdim=True)",
                             f"{x} - {x}.amax({dimarg(r, rank)}, keepdim=True)"])
        if cat == "nn":
            if rank == 0: return None
            sh = list(t.shape)
            last = sh[-1]
            c = r.random()
            eps = r.choice(["", ", eps=1e-3", ", eps=0.5"])
            ch = [f"F.layer_norm({x}, ({last},){eps})", f"F.layer_norm({x}, {tuple(sh[-2:])}{eps})" if rank >= 2 else f"F.layer_norm({x}, ({last},))",
                  f"F.layer_norm({x}, ({last},), torch.linspace(0.5, 1.5, {last}, dtype={x}.dtype), torch.linspace(-1, 1, {last}, dtype={x}.dtype){eps})",
                  f"F.rms_norm({x}, ({last},){eps})", f"F.rms_norm({x}, ({last},), torch.linspace(0.5, 1.5, {last}, dtype={x}.dtype))",
                  f"F.rms_norm({x}, {tuple(sh[-2:])})" if rank >= 2 else f"F.rms_norm({x}, ({last},), eps=None)",
                  f"F.normalize({x}, dim={dimarg(r, rank)})", f"F.softmax({x}, -1)", f"F.log_softmax({x}, 0)",
                  f"F.softmin({x}, -1)", f"F.dropout({x}, 0.3, training=False)", f"F.glu({x}, -1)" if last % 2 == 0 else f"F.silu({x})",
                  f"F.cosine_similarity({x}, {y}, dim=-1)", f"F.pairwise_distance({x}, {y})",
                  ]
            if rank >= 2 and rank <= 4:
                C = sh[1]
                g = r.choice([g for g in (1, 2, 3, C) if C % g == 0])
                ch += [f"F.group_norm({x}, {g}{eps})", f"F.group_norm({x}, {C}, torch.linspace(0.5, 2, {C}, dtype={x}.dtype), torch.linspace(-1, 1, {C}, dtype={x}.dtype))"]
                ch += [f"F.instance_norm({x})" if rank == 3 else f"F.group_norm({x}, 1)"]
                ch += [f"F.batch_norm({x}, torch.zeros({C}, dtype={x}.dtype), torch.ones({C}, dtype={x}.dtype))"]
            if rank == 2:
                N, C = sh
                tgt = f"torch.tensor([{', '.join(str(r.randrange(C) if r.random() < 0.85 else -100) for _ in range(N))}])"
                red = r.choice(["", ", reduction='sum'", ", reduction='none'", ", reduction='mean'"])
                ch += [f"F.cross_entropy({x}, {tgt}{red})", f"F.nll_loss(F.log_softmax({x}, 1), {tgt}{red})",
                       f"F.cross_entropy({x}, {tgt}, ignore_index={r.randrange(C)}{red})",
                       f"F.cross_entropy({x}, {tgt}, label_smoothing=0.1)", f"F.nll_loss({x}, {tgt}{red})",
                       f"F.mse_loss({x}, {y}{red})", f"F.l1_loss({x}, {y}{red})", f"F.smooth_l1_loss({x}, {y})", f"F.binary_cross_entropy_with_logits({x}, torch.sigmoid({y}))",
                       f"F.kl_div(F.log_softmax({x}, -1), F.softmax({y}, -1), reduction='batchmean')"]
            return r.choice(ch)
        if cat == "mm":
            if rank == 0: return None
            sh = list(t.shape)
            k = sh[-1]
            n = r.choice([1, 3, 8, 5] + ([64, 256, 1000] if BIG else []))
            wdt = f"dtype={x}.dtype"
            ch = [f"{x} @ torch.linspace(-1, 1, {k * n}, {wdt}).reshape({k}, {n})",
                  f"torch.matmul({x}, torch.linspace(-1, 1, {k}, {wdt}))",
                  f"F.linear({x}, torch.linspace(-1, 1, {k * n}, {wdt}).reshape({n}, {k}))",
                  f"F.linear({x}, torch.linspace(-1, 1, {k * n}, {wdt}).reshape({n}, {k}), torch.linspace(0, 1, {n}, {wdt}))",
                  f"{x} @ {x}.transpose(-1, -2)" if rank >= 2 else f"{x} @ {x}",
                  f"{x}.transpose(-1, -2) @ {x}" if rank >= 2 else f"torch.dot({x}, {x})",
                  f"{x} @ {y}", f"torch.einsum('...i,...i->...', {x}, {x})",
                  f"torch.einsum('ij,kj->ik', {x}, {x})" if rank == 2 else f"torch.einsum('bij,bkj->bik', {x}, {x})" if rank == 3 else f"{x} @ {y}",
                  f"torch.bmm({x}, {x}.transpose(1, 2))" if rank == 3 else f"torch.mm({x}, {x}.t())" if rank == 2 else f"torch.mv({x}.unsqueeze(0).expand(3, -1), {x})" if rank == 1 else f"{x} @ {y}",
                  f"torch.addmm(torch.linspace(0, 1, {n}, {wdt}), {x}, torch.linspace(-1, 1, {k * n}, {wdt}).reshape({k}, {n}), beta={r.choice([0, 1, 0.5])}, alpha={r.choice([1, 2.0])})" if rank == 2 else f"{x} @ {y}",
                  f"torch.baddbmm({x}, {x}, {x}.transpose(1, 2))" if rank == 3 and sh[1] == sh[2] else f"{x} @ {y}",
                  f"F.scaled_dot_product_attention({x}, {x}, {x})" if rank >= 3 else f"{x} @ {y}",
                  f"F.scaled_dot_product_attention({x}, {x}, {x}, is_causal=True)" if rank >= 3 else f"{x} @ {y}",
                  ]
            return r.choice(ch)
        if cat == "late":  # forms tilefuse took into its kernels after the generator's first ops
            if rank == 0: return None
            sh = list(t.shape)
            last = sh[-1]
            d = dimarg(r, rank)
            k = r.randrange(1, last + 1)
            p = r.choice([1, 2, 3])
            ch = [f"torch.topk({x}, {k}, dim=-1, largest={r.choice([True, False])})", f"torch.sort({x}, dim={d}, descending={r.choice([True, False])})",
                  f"torch.kthvalue({x}, {k}, dim=-1)", f"torch.aminmax({x}, dim={d})",
                  f"F.pad({x}, ({p}, {r.choice([0, 1, 2])}), value={scal(r)})", f"F.pad({x}.float(), ({p}, {p}), mode='replicate')" if rank >= 2 else f"F.pad({x}, (1, 0))",
                  f"torch.roll({x}, {r.choice([1, -1, 2])}, {d})", f"torch.cat([{x}[..., {k - 1}:], {x}[..., :{k - 1}]], -1)",
                  f"torch.cat([{x}[..., ::2], {x}[..., 1::2]], -1)", f"torch.flip({x}, [{d}])",
                  f"({x} * 2 + 1)[..., {r.randrange(last)}:]", f"({x}.float() * {x}.float())[..., ::2].sum(-1)",
                  f"F.embedding(torch.tensor([{', '.join(str(r.randrange(sh[0])) for _ in range(r.choice([1, 3, 5])))}]), {x}.reshape({sh[0]}, -1))",
                  f"{x}.repeat_interleave({r.choice([2, 3])}, dim={d})",
                  f"{x}.unsqueeze(-1).expand(*{x}.shape, 2).reshape(*{x}.shape[:-1], -1)",
                  f"torch.tril({x})" if rank >= 2 else f"{x}.cumsum(0)", f"torch.triu({x}, 1)" if rank >= 2 else f"{x}.cummax(0)[0]",
                  f"torch.cummin({x}, {d})[0]", f"{x}.cumsum({d}) - {x}", f"torch.prod({x}, {d})",
                  ]
            if rank >= 3 and str(t.dtype).startswith("torch.float"):
                ch += [f"F.interpolate({x}, scale_factor=2, mode='nearest')",
                       f"F.avg_pool1d({x}, {r.choice([c for c in (1, 2, 3) if last % c == 0])})",
                       f"F.max_pool1d({x}, {r.choice([c for c in (1, 2, 3) if last % c == 0])})",
                       f"{x}.transpose(1, 2).contiguous()", f"({x} * 2).transpose(-1, -2).contiguous()",
                       f"{x} * torch.sigmoid({x}.mean(-1, keepdim=True))"]
            if rank == 4 and str(t.dtype).startswith("torch.float"):
                ch += [f"{x}.mean((2, 3))", f"{x}.var((0, 2, 3))", f"F.layer_norm({x}.permute(0, 2, 3, 1), ({sh[1]},)).permute(0, 3, 1, 2)",
                       f"torch.softmax({x}, 1)", f"{x} * torch.sigmoid({x}.mean((2, 3), keepdim=True))"]
            return r.choice(ch)
        if cat == "inplace":
            op = r.choice([f"add_({scal(r)})", f"mul_({scal(r)})", f"add_({y})", "relu_()", "clamp_(min=0)", f"sub_({y}, alpha=2)",
                           f"div_({scal(r)})", "exp_()", f"masked_fill_({y} > 0, {scal(r)})", f"fill_({scal(r)})", "zero_()",
                           f"copy_({y})", "neg_()", "pow_(2)", "sigmoid_()", "abs_()", "floor_()", f"__iadd__({y})", f"__imul__({scal(r)})",
                           f"__iand__({y})", f"__ior__({y})", f"__ixor__({y})", "__ilshift__(1)", "__irshift__(1)", f"floor_divide_({y})", f"fmod_({scal(r)})",
                           f"clamp_({scal(r)}, {scal(r)})", "tanh_()", f"lerp_({y}, 0.5)", f"addcmul_({y}, {y})", f"index_fill_(0, torch.tensor([0]), {scal(r)})",
                           "t_()" if rank == 2 else "unsqueeze_(0)", "squeeze_()", "transpose_(0, -1)" if rank else "abs_()"])
            # wrap into a lambda-like expression: (tmp := x.clone() * 1, tmp.op_)[-1]
            return f"({x} * 1).{op}" if r.random() < 0.5 else f"(lambda t: (t.{op}, t)[1])({x} + 0)"
        return None
