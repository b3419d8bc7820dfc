"""Whole programs whose matmuls the planner turns into generated GEMMs with fused epilogues:
outputs (written over NaN-poisoned buffers) against a float64 reference under the 2x rule."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tilefuse
from tilefuse import models
from tilefuse.check import compare, flatten, float64_reference

pytestmark = pytest.mark.gpu


class LinearAct(nn.Module):
    def __init__(self, k, n, act, bias=True):
        super().__init__()
        self.lin, self.act = nn.Linear(k, n, bias=bias), act

    def forward(self, x, r):
        y = self.lin(x)
        if self.act == "gelu":
            y = F.gelu(y)
        elif self.act == "gelu_tanh":
            y = F.gelu(y, approximate="tanh")
        elif self.act == "silu":
            y = F.silu(y)
        elif self.act == "relu":
            y = torch.relu(y)
        elif self.act == "leaky_relu":  # (these read a comparison the epilogue computes)
            y = F.leaky_relu(y, 0.1)
        elif self.act == "elu":
            y = F.elu(y)
        elif self.act == "softplus":
            y = F.softplus(y, 2.0, 3.0)
        elif self.act == "mish":
            y = F.mish(y)
        return y + r


class SwiGLU(nn.Module):
    """RMSNorm -> gate/up -> silu(g) * u -> down -> + residual: the Llama MLP."""

    def __init__(self, d, f):
        super().__init__()
        self.norm = nn.RMSNorm(d, eps=1e-6)
        self.gate, self.up, self.down = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False), nn.Linear(f, d, bias=False)
        with torch.no_grad():
            self.norm.weight.copy_(1 + 0.3 * torch.randn(d))

    def forward(self, x):
        h = self.norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def _run(module, inputs, dtype):
    module = module.cuda().to(dtype).eval()
    inputs = [t.cuda().to(dtype) for t in inputs]
    prog = tilefuse.compile(module, inputs)
    prog.poison = True
    families = [s.family for s in prog.plan.steps]
    outs = []
    for _ in range(2):  # the thin path, then the CUDA-graph replay
        outs.append(flatten(prog(*inputs)))
    with torch.no_grad():
        eager = flatten(module(*inputs))
    ref = flatten(float64_reference(module, inputs))
    for call, out in enumerate(outs):
        for i, (o, r, e) in enumerate(zip(out, ref, eager)):
            c = compare(f"call{call}.out{i}", o, r, e)
            assert c.ok, c
    return prog, families


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("act", ["none", "gelu", "gelu_tanh", "silu", "relu", "leaky_relu", "elu", "softplus", "mish"])
@pytest.mark.parametrize("shape", [(1, 8, 8), (17, 72, 40), (300, 136, 520), (2048, 1024, 768)],
                         ids=lambda s: "x".join(map(str, s)))
def test_linear_activation_residual_is_one_gemm(shape, act, dtype):
    """y = act(x @ W.T + b) + r runs as one GEMM (bias, activation and residual in its epilogue)."""
    m, k, n = shape
    torch.manual_seed(0)
    prog, families = _run(LinearAct(k, n, act), [torch.randn(m, k), torch.randn(m, n)], dtype)
    assert families == ["gemm"]


def test_llama_mlp_runs_as_two_gemms_and_a_norm():
    """The Llama MLP: gate/up interleaved into one pairwise-SwiGLU GEMM with the RMSNorm row scale
    in its epilogue, the down GEMM with the residual in its epilogue, and one kernel for the norm."""
    torch.manual_seed(0)
    prog, families = _run(SwiGLU(256, 688), [torch.randn(2, 100, 256)], torch.bfloat16)
    gemms = [s.gemm for s in prog.plan.steps if s.family == "gemm"]
    assert len(gemms) == 2 and sum(bool(g.pairwise) for g in gemms) == 1
    assert families.count("extern") == 0


class ChunkedSwiGLU(nn.Module):
    """Phi-3's MLP: RMSNorm -> one gate/up weight, chunked -> up * silu(gate) -> down -> + residual."""

    def __init__(self, d, f):
        super().__init__()
        self.norm = nn.RMSNorm(d, eps=1e-6)
        self.gate_up, self.down = nn.Linear(d, 2 * f, bias=False), nn.Linear(f, d, bias=False)
        with torch.no_grad():
            self.norm.weight.copy_(1 + 0.3 * torch.randn(d))

    def forward(self, x):
        gate, up = self.gate_up(self.norm(x)).chunk(2, dim=-1)
        return x + self.down(up * F.silu(gate))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_chunked_gate_up_weight_is_a_pairwise_swiglu_gemm(dtype):
    """One gate/up weight's halves, interleaved once when compiling: the SwiGLU is the GEMM's
    pairwise epilogue, as for separate gate and up weights (session 72, not yet run on a GPU)."""
    torch.manual_seed(0)
    prog, families = _run(ChunkedSwiGLU(256, 688), [torch.randn(2, 100, 256)], dtype)
    gemms = [s.gemm for s in prog.plan.steps if s.family == "gemm"]
    assert len(gemms) == 2 and sum(bool(g.pairwise) for g in gemms) == 1
    assert families.count("extern") == 0


