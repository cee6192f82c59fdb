"""Parameter counts, one way for `--dry-run`'s plan and the run's export, so that the two can be
held to each other."""

from __future__ import annotations

import torch
from torch import nn


def numel(parameter: torch.Tensor) -> int:
    """A parameter's full size: DeepSpeed ZeRO-3 leaves an empty tensor and records it apart
    (FSDP2's DTensor reports its full size itself)."""
    return getattr(parameter, "ds_numel", parameter.numel())


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(all parameters, those in nn.Embedding tables); shared tensors counted once."""
    total = sum(numel(p) for p in model.parameters())
    tables = {id(m.weight): numel(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return total, sum(tables.values())


def parameter_counts(model: nn.Module) -> dict[str, int]:
    """What the dry run prints of a network and the run's export records, by the same count:
    its parameters, those a model names apart from its original's network (`COUNTED_APART`,
    {label: parameter name}, e.g. quality's annotator reliabilities), and, with embedding
    tables, the parameters without them."""
    total, embeddings = count_parameters(model)
    apart = {
        label: numel(model.get_parameter(name))
        for label, name in getattr(model, "COUNTED_APART", {}).items()
    }
    total -= sum(apart.values())
    counts = {"parameters": total, **apart}
    if embeddings:
        counts["parameters excluding embeddings"] = total - embeddings
    return counts
