"""Memory per GPU at the originals' sizes, estimated without a GPU (and without computing).

The point-cloud and Crowd-BT recipes are built at the original codebases' sizes on PyTorch's
`meta` device, where tensors have shapes but no data, so one training step costs nothing. What a
step holds on a GPU is then counted:

- weights, gradients and Adam's two moments: 16 bytes per fp32 parameter (DDP keeps all of them
  on every GPU; see docs/sharded.md for sharding them);
- activations kept for the backward pass, counted with `saved_tensors_hooks` (each saved tensor
  once, by identity), per sample, in fp32; under bf16/fp16 autocast most of them halve.

It leaves out the CUDA context (~0.5 GB), cuDNN workspaces and allocator fragmentation, so
budget 20-30% on top. Run: `python benchmarks/memory_estimate.py`.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
GIB = 2**30


def load_recipe(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "recipes" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def saved_bytes(step: Callable[[], torch.Tensor]) -> int:
    """Bytes of the tensors autograd keeps for backward while `step`'s loss is built."""
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        seen[id(tensor)] = tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        step()
    return sum(seen.values())


def pointcloud(batch: int) -> tuple[torch.nn.Module, Callable[[], torch.Tensor]]:
    """The original pcdiff size: 30720 points (3072 implant), width 256, 32^3 voxels."""
    recipe = load_recipe("train_pointcloud")
    model = recipe.PointVoxelDenoiser(width=256, depth=3, resolution=32).to("meta")
    skull = torch.empty(batch, 30720 - 3072, 3, device="meta")
    noisy = torch.empty(batch, 3072, 3, device="meta")
    t = torch.zeros(batch, dtype=torch.long, device="meta")
    return model, lambda: F.mse_loss(model(skull, noisy, t), noisy)


def quality(batch: int) -> tuple[torch.nn.Module, Callable[[], torch.Tensor]]:
    """The original Crowd-BT scorer: EfficientNet-B3 at 300 px; a batch of pairs is 2x images."""
    recipe = load_recipe("train_quality")
    with torch.device("meta"):
        model = recipe.QualityScorer("efficientnet_b3", num_annotators=8, dropout=0.2)
    images = torch.empty(2 * batch, 3, 300, 300, device="meta")
    return model, lambda: model(images).sum()


def main() -> None:
    rows = []
    for name, build, per_gpu in (("pointcloud", pointcloud, 8), ("quality", quality, 32)):
        one = saved_bytes(build(1)[1])
        model, step = build(2)
        per_sample = saved_bytes(step) - one  # what one more sample adds
        params = sum(p.numel() for p in model.parameters())
        fixed = 16 * params
        total = fixed + per_gpu * per_sample
        rows.append((name, params, fixed, per_sample, per_gpu, total))
    print("| recipe (original size) | parameters | weights + grads + Adam | activations / sample "
          "(fp32) | per-GPU batch | total at that batch (fp32) |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, params, fixed, per_sample, per_gpu, total in rows:
        print(
            f"| {name} | {params / 1e6:.1f}M | {fixed / GIB:.2f} GiB | {per_sample / GIB:.2f} GiB "
            f"| {per_gpu} | {total / GIB:.1f} GiB |"
        )


if __name__ == "__main__":
    main()
