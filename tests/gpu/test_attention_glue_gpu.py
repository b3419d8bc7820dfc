"""What runs around SDPA on the GPU: a causal mask known when compiling run as is_causal
(rules/causal_mask.py), the split of a fused QKV projection passed to SDPA as strided views
(fusion.attention_only_views), and repeated KV heads read unrepeated (rules/gqa_attention.py).
Outputs poisoned first; compared with float64 under the 2x rule, on the thin call and a
CUDA-graph replay."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cpu"))

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

BF16 = torch.bfloat16


def _check(fn, inputs, calls: int = 2):
    import tilefuse
    from tilefuse.check import compare, float64_reference

    prog = tilefuse.compile(fn, inputs)
    prog.poison = True
    ref = float64_reference(fn, inputs)
    with torch.no_grad():
        eager = fn(*inputs)
    for call in range(calls):  # the thin call, then a CUDA-graph replay
        c = compare(f"call {call}", prog(*inputs), ref, eager)
        assert c.ok, c
    return prog


@pytest.mark.parametrize("b,h,L,d", [(2, 4, 1024, 64), (1, 3, 77, 32)])
def test_causal_mask_runs_as_is_causal(b, h, L, d):
    from test_causal_mask import MaskedAttention, _causal_bool
    from tilefuse.graph import ir

    q, k, v = (torch.randn(b, h, L, d, device="cuda", dtype=BF16) for _ in range(3))
    prog = _check(MaskedAttention(_causal_bool, batch_mask=True), (q, k, v))
    (att,) = [n for n in prog.graph.nodes if isinstance(n, ir.Attention)]
    assert att.causal and att.mask is None
    assert not any(s.family == "mapreduce" for s in prog.plan.steps)  # no mask kernel left


@pytest.mark.parametrize("b,s,heads,d", [(2, 1024, 16, 64), (1, 37, 4, 32)])
def test_fused_qkv_split_reaches_sdpa_as_views(b, s, heads, d):

    dm = heads * d
    w = torch.randn(dm, 3 * dm, device="cuda", dtype=BF16) / dm ** 0.5

    def attn(x):
        q, k, v = (x @ w).split(dm, dim=2)
        q, k, v = (t.view(b, s, heads, d).transpose(1, 2) for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, dm)

    prog = _check(attn, (torch.randn(b, s, dm, device="cuda", dtype=BF16),))
    views = {s.nodes[0] for s in prog.plan.steps if s.view}
    slices = {n for n in views if prog.graph[n].op == "slice"}
    assert len(slices) == 3


@pytest.mark.parametrize("b,h,hkv,s,d", [(2, 16, 4, 1024, 128), (1, 6, 2, 77, 64)])
def test_repeated_kv_heads_run_as_grouped_query_attention(b, h, hkv, s, d):
    from test_gqa_attention import _Wrap, _attn, repeat_kv
    from tilefuse.graph import ir

    q = torch.randn(b, h, s, d, device="cuda", dtype=BF16)
    k, v = (torch.randn(b, hkv, s, d, device="cuda", dtype=BF16) for _ in range(2))
    prog = _check(_Wrap(_attn(repeat_kv)), (q, k, v))
    (att,) = [n for n in prog.graph.nodes if isinstance(n, ir.Attention)]
    assert prog.graph[att.k].type.shape[1] == hkv  # SDPA reads the KV heads unrepeated
