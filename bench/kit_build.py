"""What the peer kits' build scripts (bench/fa3_build.sh, bench/flashmla_sparse_build.sh) share: the CUDA
toolkit's folder for torch.utils.cpp_extension, and the include folders the host compiler needs besides
where the toolkit is a minimal one."""
import glob
import os
import sys

import torch
import torch.utils.cpp_extension as cpp_extension


def use_cuda_home():
    """torch.utils.cpp_extension's CUDA_HOME, else $CUDA_HOME (a CPU-only torch finds none: taking it from
    the environment lets the compile steps be tried there); returns it."""
    cpp_extension.CUDA_HOME = cpp_extension.CUDA_HOME or os.environ.get("CUDA_HOME")
    return cpp_extension.CUDA_HOME


def host_include_flags():
    """-isystem flags for the host compiler (the bindings, compiled without nvcc):
    - CUDA 13 keeps libcu++ (cuda/std/...) in include/cccl, which nvcc adds by itself; CUTLASS's headers,
      compiled by the host compiler, include <cuda/std/...>;
    - torch's CUDA headers (ATen/cuda/CUDAContext.h) include cuSPARSE / cuBLAS / cuSOLVER headers, which a
      toolkit assembled from pip wheels lacks: then they come from the nvidia-* wheels beside torch
      (nvidia/*/include), the first folder holding each."""
    cuda_include = os.path.join(use_cuda_home() or "", "include")
    host_includes = [d for d in [os.path.join(cuda_include, "cccl")] if os.path.isdir(d)]
    sites = [os.path.dirname(os.path.dirname(torch.__file__))] + [p for p in sys.path if p.endswith("-packages")]
    wheel_includes = [d for site in dict.fromkeys(sites)
                      for d in sorted(glob.glob(os.path.join(site, "nvidia", "*", "include")))]
    for header in ("cusparse.h", "cublas_v2.h", "cublasLt.h", "cusolverDn.h", "cusolver_common.h"):
        if not any(os.path.exists(os.path.join(d, header)) for d in [cuda_include] + host_includes):
            found = [d for d in wheel_includes if os.path.exists(os.path.join(d, header))]
            use = f"using {found[0]}" if found else "NOT FOUND: a binding including torch's CUDA headers cannot compile"
            print(f"{header}: not in {cuda_include}; {use}", flush=True)
            host_includes += found[:1]
    return [flag for d in host_includes for flag in ("-isystem", d)]