def _block():
    """A small native Llama block (GQA, 4 heads) with its norm weights away from 1."""
    torch.manual_seed(0)
    block = models.llama_block(256, 512, 4, 2, max_seq=64)
    with torch.no_grad():
        for mod in block.modules():
            if isinstance(mod, nn.RMSNorm):
                mod.weight.copy_(1 + 0.3 * torch.randn(mod.weight.shape))
    return block


def test_llama_block_through_tilefuse_compile():
    """A whole decoder block (attention through SDPA) matches the reference, projections as GEMMs."""
    prog, families = _run(_block(), [torch.randn(2, 64, 256)], torch.bfloat16)
    assert families.count("gemm") >= 5


@pytest.mark.parametrize("batch", [1, 2])
def test_llama_block_with_rope_in_the_projection_epilogues(batch, monkeypatch):
    """With the RoPE rule on (the default) the Q and K projections rotate their pairs in the
    epilogue (graph/rules/rope_epilogue.py) and the block still matches the float64 reference."""
    monkeypatch.setenv("TILEFUSE_ROPE_EPILOGUE", "1")
    prog, _ = _run(_block(), [torch.randn(batch, 64, 256)], torch.bfloat16)
    assert sum(1 for s in prog.plan.steps if s.family == "gemm" and s.gemm.stacks) == 2


@pytest.mark.parametrize("batch", [1, 2])
def test_one_position_rotates_in_the_projection_epilogues_too(batch, monkeypatch):
    """At one position (a decode step's shape) the heads' transpose is a reshape; the Q and K
    projections still rotate their pairs in the epilogue (at batch 1 in the GEMV: M = 1, a
    pairwise epilogue reading the cos / sin tables through views), no `stack` runs in PyTorch,
    and the block matches the float64 reference."""
    from tilefuse.runtime.gemv import GemvKernel

    monkeypatch.setenv("TILEFUSE_ROPE_EPILOGUE", "1")
    prog, _ = _run(_block(), [torch.randn(batch, 1, 256)], torch.bfloat16)
    assert sum(1 for s in prog.plan.steps if s.family == "gemm" and s.gemm.stacks) == 2
    assert not any(s.family == "extern" and "stack" in s.name for s in prog.plan.steps)
    if batch == 1:
        assert sum(isinstance(k, GemvKernel) for k in prog._compiled.values()) >= 2


def test_batched_matmul_with_scale_is_one_gemm():
    """bmm with a scalar scale and a column bias: one batched GEMM."""
    torch.manual_seed(0)
    bias = torch.randn(96)

    def f(a, b):
        return torch.bmm(a, b) * 0.5 + bias.to(a.device, a.dtype)

    prog, families = _run_fn(f, [torch.randn(3, 70, 64), torch.randn(3, 64, 96)], torch.bfloat16)
    assert families == ["gemm"] and prog.plan.steps[0].gemm.batch == 3


