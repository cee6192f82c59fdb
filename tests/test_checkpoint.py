"""Conversion of foreign checkpoints, the clean export, and crash-safe resumable saves."""

from __future__ import annotations

import collections
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from accel_common.batching import plan_batch
from accel_common.checkpoint import (
    TrainProgress,
    convert_checkpoint,
    list_checkpoints,
    load_checkpoint,
    load_exported,
    resolve_resume,
    save_checkpoint,
    strip_wrapper_prefixes,
)
from accel_common.errors import CheckpointError


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(4, 8)
        self.head = nn.Sequential(nn.ReLU(), nn.Linear(8, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def reference_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return Net().state_dict()


def with_prefix(state: dict, prefix: str) -> dict:
    return {prefix + k: v for k, v in state.items()}


PREFIXES = ["module.", "_orig_mod.", "model.module.", "module._orig_mod.", "_orig_mod.module."]
WRAPPERS = [
    lambda s: s,
    lambda s: {"model_state": s, "epoch": 3, "optimizer": {"lr": 0.1}},
    lambda s: {"state_dict": s, "global_step": 10},
    lambda s: {"model": s},
    lambda s: {"checkpoint_meta": "x", "model": {"state_dict": s}},
]


@pytest.mark.parametrize("prefix", ["", *PREFIXES])
@pytest.mark.parametrize("wrap", range(len(WRAPPERS)))
def test_convert_torch_save_files(tmp_path, prefix, wrap):
    expected = reference_state()
    source = tmp_path / "ckpt.pt"
    torch.save(WRAPPERS[wrap](with_prefix(expected, prefix)), source)
    path = convert_checkpoint(source, tmp_path / "out")
    converted = load_file(str(path))
    assert converted.keys() == expected.keys()
    for key in expected:
        assert torch.equal(converted[key], expected[key])
    model = Net()
    load_exported(tmp_path / "out", model)  # strict
    assert torch.equal(model.encoder.weight, expected["encoder.weight"])


def test_compiled_submodule_prefix_is_removed(tmp_path):
    state = {"encoder._orig_mod.weight": torch.ones(2), "module.head.bias": torch.zeros(2)}
    assert set(strip_wrapper_prefixes(state)) == {"encoder.weight", "head.bias"}


def test_convert_safetensors_and_accelerate_folder(tmp_path):
    expected = reference_state()
    folder = tmp_path / "save_state"
    folder.mkdir()
    save_file(with_prefix(expected, "module."), str(folder / "model.safetensors"))
    converted = load_file(str(convert_checkpoint(folder, tmp_path / "out")))
    assert converted.keys() == expected.keys()


def test_refuses_unsafe_pickle_without_running_it(tmp_path):
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    source = tmp_path / "evil.pt"
    torch.save({"state_dict": reference_state(), "hook": Exploit()}, source)
    with pytest.raises(CheckpointError, match="arbitrary code"):
        convert_checkpoint(source, tmp_path / "out")
    assert not marker.exists()
    assert not (tmp_path / "out").exists()


def test_truncated_file_is_a_clear_error(tmp_path):
    source = tmp_path / "ckpt.pt"
    torch.save(reference_state(), source)
    source.write_bytes(source.read_bytes()[:200])
    with pytest.raises(CheckpointError, match="corrupt, truncated"):
        convert_checkpoint(source, tmp_path / "out")


def test_no_weights_found_lists_keys(tmp_path):
    source = tmp_path / "ckpt.pt"
    torch.save({"epoch": 3, "optimizer": {"lr": 0.1}}, source)
    with pytest.raises(CheckpointError, match=r"top-level keys are \[epoch, optimizer\]"):
        convert_checkpoint(source, tmp_path / "out")


def test_convert_never_overwrites_without_force(tmp_path):
    source = tmp_path / "ckpt.pt"
    torch.save(reference_state(), source)
    first = convert_checkpoint(source, tmp_path / "out")
    before = first.read_bytes()
    with pytest.raises(CheckpointError, match="--force"):
        convert_checkpoint(source, tmp_path / "out")
    assert first.read_bytes() == before
    convert_checkpoint(source, tmp_path / "out", force=True)


def test_export_load_rejects_a_different_architecture(tmp_path):
    convert_checkpoint(_saved(tmp_path), tmp_path / "out")
    with pytest.raises(CheckpointError, match="does not fit this model"):
        load_exported(tmp_path / "out", nn.Linear(4, 2))


def _saved(tmp_path):
    source = tmp_path / "ckpt.pt"
    torch.save(reference_state(), source)
    return source


def test_crash_during_save_keeps_previous_checkpoint_loadable(tmp_path, accelerator, monkeypatch):
    torch.manual_seed(0)
    model, plan = Net(), plan_batch(1, global_batch_size=8)
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = accelerator.prepare(model, optimizer)
    progress = TrainProgress(step=5, samples_in_epoch=40)
    good = save_checkpoint(accelerator, tmp_path, progress, plan=plan)
    saved_weight = model.encoder.weight.detach().clone()

    def crash_midway(output_dir: str) -> None:
        os.makedirs(output_dir, exist_ok=True)
        with open(os.path.join(output_dir, "model.safetensors"), "wb") as half_written:
            half_written.write(b"\x00" * 10)
        raise OSError("disk full")

    monkeypatch.setattr(accelerator, "save_state", crash_midway)
    with torch.no_grad():
        model.encoder.weight.add_(1.0)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(accelerator, tmp_path, TrainProgress(step=10), plan=plan)
    monkeypatch.undo()

    assert list_checkpoints(tmp_path) == [good]
    assert resolve_resume("latest", tmp_path) == good
    progress = load_checkpoint(accelerator, good, plan)
    assert progress == TrainProgress(step=5, samples_in_epoch=40)
    assert torch.equal(model.encoder.weight, saved_weight)


def test_keep_last_prunes_old_checkpoints(tmp_path, accelerator):
    accelerator.prepare(Net())
    plan = plan_batch(1, global_batch_size=8)
    for step in (1, 2, 3, 4):
        save_checkpoint(accelerator, tmp_path, TrainProgress(step=step), plan=plan, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_3", "step_4"]


def test_corrupt_checkpoint_is_refused_with_advice(tmp_path, accelerator):
    accelerator.prepare(Net())
    plan = plan_batch(1, global_batch_size=8)
    path = save_checkpoint(accelerator, tmp_path, TrainProgress(step=1), plan=plan)
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:50])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_checkpoint(accelerator, path, plan)


def test_resume_with_another_global_batch_is_refused(tmp_path, accelerator):
    accelerator.prepare(Net())
    path = save_checkpoint(
        accelerator, tmp_path, TrainProgress(step=1), plan=plan_batch(1, global_batch_size=8)
    )
    with pytest.raises(CheckpointError, match="pass --bs 8"):
        load_checkpoint(accelerator, path, plan_batch(1, global_batch_size=16))


def test_resume_path_without_progress_is_refused(tmp_path):
    (tmp_path / "half").mkdir()
    with pytest.raises(CheckpointError, match="never completed"):
        resolve_resume(str(tmp_path / "half"), tmp_path)
    assert resolve_resume("latest", tmp_path / "empty") is None


def test_ordered_dict_state_dicts_convert():
    state = collections.OrderedDict(reference_state())
    assert strip_wrapper_prefixes(with_prefix(state, "module.")).keys() == state.keys()
