"""BatchNorm over the global batch (--sync-batchnorm), on any backend.

N processes of B samples each normalise, by default, with the statistics of their own B: the
run equals one process accumulating N micro-batches of B, not one process on N x B. torch's
SyncBatchNorm fixes that on GPUs only (it refuses CPU tensors, so gloo runs cannot use it);
`GlobalBatchNorm` does the same anywhere: the count, each channel's sum and sum of squares, in
float64, summed over the processes with one autograd-aware all-reduce, so the forward and the
backward are one process's on the whole global batch. `sync_batchnorm` converts a model's
BatchNorm layers to SyncBatchNorm on CUDA and to GlobalBatchNorm elsewhere.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

# the plain layers the conversion replaces (subclasses are a recipe's own: left alone)
PLAIN = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def global_sum(tensor: torch.Tensor) -> torch.Tensor:
    """The sum over the processes, differentiable; the tensor itself in one process."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return tensor
    with warnings.catch_warnings():  # its deprecation names a private replacement
        warnings.simplefilter("ignore", FutureWarning)
        from torch.distributed.nn.functional import all_reduce

        return all_reduce(tensor)


class GlobalBatchNorm(_BatchNorm):
    """BatchNorm of any dimension (channels in dim 1) with the global batch's statistics in
    training; evaluation uses the running statistics, as torch's. One process trains with the
    same float64 formula, so 1 and N processes differ only by float32 sum order.
    `synchronised = False` skips the all-reduce: each process normalises with its own rows'
    statistics (in the same float64 formula), as plain DDP does."""

    synchronised: bool = True

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected at least 2 dimensions (batch, channels), got {x.dim()}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(x)
        dims = [0, *range(2, x.dim())]
        wide = x.to(torch.float64)
        count = torch.full((1,), float(x.numel() // x.shape[1]), dtype=wide.dtype, device=x.device)
        totals = torch.cat([count, wide.sum(dims), (wide * wide).sum(dims)])
        totals = global_sum(totals) if self.synchronised else totals
        count, sums, squares = totals[:1], totals[1 : 1 + x.shape[1]], totals[1 + x.shape[1] :]
        mean = sums / count
        var = (squares / count - mean * mean).clamp(min=0)  # biased, as it normalises with
        if self.track_running_stats and self.running_mean is not None:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)  # type: ignore[union-attr,operator]
                tracked = float(self.num_batches_tracked)  # type: ignore[arg-type]
                m = self.momentum if self.momentum is not None else 1 / tracked
                unbiased = var * count / (count - 1).clamp(min=1)
                self.running_mean.mul_(1 - m).add_(m * mean.to(self.running_mean.dtype))
                self.running_var.mul_(1 - m).add_(m * unbiased.to(self.running_var.dtype))  # type: ignore[union-attr]
        shape = [1, x.shape[1]] + [1] * (x.dim() - 2)
        compute = torch.promote_types(x.dtype, torch.float32)
        scale = torch.rsqrt(var + self.eps).to(compute).view(shape)
        out = (x.to(compute) - mean.to(compute).view(shape)) * scale
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out.to(x.dtype)


def to_global(layer: _BatchNorm) -> GlobalBatchNorm:
    """`layer` as a GlobalBatchNorm holding the same parameter and buffer objects (so the same
    state-dict keys, device and values), as torch's convert_sync_batchnorm does: an optimizer
    built before the conversion (the template's order: optimizer, then `adapt_model`) still
    steps its weight and bias. New parameters would get gradients that no optimizer applies, and
    the layer would train with weight 1 and bias 0 for ever."""
    new = GlobalBatchNorm(
        layer.num_features, layer.eps, layer.momentum, layer.affine, layer.track_running_stats
    )
    state = [*layer.named_parameters(recurse=False), *layer.named_buffers(recurse=False)]
    for name, value in state:
        setattr(new, name, value)
    new.train(layer.training)
    return new


def sync_batchnorm(model: nn.Module, device: torch.device) -> nn.Module:
    """Every plain BatchNorm of `model` over the global batch: torch's SyncBatchNorm on CUDA
    (its kernels), GlobalBatchNorm elsewhere. In place for layers inside `model`; returns the
    model (a new one only if `model` is itself a BatchNorm)."""
    if device.type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if type(model) in PLAIN:
        return to_global(model)  # type: ignore[arg-type]
    for name, child in list(model.named_children()):
        setattr(model, name, sync_batchnorm(child, device))
    return model