def _run_fn(f, inputs, dtype):
    class M(nn.Module):
        def forward(self, *xs):
            return f(*xs)

    return _run(M(), inputs, dtype)


def test_matmul_tma_cannot_read_stays_in_cublas():
    """K = 36 (rows of 72 bytes) is not TMA-readable: torch.matmul, and the plan says why."""
    torch.manual_seed(0)
    prog, families = _run(LinearAct(36, 64, "gelu"), [torch.randn(40, 36), torch.randn(40, 64)], torch.bfloat16)
    mm = [s for s in prog.plan.steps if s.family == "extern"]
    assert len(mm) == 1 and "K=36" in mm[0].note


class PreActivation(nn.Module):
    def __init__(self, k, n):
        super().__init__()
        self.lin = nn.Linear(k, n)

    def forward(self, x):
        y = self.lin(x)
        return y, F.gelu(y)


@pytest.mark.parametrize("shape", [(300, 64, 520), (2048, 1024, 1536)], ids=lambda s: "x".join(map(str, s)))
def test_pre_activation_and_activation_from_one_gemm(shape):
    """Both y = x @ W.T + b and gelu(y) are returned; the cost model keeps both in the epilogue
    (two outputs, stored from registers), and both pass the 2x rule."""
    m, k, n = shape
    torch.manual_seed(0)
    prog, families = _run(PreActivation(k, n), [torch.randn(m, k)], torch.bfloat16)
    assert families == ["gemm"] and len(prog.plan.steps[0].gemm.outs) == 2


@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt2"])
def test_transformers_model_through_tilefuse_compile(name):
    """A 2-layer random transformers model (bf16, batch 2) through tilefuse.compile: projections as
    generated GEMMs, logits within the 2x rule of the float64 reference."""
    pytest.importorskip("transformers")
    b = models.build(name, 2, hidden=256, seq=64, batch=2, vocab=512, dtype=torch.bfloat16, device="cuda")
    prog = tilefuse.compile(b.model, b.inputs)
    prog.poison = True
    assert sum(s.family == "gemm" for s in prog.plan.steps) >= 8
    with torch.no_grad():
        eager = b.model(*b.inputs)
    ref = float64_reference(b.model, b.inputs)
    for call in range(2):
        c = compare(f"{name} call {call}", prog(*b.inputs), ref, eager)
        assert c.ok, c


def test_folding_a_norm_weight_on_the_gpu_rounds_once_as_in_float64():
    """Folding γ into a weight on the GPU (the weights are there when compiling): the bits of the
    float64 product rounded once, overflow, subnormals and both broadcasts included: PyTorch's
    own 16-bit multiply on the GPU (the one pass exact_product takes) and exact_product itself."""
    from tilefuse.graph.rules.match import exact_product

    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        info = torch.finfo(dtype)
        edge = torch.tensor([info.max, -info.max, info.tiny, info.tiny / 4, info.eps, 0.0, -0.0, 1.0, -3.0],
                            dtype=torch.float64)
        a = torch.cat([torch.randn(4096 * 33, dtype=torch.float64), edge.repeat(33)]).reshape(-1, 33)
        a = a.to(dtype).cuda()
        for b in (torch.randn(a.shape[0], 1, dtype=torch.float64),
                  torch.cat([edge, torch.randn(33 - edge.numel(), dtype=torch.float64)]).reshape(1, 33)):
            b = b.to(dtype).cuda()
            want = (a.double() * b.double()).to(dtype)
            assert torch.equal(torch.mul(a, b), want), ("torch.mul", dtype, tuple(b.shape))
            got = exact_product(a, b, round_to=dtype)
            assert got.is_cuda and torch.equal(got, want), ("exact_product", dtype, tuple(b.shape))
