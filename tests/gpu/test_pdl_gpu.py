"""Programmatic dependent launch on a GPU: a kernel may start while the kernel before it on the
stream still runs, so what it reads must still be the finished output of that kernel.

Chains of generated kernels, each reading what the one before wrote, back to back on one stream
(no synchronisation between them): GEMMs whose B (a weight) goes out before the wait, over the
producer loops a schedule can have (whole tiles, K slices, stream-K, ping-pong consumers); a
map-reduce kernel between GEMMs. Each output is checked against float32 under the 2x rule, and
every chain gives the bits it gives with programmatic launch turned off.
"""
import pytest
import torch

from tilefuse.check import rel_error
from tilefuse.codegen.gemm_sm90 import GemmProblem, GemmSchedule
from tilefuse.runtime import launch as rt_launch
from tilefuse.runtime.gemm import compile_gemm

pytestmark = pytest.mark.gpu

if torch.cuda.is_available() and torch.cuda.get_device_capability() < (9, 0):
    pytest.skip("programmatic dependent launch needs a Hopper GPU", allow_module_level=True)

SCHEDULES = {  # the producer loops a schedule can have
    "tiles": GemmSchedule(64, 64, stages=14, consumers=1, tma_store=False),
    "split": GemmSchedule(64, 64, stages=12, consumers=1, tma_store=False, split_k=2),
    "stream_k": GemmSchedule(64, 64, stages=12, consumers=1, tma_store=False, stream_k=12),
    "pingpong": GemmSchedule(128, 128, stages=4, pingpong=True),
}


def _chain(m: int, widths: list, sched, xs: list, weights) -> list:
    """Each x of `xs` through len(weights) GEMMs, each B a weight loaded before its wait: every
    kernel built, every output allocated (NaN) and the device synchronised first, then all the
    launches back to back, so that each GEMM's predecessor is the GEMM it reads."""
    gemms = [compile_gemm(GemmProblem(m, n, k, "bf16", b_const=True), sched)
             for n, k in zip(widths[1:], widths[:-1])]
    outs = [[torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16) for n in widths[1:]]
            for _ in xs]
    for g, w, y in zip(gemms, weights, outs[0]):  # a first call loads each kernel and encodes its maps
        g(torch.zeros(m, w.shape[1], device="cuda", dtype=torch.bfloat16), w, out=y)
    for ys in outs:
        for y in ys:
            y.fill_(float("nan"))
    torch.cuda.synchronize()
    for x, ys in zip(xs, outs):
        for g, w, y in zip(gemms, weights, ys):
            g(x, w, out=y)
            x = y
    torch.cuda.synchronize()
    return outs


def _links_pass(x, outs, weights, what: str):
    """Each output against float32 from the bf16 input it was given (the 2x rule, link by link)."""
    prev = x
    for y, w in zip(outs, weights):
        ref, low = prev.float() @ w.float().T, prev @ w.T
        assert torch.isfinite(y).all(), f"{what}: an element was not written"
        err, base = rel_error(y.float(), ref), rel_error(low.float(), ref)
        assert err <= 2 * base + 1e-5, f"{what}: error {err:.3e} vs torch's {base:.3e}"
        prev = y


@pytest.mark.parametrize("kind", list(SCHEDULES))
@pytest.mark.parametrize("m", [1, 200])
def test_a_gemm_launched_during_the_one_before_reads_its_finished_output(kind, m, monkeypatch):
    torch.manual_seed(0)
    widths = [1024, 2048, 1024, 2048, 1024]
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
               for k, n in zip(widths[:-1], widths[1:])]
    xs = [torch.randn(m, widths[0], device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    runs = _chain(m, widths, SCHEDULES[kind], xs, weights)
    for i, (x, outs) in enumerate(zip(xs, runs)):
        _links_pass(x, outs, weights, f"chain {i}")
    monkeypatch.setenv(rt_launch.PDL_ENV, "0")  # read when a kernel object first loads: new objects
    plain = _chain(m, widths, SCHEDULES[kind], xs[:1], weights)[0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0], plain)), "programmatic launch changed the bits"


class _Block(torch.nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.up = torch.nn.Linear(d, d, bias=False)
        self.norm = torch.nn.RMSNorm(d, eps=1e-6)
        self.down = torch.nn.Linear(d, d, bias=False)

    def forward(self, x):
        h = self.up(x)
        return self.down(self.norm(h)) + h


def test_map_reduce_kernels_between_gemms_read_and_are_read_finished():
    """GEMMs and map-reduce kernels of one program, each reading the one before, over calls
    whose inputs change: every call within the 2x rule of a float64 reference."""
    import tilefuse

    torch.manual_seed(1)
    d = 1024
    block = _Block(d)
    with torch.no_grad():
        block.norm.weight.copy_(torch.rand(d) + 0.5)
    ref_block = block.double().cuda()
    low_block = _Block(d).cuda().to(torch.bfloat16)
    low_block.load_state_dict(ref_block.state_dict())
    prog = tilefuse.compile(low_block, (torch.randn(64, d, device="cuda", dtype=torch.bfloat16),))
    xs = [torch.randn(64, d, device="cuda", dtype=torch.bfloat16) for _ in range(5)]
    with torch.no_grad():
        outs = [prog(x).clone() for x in xs]
        torch.cuda.synchronize()
        for x, out in zip(xs, outs):
            ref, low = ref_block(x.double()), low_block(x)
            assert torch.isfinite(out).all()
            err, base = rel_error(out.double(), ref), rel_error(low.double(), ref)
            assert err <= 2 * base + 1e-5, f"error {err:.3e} vs eager bf16's {base:.3e}"


def test_a_weight_at_an_odd_address_is_copied_once_at_a_16_byte_boundary():
    """A GEMM reads its weight before waiting for the kernel before it, so a weight must not be
    a copy that kernel makes: one at an odd address (a slice of a larger tensor) is copied
    once, when the program first runs on the device, not by every call."""
    import tilefuse

    torch.manual_seed(2)
    lin = torch.nn.Linear(1024, 1024, bias=False).cuda().to(torch.bfloat16)
    big = torch.randn(1024 * 1024 + 8, device="cuda", dtype=torch.bfloat16) / 32
    lin.weight = torch.nn.Parameter(big[1:1 + 1024 * 1024].view(1024, 1024), requires_grad=False)
    assert lin.weight.data_ptr() % 16
    x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    model = torch.nn.Sequential(lin, torch.nn.ReLU())
    prog = tilefuse.compile(model, (x,))
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
            out = prog(x)
            torch.cuda.synchronize()
            ref = (x.double() @ lin.weight.double().T).relu()
            low = lin(x).relu()
            err, base = rel_error(out.double(), ref), rel_error(low.double(), ref)
            assert err <= 2 * base + 1e-5, f"error {err:.3e} vs eager bf16's {base:.3e}"
    weights = prog.weights_on(x.device)
    assert weights and all(w.data_ptr() % 16 == 0 for w in weights.values() if w.is_cuda)
