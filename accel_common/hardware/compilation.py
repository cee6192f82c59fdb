"""`--compile`: torch.compile of a recipe's model, in place, so that nothing else changes.

Why in place (`nn.Module.compile()`) and not Accelerate's own compile (`Accelerator(dynamo_backend=
...)`, which wraps the prepared model as `torch.compile(model)` in `prepare`):

- The wrapper adds `_orig_mod.` to every key of the model's state dict, so a compiled run's
  checkpoints would not resume uncompiled (nor the reverse). In place, a compiled model's state
  dict is the plain one: checkpoints, the export, `--init-from` and copies such as pointcloud's EMA
  are byte-for-byte what an uncompiled run writes and reads.
- `accelerator.unwrap_model(model)` (keep_torch_compile=True, what the recipes call) replaces the
  wrapper's `_orig_mod` by the bare module: after its first call a DDP run's keys change from
  `_orig_mod.module.*` to `_orig_mod.*`, so its later checkpoints would not resume at all.
- Nothing is lost under DDP: DDP marks itself active while it calls the module it wraps, so
  dynamo's DDPOptimizer still splits the graph at the gradient buckets (all-reduce overlaps the
  backward), as when the DDP wrapper itself is compiled.

Only `forward` is compiled; other methods (captioning's `encode` / `decode` in greedy decoding)
run eagerly. The accelerate config's `dynamo_config` (ACCELERATE_DYNAMO_* in the launched
processes) is honoured the same way, once: `make_accelerator` turns Accelerate's own compile off.
"""

from __future__ import annotations

from dataclasses import dataclass

from accelerate.utils import DynamoBackend, TorchDynamoPlugin
from torch import nn

from accel_common.errors import ConfigError

COMPILE_HELP = (
    "torch.compile the model's forward (TorchInductor kernels: fused, fewer launches), in place, "
    "so checkpoints and the export keep plain keys and resume with or without it. The first "
    "steps, and the first evaluation, are slower while it compiles (seconds to minutes; again "
    "for each new input shape). An accelerate config's dynamo_backend compiles too, once, with "
    "its settings."
)


@dataclass(frozen=True)
class Compilation:
    """How the model is compiled: torch.compile's arguments and which setting asked for it."""

    backend: str
    mode: str | None
    fullgraph: bool
    dynamic: bool | None
    source: str  # "--compile" or "the accelerate config"

    def describe(self) -> str:
        """The banner's and --dry-run's line, e.g. 'inductor, dynamic shapes (--compile)'."""
        parts = [self.backend]
        if self.mode not in (None, "default"):
            parts.append(f"mode {self.mode}")
        if self.fullgraph:
            parts.append("fullgraph")
        if self.dynamic is not None:
            parts.append("dynamic shapes" if self.dynamic else "static shapes")
        return f"{', '.join(parts)} ({self.source})"

    def apply(self, model: nn.Module) -> None:
        model.compile(
            backend=self.backend, mode=self.mode, fullgraph=self.fullgraph, dynamic=self.dynamic
        )


def requested_compilation(flag: bool, dynamic: bool | None = None) -> Compilation | None:
    """What compiles the model: the launch config's dynamo settings where it sets a backend (with
    or without --compile: one compile, its settings), else inductor if `flag` (--compile), else
    nothing. `dynamic` is the recipe's shape default (True for graphs, whose sizes change every
    batch); a config's own `dynamo_use_dynamic` wins over it."""
    config = TorchDynamoPlugin()  # reads ACCELERATE_DYNAMO_*, which `accelerate launch` sets
    if config.backend != DynamoBackend.NO:
        if config.use_regional_compilation:
            raise ConfigError(
                "dynamo_use_regional_compilation in the accelerate config: the recipes compile "
                "the whole model (--compile); remove that line from the config"
            )
        chosen = dynamic if config.dynamic is None else config.dynamic
        backend = config.backend.value.lower()
        return Compilation(backend, config.mode, config.fullgraph, chosen, "the accelerate config")
    if flag:
        return Compilation("inductor", None, False, dynamic, "--compile")
    return None


def compile_line(flag: bool, dynamic: bool | None = None) -> str:
    """'no' or the compilation's description, for the banner and --dry-run."""
    compilation = requested_compilation(flag, dynamic)
    return compilation.describe() if compilation else "no"
