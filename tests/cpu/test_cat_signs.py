"""graph/rules/cat_signs.py: a negated piece of a `cat` becomes a sign on the cat's result.

The rewritten graph gives the same bits through the interpreter (negation and a multiply by -1
agree on every float, zeros, infinities and NaN included); a neg read by anything else, integer
cats and empty pieces are left alone; in transformers' decode step the rotate-half RoPE then
runs no `neg` kernel and no slice copy."""
import pytest
import torch

from coda_fixtures import capture, run_all
from tilefuse.graph import ir
from tilefuse.graph.rules.cat_signs import negated_pieces_as_signs


class RotateHalf(torch.nn.Module):
    def forward(self, q, cos, sin):
        h = q.shape[-1] // 2
        return q * cos + torch.cat((-q[..., h:], q[..., :h]), -1) * sin


class Pieces(torch.nn.Module):
    """Three pieces along a middle dim, two negated, the result read by two maps."""

    def forward(self, a, b, c):
        x = torch.cat((-a, b, -c), 1)
        return x * 2, x + 1


def _same(g, g2, inputs):
    for a, b in zip(run_all(g, inputs), run_all(g2, inputs)):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan())
        assert torch.equal(torch.signbit(a[~a.isnan()]), torch.signbit(b[~b.isnan()]))


def _ops(g, kind):
    return [n for n in g.nodes if isinstance(n, ir.Map) and n.op == kind]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rotate_half_gives_the_same_bits_with_no_neg(dtype):
    torch.manual_seed(0)
    q = torch.randn(1, 4, 1, 16).to(dtype)
    q[0, 0, 0, 9] = -0.0
    q[0, 1, 0, 12] = float("inf")
    q[0, 2, 0, 15] = float("nan")
    cos, sin = torch.randn(1, 1, 1, 16).to(dtype), torch.randn(1, 1, 1, 16).to(dtype)
    g = capture(RotateHalf(), q, cos, sin)
    g2 = negated_pieces_as_signs(g)
    assert _ops(g, "neg") and not _ops(g2, "neg")
    signs = [n for n in g2.nodes if isinstance(n, ir.Weight)]
    assert len(signs) == 1
    w = g2.weights[signs[0].name]
    assert w.tolist() == [-1.0] * 8 + [1.0] * 8  # the negated half first, as in the cat
    _same(g, g2, [q, cos, sin])


def test_pieces_along_a_middle_dim_and_a_result_read_twice():
    torch.manual_seed(0)
    a, b, c = torch.randn(2, 3, 5), torch.randn(2, 1, 5), torch.randn(2, 2, 5)
    g = capture(Pieces(), a, b, c)
    g2 = negated_pieces_as_signs(g)
    assert not _ops(g2, "neg")
    (w,) = [g2.weights[n.name] for n in g2.nodes if isinstance(n, ir.Weight)]
    assert tuple(w.shape) == (6, 1) and w.flatten().tolist() == [-1.0] * 3 + [1.0] + [-1.0] * 2
    _same(g, g2, [a, b, c])


class NegReadTwice(torch.nn.Module):
    def forward(self, a, b):
        n = -a
        return torch.cat((n, b), -1), n * 3


class Ints(torch.nn.Module):
    def forward(self, a, b):
        return torch.cat((-a, b), -1) * 2


class Returned(torch.nn.Module):
    """The cat is a result and read by a reduction: a sign there would be a pass of its own."""

    def forward(self, a, b):
        x = torch.cat((-(a * 3), b), -1)
        return x, x.sum(-1)


class LegacyEmpty(torch.nn.Module):
    def forward(self, a, e):
        return torch.cat((e, -a), 1) * 2


def test_what_is_left_alone():
    """A neg read elsewhere too, integer pieces (an integer neg wraps: int8 -128 stays -128, and
    a promoted integer 0 is +0, where a float multiply by -1 gives 128 and -0), a cat returned or
    reduced, and a legacy 1-D empty piece (no such dim: compiling must not fail)."""
    a, b = torch.randn(2, 3), torch.randn(2, 4)
    g = capture(NegReadTwice(), a, b)
    assert negated_pieces_as_signs(g) is g
    ai, bi = torch.randint(-5, 5, (2, 3)), torch.randint(-5, 5, (2, 4))
    g = capture(Ints(), ai, bi)
    assert negated_pieces_as_signs(g) is g
    a8 = torch.tensor([[-128, 0]], dtype=torch.int8)
    g = capture(Ints(), a8, torch.randn(1, 2))
    assert negated_pieces_as_signs(g) is g
    g = capture(Returned(), a, b)
    assert negated_pieces_as_signs(g) is g
    e = torch.randn(0)
    g = capture(LegacyEmpty(), a, e)
    assert negated_pieces_as_signs(g) is g


def test_an_integer_piece_in_a_float_cat_keeps_its_wrapped_values_through_compile():
    import tilefuse

    a8, b = torch.tensor([[-128, 0, 5]], dtype=torch.int8), torch.randn(1, 2)
    prog = tilefuse.compile(Ints(), (a8, b))
    assert torch.equal(prog(a8, b), Ints()(a8, b))
    a, e = torch.randn(2, 3), torch.randn(0)
    prog = tilefuse.compile(LegacyEmpty(), (a, e))
    assert torch.equal(prog(a, e), LegacyEmpty()(a, e))


def test_transformers_decode_step_runs_no_neg_and_no_slice_copy():
    """An HF Llama's static-cache decode graph: its rotate-half RoPE (which stays outside the
    projections: k goes into the cache) reads q's and k's halves in place, as rolls, in its
    multiply-add kernel, which the signs join; no `neg` kernel, slice copy or cat is left."""
    transformers = pytest.importorskip("transformers")
    import tilefuse  # noqa: F401  (registers the backend)
    from tilefuse.frontend import backend

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    torch._dynamo.reset()
    backend.reset()
    m.forward = torch.compile(m.forward, backend="tilefuse")
    with torch.no_grad():
        got = m.generate(torch.randint(0, 256, (1, 8)), max_new_tokens=3, min_new_tokens=3, do_sample=False,
                         cache_implementation="static")
    assert got.shape == (1, 11)
    decode = [r for r in backend.REPORTS if r.calls_tilefuse >= 2 and r.stages is not None]  # (the prefill runs once)
    assert len(decode) == 1
    for r in decode:
        steps = r.stages.plan.steps
        fused = [x for s in steps if s.family == "mapreduce" for x in s.nodes]
        assert not any(isinstance(r.stages.graph[x], ir.Map) and r.stages.graph[x].op == "neg" for x in fused)
        assert not any(s.family == "extern" and s.note.startswith("slice copy") for s in steps), \
            [s.note for s in steps if s.family == "extern"]
        # q's and k's rotate-half: no cat left, each a roll (cat_roll.py) the multiply-add kernel
        # reads in place (fusion.views_read_in_place)
        assert not any(s.family == "extern" and "cat" in s.name for s in steps), [s.name for s in steps]
        rolls = {x for s in steps if s.family == "mapreduce" for x in s.reads
                 if r.stages.graph[x].op == "roll"}
        assert len(rolls) == 2, str(r.stages.plan)
