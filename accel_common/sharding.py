"""FSDP2's wrap policy without its container trap.

Accelerate's FSDP2 port of SIZE_BASED_WRAP (`fsdp2_prepare_auto_wrap_policy`) wraps every module
whose parameters exceed `fsdp_min_num_params`, containers included. FSDP1's own size policy never
wrapped `nn.ModuleList` / `nn.ModuleDict` (torch's `size_based_auto_wrap_policy` excludes them):
a container has no forward of its own, so hooks on it never run, and FSDP2's `fully_shard`
refuses one outright ("fully_shard does not support containers that do not implement forward:
ModuleList"). Nearly every real model keeps its blocks in a ModuleList, so `fsdp_8gpu.yaml` would
crash on it. `guard_wrap_policy` keeps Accelerate's policy and leaves out every module without a
forward of its own; the blocks inside such a container are still their own units.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from accelerate import Accelerator
from accelerate.utils import DistributedType, fsdp_utils
from torch import nn

Policy = Callable[[nn.Module], bool]


def has_own_forward(module: nn.Module) -> bool:
    """Whether calling the module runs code of its own (a ModuleList / ModuleDict does not)."""
    return type(module).forward is not nn.Module.forward


def without_containers(policy: Policy) -> Policy:
    """`policy`, minus the modules FSDP2 cannot make a unit of."""
    return lambda module: has_own_forward(module) and policy(module)


def _guarded(prepare: Callable[..., Policy | None]) -> Callable[..., Policy | None]:
    @functools.wraps(prepare)
    def prepare_policy(plugin, model: nn.Module) -> Policy | None:
        policy = prepare(plugin, model)
        return None if policy is None else without_containers(policy)

    prepare_policy.guarded = True
    return prepare_policy


def guard_wrap_policy() -> None:
    """Make Accelerate's FSDP2 auto-wrap skip forward-less containers (idempotent).

    Accelerate looks the policy builder up by name in `accelerate.utils.fsdp_utils` each time it
    prepares a model, and takes no policy callable of ours (any function that is not one of
    torch's two policies turns auto-wrapping off), so the builder itself is wrapped.
    """
    current = fsdp_utils.fsdp2_prepare_auto_wrap_policy
    if not getattr(current, "guarded", False):
        fsdp_utils.fsdp2_prepare_auto_wrap_policy = _guarded(current)


def forward_is_collective(accelerator: Accelerator) -> bool:
    """Whether every forward pass all-gathers parameters (FSDP, DeepSpeed ZeRO-3), so that all
    processes must run the same number of them, in evaluation too: a loop that stops early on
    one process (greedy decoding until every caption ended) would leave the others waiting."""
    if accelerator.distributed_type == DistributedType.FSDP:
        return True
    plugin = accelerator.state.deepspeed_plugin
    return plugin is not None and plugin.zero_stage == 3
