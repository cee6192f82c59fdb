"""An exponential moving average (EMA) of a model's weights, for every recipe: `--ema-decay`.

The run's `WeightEMA` is built by `make_loop(..., model=model)` before a resume (which restores it
with the checkpoint) and lives on the `Run`; a recipe reaches it as `loop.ema`. What it does, so
that no recipe writes it again:

- after each optimizer step (an accumulation window's end, never a micro-batch; not a step the
  loop skipped for non-finite gradients) the loop updates it: shadow <- d shadow + (1 - d) weight;
- evaluation scores it: the recipe evaluates inside `with loop.ema.applied():`, which puts the
  averaged weights into the model for the block and the trained ones back after (bit for bit);
  an evaluation logged outside it is refused, so a recipe cannot forget it;
- the exports (`loop.finish`, the best epoch's) hold it, and model.json says so (`"ema"`);
- checkpoints hold it (registered with the accelerator) and `--resume` restores it exactly.

What is averaged: the trainable parameters, as in both originals below; buffers (BatchNorm's
running statistics) and frozen parameters stay the model's own.

The decay of update k (from 1), `--ema-warmup`:
- `none` (the default): d = --ema-decay at every update, the average starting from the initial
  weights: pcdiff's `EMA` (DimensionLab/pcdiff-implant@115a399, pcdiff/train_completion.py), the
  textbook EMA of the weights (torch's `get_ema_multi_avg_fn`, timm's ModelEma). The default
  because the decay then means what it says at every step and the recipe that had an EMA
  (pointcloud, ported from pcdiff) keeps its meaning, presets and checkpoints. With a decay near
  1 on a short run, the initial weights weigh for long (0.999^1000 = 0.37): use a warm-up.
- `ratio`: d = min(decay, (1 + s) / (10 + s)), s = k - 1 (d = 0 at the first update: a copy of
  the weights): diffusers' `EMAModel` default (use_ema_warmup=False), TensorFlow's
  ExponentialMovingAverage(num_updates).
- `power`: d = min(decay, 1 - (1 + s / --ema-inv-gamma) ^ -(--ema-power)), also 0 at the first:
  diffusers' `EMAModel(use_ema_warmup=True, inv_gamma, power)`, as its DDPM example (power 3/4).
Each is computed with its original's arithmetic (pcdiff's `mul_(d).add_(w, alpha=1 - d)`,
diffusers' `sub_((1 - d) * (shadow - w))`), so a port averages as its original does.

Sharded training: under FSDP2 each process averages its own shard of each parameter, with no
communication and 1/N of the memory (the reason to shard); `applied()` swaps shard for shard
(resharding first, so no gathered copy is stale). A checkpoint holds the average gathered whole
(as the export gathers the model), so it resumes on any number of processes and reads without
torch.distributed; under DDP every process holds the same full copy. FSDP1 and DeepSpeed ZeRO-3
hold parameters as flat partitions and are refused.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor

from accel_common.errors import CheckpointError, ConfigError


class EmaWarmup(str, Enum):
    none = "none"
    ratio = "ratio"
    power = "power"


@dataclass(frozen=True)
class EmaSettings:
    """--ema-decay (0 = off), --ema-warmup and the power warm-up's --ema-power, --ema-inv-gamma."""

    decay: float = 0.0
    warmup: EmaWarmup = EmaWarmup.none
    power: float = 2 / 3
    inv_gamma: float = 1.0

    def decay_at(self, update: int) -> float:
        """The decay of the `update`-th update (from 1), as the module docstring gives it."""
        if self.warmup is EmaWarmup.none:
            return self.decay
        step = update - 1
        if step <= 0:
            return 0.0
        if self.warmup is EmaWarmup.power:
            return min(self.decay, 1 - (1 + step / self.inv_gamma) ** -self.power)
        return min(self.decay, (1 + step) / (10 + step))

    def record(self) -> dict[str, Any]:
        """The decay and its warm-up, as model.json's "ema" records them."""
        shape = {"power": self.power, "inv_gamma": self.inv_gamma}
        return {"decay": self.decay, "warmup": self.warmup.value} | (
            shape if self.warmup is EmaWarmup.power else {}
        )


def local(parameter: torch.Tensor) -> torch.Tensor:
    """This process's part of a parameter, sharing its storage: a DTensor's shard, else itself."""
    return parameter.to_local() if isinstance(parameter, DTensor) else parameter.detach()


