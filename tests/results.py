"""What a finished run left, read back and compared: its exported weights, its metrics log."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file


def exported_params(output_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(output_dir / "model" / "model.safetensors"))


def metrics_log(output_dir: Path) -> list[dict]:
    lines = (output_dir / "logs" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def max_relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest ||a - b|| / ||a|| over the floating-point tensors. Integer and boolean tensors
    (BatchNorm's `num_batches_tracked`, index buffers) have no norm and no rounding: they must be
    equal, or the comparison fails naming the tensor."""
    assert a.keys() == b.keys()
    differences = [0.0]
    for name in a:
        if a[name].is_floating_point() or a[name].is_complex():
            differences.append(((a[name] - b[name]).norm() / a[name].norm()).item())
        else:
            assert torch.equal(a[name], b[name]), f"{name}: {a[name]} != {b[name]}"
    return max(differences)


def global_relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """||a - b|| / ||a|| over all parameters at once."""
    assert a.keys() == b.keys()
    diff = sum(((a[k] - b[k]) ** 2).sum() for k in a) ** 0.5
    return (diff / sum((a[k] ** 2).sum() for k in a) ** 0.5).item()
