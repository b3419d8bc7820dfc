"""What PyTorch's attention backends cost at a shape they have not seen: the first call's wall
time (host planning included) and the steady per-call GPU time, for a causal prefill (1 x 32
heads x S x 128, bf16, S ~2000-2300) and a one-token decode step against a cache of S ~3000.
Each backend gets new values of S, so its first call at each is a first sight.

    python3 bench/sdpa_first_call.py

Behind program._planless_attention: PyTorch's default on Hopper (cuDNN's) plans each new
shape on the host, flash and memory-efficient attention do not. Prints one line per
(kind, backend), then which kernels the default ran.
"""
import time, statistics, torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
print(torch.cuda.get_device_name(), torch.__version__, "cudnn", torch.backends.cudnn.version(), flush=True)
dev, dt = "cuda", torch.bfloat16
def first_and_steady(fn):
    torch.cuda.synchronize(); t = time.perf_counter(); fn(); torch.cuda.synchronize(); first = (time.perf_counter() - t) * 1e3
    fn(); torch.cuda.synchronize()
    ts = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b) * 1e3)
    return first, statistics.median(ts)
backends = {"default": None, "cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}
# warm each backend once at an unrelated shape
for name, be in backends.items():
    q = torch.randn(1, 32, 64, 128, device=dev, dtype=dt)
    ctx = sdpa_kernel([be]) if be is not None else torch.no_grad()
    with ctx, torch.no_grad():
        F.scaled_dot_product_attention(q, q, q, is_causal=True); F.scaled_dot_product_attention(q[:, :, :1], q, q)
torch.cuda.synchronize()
base = 2000
for kind in ("prefill", "decode"):
    for i, (name, be) in enumerate(backends.items()):
        firsts, steadies = [], []
        for j in range(4):
            S = base + 97 * (i * 4 + j) + (1000 if kind == "decode" else 0)
            if kind == "prefill":
                q = k = v = torch.randn(1, 32, S, 128, device=dev, dtype=dt)
                fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                k = v = torch.randn(1, 32, S, 128, device=dev, dtype=dt); q = torch.randn(1, 32, 1, 128, device=dev, dtype=dt)
                fn = lambda: F.scaled_dot_product_attention(q, k, v)
            ctx = sdpa_kernel([be]) if be is not None else torch.no_grad()
            try:
                with ctx, torch.no_grad():
                    f, s = first_and_steady(fn)
            except RuntimeError as e:
                print(kind, name, "fails:", str(e).splitlines()[0][:100]); break
            firsts.append(f); steadies.append(s)
        if firsts:
            print(f"{kind:8} {name:10} first call at a new S: {[round(x, 2) for x in firsts]} ms; steady {[round(x, 1) for x in steadies]} us", flush=True)
with torch.no_grad():
    q = torch.randn(1, 32, 2345, 128, device=dev, dtype=dt)
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        F.scaled_dot_product_attention(q, q, q, is_causal=True); F.scaled_dot_product_attention(q[:, :, :1], q, q)
        torch.cuda.synchronize()
    print("default's kernels:", sorted({e.name[:80] for e in p.events() if e.device_type.name == "CUDA"}))
