"""Losses that stay exact when the number of items per sample varies.

When does a recipe need this? When its loss is a mean over *items* (caption tokens, graph nodes,
the real positions of padded sequences) and samples hold different numbers of them. Averaging
per micro-batch, then over processes (DDP) and accumulation steps, weighs every micro-batch
equally, whatever its item count: the gradient is not that of the mean over the global batch,
and it changes with the number of processes and accumulation steps. (A loss that is a mean over
*samples*, like every loss with a fixed shape per sample, is exact already and needs nothing.)

`GlobalItemMean` makes it exact: each micro-batch contributes its summed item loss, and at the
end of the accumulation window the gradients are divided by the number of items in the whole
window on all processes (one all-reduce of one number per optimizer step). The gradient is then
the one a single process computes on the global batch at once, on 1 or N processes, with or
without accumulation.

Why not count the window's items first and divide the loss by it? That needs every micro-batch
of the window before the first backward; windows here run across epoch ends and the loader
hands out one batch at a time, so the division comes after the backward passes instead, which is
the same thing for the gradient because the gradient is linear in the loss.
"""

from __future__ import annotations

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from accel_common.batch_lr.batching import BatchPlan
from accel_common.errors import ConfigError


class GlobalItemMean:
    """The exact mean of a per-item loss over the global batch (see the module docstring).

        item_mean = GlobalItemMean(accelerator, plan)
        for batch in loop.batches():
            with accelerator.accumulate(model):
                per_token = F.cross_entropy(logits, labels, ignore_index=PAD, reduction="none")
                n_tokens = (labels != PAD).sum()
                accelerator.backward(item_mean.loss(per_token.sum(), n_tokens))
                item_mean.normalize_gradients(model)  # before clipping
                loop.clip_gradients(model)
                optimizer.step()
                optimizer.zero_grad()
            loop.record(per_token.sum() / n_tokens)

    `loss` returns the summed loss divided by the per-device batch in samples, a per-sample scale
    that keeps its magnitude (and fp16's loss scale) sensible; `normalize_gradients` turns the
    window's accumulated gradient into the gradient of the item mean, on the micro-batch that
    ends the window, and does nothing on the others.
    """

    def __init__(self, accelerator: Accelerator, plan: BatchPlan) -> None:
        if accelerator.distributed_type == DistributedType.DEEPSPEED:
            raise ConfigError(
                "GlobalItemMean rescales .grad, which DeepSpeed keeps to itself; use DDP or FSDP"
            )
        self.accelerator = accelerator
        # accelerator.backward divides by the accumulation steps and DDP averages over processes:
        # multiplying by both leaves the plain sum, and dividing by the global batch keeps the
        # sum's scale per-sample. normalize_gradients multiplies the global batch back in.
        self.global_batch_size = plan.global_batch_size
        self.scale = plan.num_processes * plan.grad_accum_steps / plan.global_batch_size
        self.items = torch.zeros((), dtype=torch.float64, device=accelerator.device)

    def loss(self, summed: torch.Tensor, count: torch.Tensor | int) -> torch.Tensor:
        """What to pass to `accelerator.backward`: this micro-batch's summed item loss, scaled;
        `count` is the number of items it summed over (counted for the window)."""
        self.items += torch.as_tensor(count, dtype=torch.float64, device=self.items.device)
        return summed * self.scale

    @torch.no_grad()
    def normalize_gradients(self, model: torch.nn.Module) -> None:
        """After `backward`, before clipping and the optimizer step: at a window's end, divide
        the gradients by the window's item count over all processes. A window without items
        keeps its (zero) gradients."""
        if not self.accelerator.sync_gradients:
            return
        total = self.accelerator.reduce(self.items, reduction="sum")
        factor = (self.global_batch_size / total.clamp(min=1)).float()
        for parameter in model.parameters():
            if parameter.grad is not None:
                parameter.grad.mul_(factor)
        self.items.zero_()
