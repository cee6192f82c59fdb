"""FSDP2's wrap policy without its container trap.

Accelerate's FSDP2 port of SIZE_BASED_WRAP (`fsdp2_prepare_auto_wrap_policy`) wraps every module
whose parameters exceed `fsdp_min_num_params`, containers included. FSDP1's own size policy never
wrapped `nn.ModuleList` / `nn.ModuleDict` (torch's `size_based_auto_wrap_policy` excludes them):
a container has no forward of its own, so hooks on it never run, and FSDP2's `fully_shard`
refuses one outright ("fully_shard does not support containers that do not implement forward:
ModuleList"). Nearly every real model keeps its blocks in a ModuleList, so `fsdp_8gpu.yaml` would
crash on it. `guard_wrap_policy` keeps Accelerate's policy and leaves out every module without a
forward of its own; the blocks inside such a container are still their own units.

It also keeps a tie whole: a parameter that two modules share (nanoGPT's `lm_head.weight =
wte.weight`) must be in one unit, or `fully_shard` refuses it ("... is shared with a parameter
already managed by another FSDP group"). The size policy alone makes a unit of a large embedding
(GPT-2's exceeds fsdp_8gpu.yaml's fsdp_min_num_params); `keeping_ties_whole` leaves out every
module that holds some but not all names of a shared parameter, so the tie lands in the smallest
unit holding all of them (the root, for an embedding tied to the head).
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


def keeping_ties_whole(policy: Policy, model: nn.Module) -> Policy:
    """`policy`, minus the modules of `model` that would split a shared parameter's names
    (a tied embedding and head; a module used in two places) between two units."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    shared = [group for group in names.values() if len(group) > 1]
    if not shared:
        return policy
    prefixes: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        prefixes.setdefault(id(module), []).append(f"{name}." if name else "")

    def whole(module: nn.Module) -> bool:
        under = tuple(prefixes.get(id(module), ()))
        return all(len({name.startswith(under) for name in group}) == 1 for group in shared)

    return lambda module: whole(module) and policy(module)


def _guarded(prepare: Callable[..., Policy | None]) -> Callable[..., Policy | None]:
    @functools.wraps(prepare)
    def prepare_policy(plugin, model: nn.Module) -> Policy | None:
        policy = prepare(plugin, model)
        return None if policy is None else keeping_ties_whole(without_containers(policy), model)

    prepare_policy.guarded = True
    return prepare_policy


def guard_wrap_policy() -> None:
    """Make Accelerate's FSDP2 auto-wrap skip forward-less containers and keep ties whole
    (idempotent).

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
