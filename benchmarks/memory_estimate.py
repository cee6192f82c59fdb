"""Memory per GPU at the originals' sizes, estimated without a GPU (and, mostly, without computing).

The recipes' models are built at the original codebases' sizes (benchmarks/original_sizes.py) on
PyTorch's `meta` device, where tensors have shapes but no data, so a training step costs nothing
(the crystal model reads its batch vector, so it runs on the CPU at batch 1 and 2). What a step
holds on a GPU is then counted:

- weights, gradients and Adam's two moments: 16 bytes per fp32 parameter (DDP keeps all of them
  on every GPU; see docs/sharded.md for sharding them);
- activations kept for the backward pass, counted with `saved_tensors_hooks` (each saved tensor
  once, by identity), per sample, in fp32; under bf16/fp16 autocast most of them halve.

It leaves out the CUDA context (~0.5 GB), cuDNN workspaces, the backward pass's transient
buffers and allocator fragmentation; `make bench-gpu` measures the real peak and
docs/BENCHMARKS.md compares the two. Run: `python benchmarks/memory_estimate.py`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.original_sizes import Workload, workloads

GIB = 2**30


def saved_bytes(step: Callable[[], torch.Tensor]) -> int:
    """Bytes of the tensors autograd keeps for backward while `step`'s loss is built."""
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        seen[id(tensor)] = tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        step()
    return sum(seen.values())


def estimate(workload: Workload) -> dict[str, float]:
    """Parameters, fixed bytes (weights + grads + Adam), activation bytes per sample, and the
    total at the original's per-GPU batch, in fp32."""
    device = torch.device("meta" if workload.meta_ok else "cpu")
    torch.manual_seed(0)
    with device:
        model = workload.build()
    params = sum(p.numel() for p in model.parameters())
    fixed = 16 * params
    if not workload.activations_estimable:
        return {"parameters": params, "fixed_bytes": fixed, "per_sample_bytes": None,
                "total_bytes": None}  # fmt: skip
    one, two = (
        saved_bytes(lambda n=n: workload.loss(model, workload.batch(n, device))) for n in (1, 2)
    )
    per_sample = two - one  # what one more sample adds
    return {
        "parameters": params,
        "fixed_bytes": fixed,
        "per_sample_bytes": per_sample,
        "total_bytes": fixed + workload.per_gpu_batch * per_sample,
    }


def main() -> None:
    print("| recipe (original size) | parameters | weights + grads + Adam | activations / sample "
          "(fp32) | per-GPU batch | total at that batch (fp32) |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for workload in workloads():
        e = estimate(workload)
        unknown = "measure on a GPU (make bench-gpu)"
        activations = f"{e['per_sample_bytes'] / GIB:.3f} GiB" if e["total_bytes"] else unknown
        total = f"{e['total_bytes'] / GIB:.1f} GiB" if e["total_bytes"] else unknown
        print(
            f"| {workload.name} ({workload.size}) | {e['parameters'] / 1e6:.1f}M "
            f"| {e['fixed_bytes'] / GIB:.2f} GiB | {activations} "
            f"| {workload.per_gpu_batch} | {total} |"
        )


if __name__ == "__main__":
    main()
