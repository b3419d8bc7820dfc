"""How many thread-block clusters of 1, 2, 4 and 8 CTAs of the default 128x256 GEMM kernel an
H100 holds at once (cuOccupancyMaxActiveClusters): why the GEMM has no 2x2 cluster. Session 15:
132, 66, 30 (120 SMs: 12 idle) and 15.

    python3 bench/cluster_occupancy.py [M,N,K]
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from tilefuse.codegen.gemm_sm90 import GemmProblem, default_schedule  # noqa: E402
from tilefuse.runtime.gemm import compile_gemm  # noqa: E402
from tilefuse.runtime.launch import load_function  # noqa: E402


def main(spec: str) -> None:
    from cuda.bindings import driver

    p = GemmProblem(*(int(v) for v in spec.split(",")))
    kernel = compile_gemm(p, default_schedule(p))
    _, func, _ = load_function(kernel.cubin.data, kernel.source.name, 0, kernel.source.smem_bytes)
    driver.cuFuncSetAttribute(func, driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
    print(f"{kernel.source.name}: {kernel.source.smem_bytes} bytes of shared memory, block {kernel.source.block}")
    for cl in (1, 2, 4, 8):
        cfg = driver.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = 132 // cl * cl, 1, 1
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = kernel.source.block
        cfg.sharedMemBytes = kernel.source.smem_bytes
        attr = driver.CUlaunchAttribute()
        attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = cl, 1, 1
        cfg.attrs, cfg.numAttrs = [attr], 1
        err, clusters = driver.cuOccupancyMaxActiveClusters(func, cfg)
        print(f"clusters of {cl}: {clusters} at once ({clusters * cl} SMs)  [{err.name}]")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "8192,4096,4096")