class WeightEMA:
    """The EMA of a model's trainable parameters (the module docstring). `WeightEMA()` is the
    stand-in of a run without one: it averages nothing and `applied()` changes nothing."""

    def __init__(
        self,
        model: nn.Module | None = None,
        settings: EmaSettings = EmaSettings(),
        recipe_file: str = "the recipe",
    ) -> None:
        self.settings, self.recipe_file = settings, recipe_file
        named = [] if model is None else model.named_parameters()
        self.params = {name: p for name, p in named if p.requires_grad}
        with torch.no_grad():
            self.shadow = {name: local(p).clone() for name, p in self.params.items()}
        modules = model.modules() if model is not None else ()
        self.shards = [m for m in modules if isinstance(m, FSDPModule)]
        self.updates = 0  # optimizer steps averaged (a skipped step is none)
        self._applied = False
        self._scored = -1  # `updates` when the averaged weights were last applied

    @property
    def enabled(self) -> bool:
        return bool(self.params)

    def record(self) -> dict[str, Any] | None:
        """model.json's "ema": the averaging that gave the export's weights (None: no EMA)."""
        return {**self.settings.record(), "updates": self.updates} if self.enabled else None

    @torch.no_grad()
    def update(self) -> None:
        """Average in the weights of the optimizer step just taken (the loop calls it)."""
        if not self.enabled:
            return
        self.updates += 1
        decay = self.settings.decay_at(self.updates)
        pairs = [(self.shadow[name], local(p)) for name, p in self.params.items()]
        if self.settings.warmup is EmaWarmup.none:
            for shadow, weight in pairs:  # pcdiff's
                shadow.mul_(decay).add_(weight, alpha=1 - decay)
        else:
            one_minus_decay = 1 - decay
            for shadow, weight in pairs:  # diffusers' EMAModel.step
                shadow.sub_(one_minus_decay * (shadow - weight))

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """The averaged weights in the model for the block (evaluate, export), the trained ones
        back after; with no EMA, the model as it is. Every process enters it (under FSDP the
        block's forward passes are collective)."""
        if not self.enabled or self._applied:
            yield
            return
        self._swap()
        self._applied, self._scored = True, self.updates
        try:
            yield
        finally:
            self._swap()
            self._applied = False

    @torch.no_grad()
    def _swap(self) -> None:
        """Exchange the weights and the averages, tensor by tensor (one spare copy at a time).
        FSDP2 keeps a gathered copy of a unit's weights after a forward that does not reshard
        (the root, or reshard_after_forward off), which it would use instead: dropped first."""
        for module in self.shards:
            module.reshard()
        for name, parameter in self.params.items():
            weight, shadow = local(parameter), self.shadow[name]
            trained = weight.clone()
            weight.copy_(shadow)
            shadow.copy_(trained)

    def require_scored(self, metrics: dict[str, float]) -> None:
        """Refuse evaluation metrics computed outside `applied()` since the last update: they
        would score the trained weights while the export holds the averaged ones."""
        if self.enabled and metrics and self._scored != self.updates:
            raise ConfigError(
                f"--ema-decay: {self.recipe_file} logged an evaluation of the trained weights, "
                "not of their EMA (which the export holds): evaluate inside `with "
                "loop.ema.applied():` (see recipes/train_template.py)"
            )

    def state_dict(self) -> dict[str, Any]:
        """The averages whole, on the CPU, and the update count (collective under FSDP: every
        shard is gathered)."""
        shadow = {}
        for name, parameter in self.params.items():
            average = self.shadow[name]
            if isinstance(parameter, DTensor):
                average = DTensor.from_local(
                    average, parameter.device_mesh, parameter.placements,
                    shape=parameter.shape, stride=parameter.stride(),
                ).full_tensor()  # fmt: skip
            shadow[name] = average.cpu()
        return {"updates": self.updates, "shadow": shadow}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`'s, each process taking its shard; also the state pointcloud's
        own EMA (torch's AveragedModel, before 0.5) saved, with the same constant decay."""
        if "n_averaged" in state:
            names = {f"module.{name}": name for name in self.params}
            state = {
                "updates": int(state["n_averaged"]),
                "shadow": {names[k]: v for k, v in state.items() if k in names},
            }
        saved = state["shadow"]
        if saved.keys() != self.params.keys():
            differ = sorted(saved.keys() ^ self.params.keys())
            raise CheckpointError(
                f"the checkpoint's EMA of the weights averages other parameters than this model "
                f"has ({', '.join(differ[:3])}); resume with the model settings it was saved with"
            )
        for name, parameter in self.params.items():
            whole = saved[name].to(self.shadow[name].device)
            if isinstance(parameter, DTensor):
                mesh, placements = parameter.device_mesh, parameter.placements
                whole = distribute_tensor(whole, mesh, placements, src_data_rank=None).to_local()
            self.shadow[name].copy_(whole)
        self.updates = int(state["updates"])


def make_ema(
    accelerator: Accelerator,
    model: nn.Module | None,
    settings: EmaSettings,
    recipe_file: str = "the recipe",
) -> WeightEMA:
    """The run's EMA of `model` (prepared), registered for checkpointing, or the stand-in when
    --ema-decay is 0. Refused: a recipe that does not name its model, and shardings that hold
    parameters as flat partitions."""
    if not settings.decay:
        return WeightEMA()
    if model is None:
        raise ConfigError(
            f"--ema-decay: {recipe_file} does not pass its model to make_loop (model=model), so "
            "there is nothing to average; see recipes/train_template.py"
        )
    kind = accelerator.distributed_type
    zero3 = kind == DistributedType.DEEPSPEED and accelerator.state.deepspeed_plugin.zero_stage == 3
    if zero3 or (kind == DistributedType.FSDP and not accelerator.is_fsdp2):
        raise ConfigError(
            "--ema-decay: this launch shards parameters as flat partitions (FSDP1 or DeepSpeed "
            "ZeRO-3), which the EMA cannot average; launch with fsdp_version: 2 "
            "(accelerate_configs/fsdp_8gpu.yaml)"
        )
    ema = WeightEMA(accelerator.unwrap_model(model), settings, recipe_file)
    accelerator.register_for_checkpointing(ema)
    return ema
