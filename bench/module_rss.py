"""What a loaded CUDA module costs (tilefuse never unloads one: a compiled kernel's module lives
as long as the process), and host memory over many compiled programs. The device column of the
first line needs an otherwise idle GPU.

usage: python bench/module_rss.py      (needs a GPU)"""
import gc
import os

import torch

import tilefuse
from tilefuse.runtime.launch import CompiledKernel, load_function


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main():
    x = torch.randn(64, 300, device="cuda")
    fn = tilefuse.compile(lambda a: torch.softmax(a * 2, -1), [x])
    fn(x)
    ck = next(o for o in gc.get_objects() if isinstance(o, CompiledKernel))
    print("cubin bytes", len(ck.cubin.data))
    torch.cuda.synchronize()
    r0, f0 = rss_mb(), torch.cuda.mem_get_info()[0]
    for i in range(2000):
        load_function(ck.cubin.data, ck.source.name, 0, ck.source.smem_bytes)
    r1, f1 = rss_mb(), torch.cuda.mem_get_info()[0]
    print(f"2000 module loads: host RSS +{r1 - r0:.1f} MB ({(r1 - r0) / 2000 * 1024:.1f} KB each), "
          f"device memory +{(f0 - f1) / 2**20:.1f} MB ({(f0 - f1) / 2000 / 1024:.1f} KB each)")
    # many distinct programs
    r0 = rss_mb()
    for i in range(1, 401):
        a = torch.randn(8 + i, 32 + 3 * i, device="cuda")
        f = tilefuse.compile(lambda a: (a.sin() * a).sum(-1) + a.amax(-1), [a])
        f(a)
        del f
        if i % 100 == 0:
            gc.collect()
            print(f"{i} programs: host RSS {rss_mb():.0f} MB (+{rss_mb() - r0:.0f})", flush=True)


if __name__ == "__main__":
    main()
