"""A compiled program: the plan's steps run in order on torch tensors.

On CUDA tensors each map-reduce kernel runs as a generated CUDA kernel; on CPU tensors it
runs through the Loop IR interpreter (so everything but the kernels' speed is real without
a GPU). Externs run in PyTorch; aliases are free reshapes of contiguous memory.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import dtypes
from ..graph import ir
from ..graph.fusion import Plan, Step
from ..loop.lower import Lowered
from ..tensors import to_numpy, to_torch


@dataclass
class Program:
    graph: ir.Graph
    plan: Plan
    kernels: dict[str, Lowered]  # step name -> lowered kernel
    out_spec: object = None
    arch: str | None = None
    poison: bool = False  # fill outputs with NaN (or -1) before each kernel: unwritten elements show

    def __post_init__(self):
        self._compiled: dict = {}
        self._weights: dict = {}

    # -- running -------------------------------------------------------------------------------
    def __call__(self, *args):
        flat = torch.utils._pytree.tree_leaves(args)
        tensors = [a for a in flat if isinstance(a, torch.Tensor)]
        if len(tensors) != len(self.graph.inputs):
            raise ValueError(f"expected {len(self.graph.inputs)} tensor inputs, got {len(tensors)}")
        env = {}
        for name, t in zip(self.graph.inputs, tensors):
            want = self.graph[name].type
            if tuple(t.shape) != want.shape or dtypes.from_torch(t.dtype) != want.dtype:
                raise ValueError(f"input {name}: compiled for {want}, got "
                                 f"{dtypes.from_torch(t.dtype)}[{', '.join(map(str, t.shape))}]")
            env[name] = t
        device = tensors[0].device if tensors else torch.device("cpu")
        if any(t.device != device for t in tensors):
            raise ValueError("all inputs must be on one device")
        env.update(self.weights_on(device))
        for step in self.plan.steps:
            self.run_step(step, env, device)
        # an output that is an input or a weight (x.clone() after capture is x) is returned as a copy,
        # never as the caller's tensor or the program's cached weight
        given = set(self.graph.inputs) | set(self.graph.weights)
        outs = [self.value(o, env, device).clone() if o in given else self.value(o, env, device)
                for o in self.graph.outputs]
        if self.out_spec is not None:
            return torch.utils._pytree.tree_unflatten(outs, self.out_spec)
        return outs[0] if len(outs) == 1 else tuple(outs)

    def weights_on(self, device) -> dict:
        key = str(device)
        if key not in self._weights:
            self._weights[key] = {k: torch.as_tensor(v).to(device).contiguous() for k, v in self.graph.weights.items()}
        return self._weights[key]

    def value(self, name, env, device):
        if name in env:
            return env[name]
        n = self.graph[name]
        if isinstance(n, ir.Constant):
            return torch.tensor(n.value, dtype=dtypes.to_torch(n.type.dtype), device=device)
        if isinstance(n, ir.Iota):
            shape = n.type.shape
            idx = torch.arange(shape[n.axis], device=device, dtype=dtypes.to_torch(n.type.dtype))
            view = [-1 if i == n.axis else 1 for i in range(len(shape))]
            return idx.reshape(view).expand(shape).contiguous()
        raise KeyError(f"value {name} was not computed")

    def run_step(self, step: Step, env, device):
        g = self.graph
        if step.family == "alias":
            n = g[step.nodes[0]]
            env[n.name] = self.value(n.arg, env, device).reshape(n.type.shape)
        elif step.family == "extern":
            n = g[step.nodes[0]]
            out = run_extern(n, lambda a: self.value(a, env, device))
            env[n.name] = out.to(dtypes.to_torch(n.type.dtype)).reshape(n.type.shape)
        else:
            lowered = self.kernels[step.name]
            if device.type == "cuda":
                self.run_cuda(lowered, env, device)
            else:
                self.run_interpreted(lowered, env, device)

    def run_interpreted(self, lowered: Lowered, env, device):
        from ..loop.interp import run_kernel

        k = lowered.kernel
        inputs = {}
        for b in lowered.bindings:
            if k.buffer(b.buffer).role == "in":
                inputs[b.buffer] = to_numpy(self.value(b.tensor, env, device).reshape(b.shape))
        outs = run_kernel(k, inputs)
        for b in lowered.bindings:
            if k.buffer(b.buffer).role == "out":
                env[b.tensor] = to_torch(outs[b.buffer]).reshape(self.graph[b.tensor].type.shape)

    def compiled(self, lowered: Lowered, device):
        key = (lowered.kernel.name, str(device))
        if key not in self._compiled:
            from .launch import compile_kernel

            self._compiled[key] = compile_kernel(lowered.kernel, arch=self.arch)
        return self._compiled[key]

    def run_cuda(self, lowered: Lowered, env, device):
        ck = self.compiled(lowered, device)
        k = lowered.kernel
        args, outs = [], []
        for b in lowered.bindings:
            buf = k.buffer(b.buffer)
            if buf.role == "in":
                args.append(self.value(b.tensor, env, device).contiguous().reshape(b.shape))
            else:
                t = torch.empty(b.shape, dtype=dtypes.to_torch(buf.dtype), device=device)
                if self.poison:
                    t.fill_(float("nan") if t.is_floating_point() else -1)
                args.append(t)
                outs.append((b.tensor, t))
        ck(*args)
        for name, t in outs:
            env[name] = t.reshape(self.graph[name].type.shape)

    def prepare(self, device="cuda"):
        """Compile every kernel for `device` now rather than at the first call."""
        for step in self.plan.steps:
            if step.family == "mapreduce":
                self.compiled(self.kernels[step.name], torch.device(device))


def run_extern(n, get) -> torch.Tensor:
    """Run one graph node in PyTorch: the explicit fallback the plan shows."""
    if isinstance(n, ir.Contraction):
        return torch.matmul(get(n.a), get(n.b))
    if isinstance(n, ir.Attention):
        return F.scaled_dot_product_attention(get(n.q), get(n.k), get(n.v), attn_mask=get(n.mask) if n.mask else None,
                                              is_causal=n.causal, scale=n.scale)
    if isinstance(n, ir.View):
        x = get(n.arg)
        if n.op == "reshape":
            return x.reshape(n.type.shape)
        if n.op == "permute":
            return x.permute(*n.params).contiguous()
        if n.op == "expand":
            return x.expand(n.type.shape).contiguous()
        if n.op == "slice":
            dim, start, end, step = n.params
            return x.narrow(dim, start, end - start)[(slice(None),) * dim + (slice(None, None, step),)].contiguous()
    if isinstance(n, ir.Gather):
        return torch.gather(get(n.arg), n.axis, get(n.index))
    if isinstance(n, ir.Reduce):
        x = get(n.arg)
        fn = {"sum": torch.sum, "mean": torch.mean, "max": torch.amax, "min": torch.amin}[n.op]
        kw = {"dtype": dtypes.to_torch(n.type.dtype)} if n.op in ("sum", "mean") and x.is_floating_point() else {}
        return fn(x, dim=n.axes, keepdim=n.keepdim, **kw)
    if isinstance(n, ir.Map):
        raise TypeError(f"map {n.name} has no kernel")
    if isinstance(n, ir.Extern):
        op = n.torch_op()

        def conv(a):
            if isinstance(a, ir.Ref):
                return get(a.name)
            if isinstance(a, tuple):
                return [conv(x) for x in a]
            return a

        kwargs = {k: conv(v) for k, v in n.kwargs}
        return op(*conv(n.args), **kwargs)
    raise TypeError(f"cannot run {n!r} in PyTorch")
