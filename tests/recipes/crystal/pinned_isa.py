"""The code paths training_step.safetensors was made on, so that the recipe's step can be held to
it on any x86-64 CPU with AVX2, Intel or AMD (tests/fixtures/crystal/README.md: how it was made).

torch's CPU arithmetic depends on the CPU: ATen picks its vectorised kernels by the CPU's
capability (AVX-512, AVX2 or none: a sum over 16 or 8 lanes rounds otherwise), MKL picks its
GEMM and VML code branches by instruction set and vendor, oneDNN its JIT kernels by instruction
set. The fixture's first version, made on another machine (AVX-512, by its numbers), differed
from the same step taken here by the original's code in 367 of its 505 tensors (215 of 298 for
iComformer; the loss 5e-7 apart, near-zero bias gradients by more than their size), while the
original's code and the recipe, run here, agreed to the bit. Pinning each by an environment
variable, read when torch loads (so before `import torch`: a process of its own), changed
the step here in 383 of 505 tensors for `ATEN_CPU_CAPABILITY=default`, and in 381 for
`MKL_CBWR=COMPATIBLE`; the same unpinned step under QEMU as an Intel Haswell (AVX2, MKL's Intel
branch) differed from this AMD machine's in 381. The pins:

- `ATEN_CPU_CAPABILITY=avx2`: ATen's AVX2 kernels, the same code on every CPU with AVX2 and FMA;
  an AVX-512 CPU's are never taken.
- `MKL_CBWR=COMPATIBLE`: MKL's conditional numerical reproducibility on its SSE2 branch, the
  only one it runs on Intel and other vendors' CPUs alike (`MKL_CBWR=AVX2` is Intel's: on an
  AMD CPU MKL runs its AUTO branch instead, MKL_VERBOSE saying `CNR:AUTO`). Every MKL call of
  the step (SGEMM, SGEMM_BATCH) runs there (`CNR:COMPATIBLE`).
- `ONEDNN_MAX_CPU_ISA=AVX2` (oneDNN 3's name; it reads `DNNL_MAX_CPU_ISA` too): the step makes
  no oneDNN call today (capping it at SSE4.1 changed no bit), but a torch that routes a kernel
  there would still run AVX2 code.
- one thread (`OMP_NUM_THREADS`, `MKL_NUM_THREADS`, `MKL_DYNAMIC=FALSE`): MKL's CNR holds for a
  fixed thread count, and ATen splits its loops by thread.

Pinned, the step under QEMU as an Intel Haswell and as an AMD EPYC gave the same bits as each
other, and the same loss, gradients and running statistics as this machine's, to the bit. What
pinning cannot reach: AdamW's torch.sqrt runs MKL VML's sSqrt, whose kernel there (as on any
AMD CPU) starts from `rsqrtps`, an estimate whose bits are each CPU's own, so the updated
parameters may differ in the last bit of their update (test_original.UPDATE_ULPS).

Run as `python -m tests.recipes.crystal.pinned_isa OUT` with these set, it takes the recipe's
step (test_original.training_step) for both models and writes it to OUT, with the capability and
thread count it ran with in the file's metadata.
"""

from __future__ import annotations

import sys

PINNED_ISA = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_CBWR": "COMPATIBLE",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "MKL_DYNAMIC": "FALSE",
}


def main(out: str) -> None:
    import torch
    from safetensors.torch import save_file

    from tests.recipes.crystal.test_original import training_step

    steps = training_step("icomformer") | training_step("ecomformer")
    ran = {
        "capability": torch.backends.cpu.get_cpu_capability(),
        "threads": str(torch.get_num_threads()),
    }
    save_file({k: v.contiguous() for k, v in steps.items()}, out, metadata=ran)


if __name__ == "__main__":
    main(sys.argv[1])
