"""Conversion of foreign checkpoints, the clean export, and crash-safe resumable saves."""

from __future__ import annotations

import collections
import errno
import importlib
import os
import shutil

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from accel_common.batch_lr.batching import plan_batch
from accel_common.checkpoints.checkpoint import (
    TrainProgress,
    list_checkpoints,
    load_checkpoint,
    resolve_resume,
    save_checkpoint,
)
from accel_common.checkpoints.export import (
    load_exported,
    read_export_metadata,
    read_recipe_export,
    strip_wrapper_prefixes,
    write_export,
)
from accel_common.conversion.convert import convert_checkpoint
from accel_common.data import fingerprint
from accel_common.errors import CheckpointError


def at_step(step: int) -> TrainProgress:
    """A position `step` optimizer steps into the first epoch, at the tests' global batch of 8
    (as the position's arithmetic requires: a step takes one global batch)."""
    return TrainProgress(step=step, samples_in_epoch=8 * step)


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


def test_convert_to_a_safetensors_name_writes_that_file_and_its_json(tmp_path):
    expected = reference_state()
    source = tmp_path / "ckpt.pt"
    torch.save({"model_state": with_prefix(expected, "module._orig_mod.")}, source)
    target = tmp_path / "out" / "merged.safetensors"
    assert convert_checkpoint(source, target) == target
    converted = load_file(str(target))  # a file safetensors opens, not a folder
    assert converted.keys() == expected.keys()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "merged.json",
        "merged.safetensors",
    ]
    assert read_export_metadata(target)["converted_from"] == str(source)
    assert load_exported(target, Net())["num_tensors"] == len(expected)  # strict, reads merged.json
    before = target.read_bytes()
    torch.save(with_prefix({k: v + 1 for k, v in expected.items()}, "module."), source)
    with pytest.raises(CheckpointError, match=r"merged\.safetensors exists; pass --force"):
        convert_checkpoint(source, target)
    assert target.read_bytes() == before
    convert_checkpoint(source, target, force=True)
    assert torch.equal(load_file(str(target))["head.1.bias"], expected["head.1.bias"] + 1)


def test_convert_to_a_folder_writes_model_safetensors_and_model_json(tmp_path):
    source = _saved(tmp_path)
    path = convert_checkpoint(source, tmp_path / "out")
    assert path == tmp_path / "out" / "model.safetensors"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "model.json",
        "model.safetensors",
    ]
    assert read_export_metadata(path)["converted_from"] == str(source)  # model.json, beside it
    # a folder an earlier version wrote as OUT.safetensors/ is still a folder
    (tmp_path / "old.safetensors").mkdir()
    old = convert_checkpoint(source, tmp_path / "old.safetensors")
    assert old == tmp_path / "old.safetensors" / "model.safetensors"
    assert read_export_metadata(tmp_path / "old.safetensors")["num_tensors"] == 4


def test_convert_into_a_path_that_is_a_file_is_refused(tmp_path):
    source = _saved(tmp_path)
    (tmp_path / "out.pt").write_text("mine")
    with pytest.raises(CheckpointError, match=r"out\.pt is a file; give a folder"):
        convert_checkpoint(source, tmp_path / "out.pt")
    assert (tmp_path / "out.pt").read_text() == "mine"


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
    with pytest.raises(
        CheckpointError, match=r"could not write \(disk full\) while saving step_10"
    ):
        save_checkpoint(accelerator, tmp_path, at_step(10), plan=plan)
    monkeypatch.undo()

    assert list_checkpoints(tmp_path) == [good]
    assert resolve_resume("latest", tmp_path) == good
    progress, _ = load_checkpoint(accelerator, good, plan)
    assert progress == TrainProgress(step=5, samples_in_epoch=40)
    assert torch.equal(model.encoder.weight, saved_weight)


def test_keep_last_prunes_old_checkpoints(tmp_path, accelerator):
    accelerator.prepare(Net())
    plan = plan_batch(1, global_batch_size=8)
    for step in (1, 2, 3, 4):
        save_checkpoint(accelerator, tmp_path, at_step(step), plan=plan, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_3", "step_4"]


def test_ordered_dict_state_dicts_convert():
    state = collections.OrderedDict(reference_state())
    assert strip_wrapper_prefixes(with_prefix(state, "module.")).keys() == state.keys()


# --------------------------------------------------------------------------- whose checkpoint


def test_pruning_keeps_other_runs_checkpoints(tmp_path, accelerator):
    accelerator.prepare(Net())
    plan = plan_batch(1, global_batch_size=8)
    theirs = save_checkpoint(accelerator, tmp_path, at_step(640), plan=plan, run={"id": "old"})
    for step in (100, 200, 300):
        save_checkpoint(
            accelerator, tmp_path, at_step(step), plan=plan, keep_last=2,
            run={"id": "new"},
        )  # fmt: skip
    assert [p.name for p in list_checkpoints(tmp_path, "new")] == ["step_200", "step_300"]
    assert theirs in list_checkpoints(tmp_path)


def test_leftover_unfinished_saves_are_removed_by_the_next_save(tmp_path, accelerator):
    accelerator.prepare(Net())
    plan = plan_batch(1, global_batch_size=8)
    leftover = tmp_path / "checkpoints" / "step_7.tmp"
    leftover.mkdir(parents=True)
    (leftover / "model.safetensors").write_bytes(b"\0" * 10)
    save_checkpoint(accelerator, tmp_path, at_step(9), plan=plan)
    assert not leftover.exists()
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_9"]


def test_a_checkpoint_whose_shapes_do_not_fit_names_the_weight(tmp_path):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    plan = plan_batch(1, global_batch_size=8)
    AcceleratorState._reset_state(reset_partial_state=True)
    saver = Accelerator(cpu=True)
    saver.prepare(torch.nn.Linear(4, 3))
    path = save_checkpoint(saver, tmp_path, at_step(1), plan=plan)
    AcceleratorState._reset_state(reset_partial_state=True)
    loader = Accelerator(cpu=True)
    loader.prepare(torch.nn.Linear(4, 5))
    with pytest.raises(CheckpointError) as error:
        load_checkpoint(loader, path, plan)
    AcceleratorState._reset_state(reset_partial_state=True)
    assert "shape mismatch: weight weight is [3, 4] in the checkpoint, [5, 4] in the model" in str(
        error.value
    )
    assert "corrupt" not in str(error.value)


def test_a_recipe_command_refuses_another_recipes_or_a_converted_export(tmp_path):
    template = importlib.import_module("recipes.train_template")
    weights = {"w": torch.ones(2)}
    write_export(weights, tmp_path / "pc", {"recipe": "pointcloud", "config": {"width": 16}})
    with pytest.raises(CheckpointError, match=r"exported by the 'pointcloud' recipe \(width=16\)"):
        template.evaluate_export(model_dir=tmp_path / "pc", data=tmp_path, split="test")
    source = tmp_path / "ddp.pt"
    torch.save({"module.w": torch.ones(2)}, source)
    convert_checkpoint(source, tmp_path / "converted")
    with pytest.raises(
        CheckpointError, match=r"converted by `accel-recipes convert` from .*ddp.pt"
    ):
        read_recipe_export(tmp_path / "converted", "template")
    with pytest.raises(CheckpointError, match=r"--model .*nowhere: no such folder"):
        read_recipe_export(tmp_path / "nowhere", "template")
    write_export(weights, tmp_path / "mine", {"recipe": "template", "config": {"hidden": 8}})
    assert read_recipe_export(tmp_path / "mine", "template") == {"hidden": 8}


def test_convert_a_file_that_is_neither_safetensors_nor_torch_says_so(tmp_path):
    source = tmp_path / "weights.bin"
    source.write_bytes(b"GARBAGE, not a checkpoint at all" * 4)
    with pytest.raises(CheckpointError) as error:
        convert_checkpoint(source, tmp_path / "out")
    assert "neither a safetensors file nor a PyTorch checkpoint" in str(error.value)
    assert "run arbitrary code" not in str(error.value)
    renamed = tmp_path / "model.pt"  # a safetensors file under another name still converts
    save_file({"w": torch.ones(2)}, str(renamed))
    assert load_file(str(convert_checkpoint(renamed, tmp_path / "out"))).keys() == {"w"}


def test_exports_get_the_users_normal_file_permissions(tmp_path):
    old = os.umask(0o022)
    try:
        path = write_export({"w": torch.ones(2)}, tmp_path / "model", {"recipe": "x"})
        converted = convert_checkpoint(path, tmp_path / "out.safetensors")
    finally:
        os.umask(old)
    for file in (path, path.with_suffix(".json"), converted, converted.with_suffix(".json")):
        assert file.stat().st_mode & 0o777 == 0o644, file


def test_an_export_with_a_non_finite_metric_is_refused_and_nothing_written(tmp_path):
    """JSON has no NaN: `train_loss: NaN` in a model.json breaks every strict reader."""
    target = tmp_path / "model"
    with pytest.raises(CheckpointError, match=r"model.json: metrics.train_loss is nan"):
        write_export(reference_state(), target, {"metrics": {"train_loss": float("nan")}})
    assert not target.exists() or not any(target.iterdir())


# --------------------------------------------------------------------------- the data's identity


def test_the_data_fingerprint_covers_contents_and_reads_each_file_once(tmp_path, monkeypatch):
    """Issue 27: the fingerprint held names and sizes, so an edit of the same size resumed."""
    data, cache = tmp_path / "data", tmp_path / "cache" / "hashes.json"
    data.mkdir()
    (data / "train.csv").write_text("x,y\n1.5,2.0\n")
    first, digests = fingerprint.files_fingerprint(
        fingerprint.named_files([data / "train.csv"], data), cache
    )
    assert first.startswith("read-sha256:") and list(digests) == ["train.csv"]
    copy = tmp_path / "copy"
    shutil.copytree(data, copy)
    assert fingerprint.files_fingerprint({"train.csv": copy / "train.csv"})[0] == first  # anywhere

    read = []
    monkeypatch.setattr(fingerprint, "file_digest", lambda path: read.append(path) or "x")
    assert fingerprint.files_fingerprint({"train.csv": data / "train.csv"}, cache)[0] == first
    assert read == []  # from the cache
    monkeypatch.undo()
    stat = (data / "train.csv").stat()
    (data / "train.csv").write_text("x,y\n1.5,2.1\n")  # same size
    os.utime(data / "train.csv", ns=(stat.st_atime_ns, stat.st_mtime_ns))  # and the same mtime
    assert (data / "train.csv").stat().st_size == stat.st_size
    edited, now = fingerprint.files_fingerprint({"train.csv": data / "train.csv"}, cache)
    assert edited != first
    assert fingerprint.files_fingerprint({"train.csv": data / "train.csv"})[0] == edited
    assert fingerprint.describe_changes(digests, now) == "changed: train.csv"


def test_data_files_are_named_relative_to_their_folder_or_else_absolute(tmp_path):
    """A copy of --data elsewhere is the same data; a file outside it (a CSV row naming another
    folder) keeps its full path; `root` a file is named by its name."""
    data, other = tmp_path / "data", tmp_path / "other"
    named = fingerprint.named_files([data / "a" / "x.npy", other / "y.npy"], data)
    assert named == {"a/x.npy": data / "a" / "x.npy", str(other / "y.npy"): other / "y.npy"}
    assert list(fingerprint.named_files([other / "y.png"], other, "--image-dir/")) == [
        "--image-dir/y.png"
    ]
    assert list(fingerprint.named_files([data / "s.extxyz"], data / "s.extxyz")) == ["s.extxyz"]
    assert list(fingerprint.named_files([tmp_path / "data2" / "z"], data)) == [
        str(tmp_path / "data2" / "z")
    ]  # a sibling whose name starts like the folder's is outside it


# --------------------------------------------------------------------------- a full disk


# what a full disk raises, by writer: Python's own writes an OSError; torch.save's C++ writer a
# RuntimeError without errno (measured on a full tmpfs); safetensors an error naming os error 28
FULL_DISK_ERRORS = {
    "python": OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)),
    "torch.save": RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576"),
    "safetensors": SafetensorError(
        "Error while serializing: I/O error: No space left on device (os error 28)"
    ),
}


def filling_the_disk(error: Exception, monkeypatch: pytest.MonkeyPatch):
    """accelerator.save_state on a full disk: part of the weights written, then `error`; the
    disk reports no space left."""
    free = shutil.disk_usage("/")._replace(free=0)
    monkeypatch.setattr("accel_common.checkpoints.export.shutil.disk_usage", lambda _path: free)

    def no_space(output_dir: str) -> None:
        os.makedirs(output_dir, exist_ok=True)
        with open(os.path.join(output_dir, "model.safetensors"), "wb") as half_written:
            half_written.write(b"\x00" * 10)
        raise error

    return no_space


@pytest.mark.parametrize("writer", FULL_DISK_ERRORS)
def test_a_full_disk_during_a_save_is_one_line_and_loses_nothing(
    writer, tmp_path, accelerator, monkeypatch
):
    """Issue 27: a full disk during a save printed a 78-line traceback. Issue 43: it still did
    where torch.save or safetensors filled the disk (their errors are no OSError)."""
    accelerator.prepare(Net())
    plan = plan_batch(1, global_batch_size=8)
    good = save_checkpoint(accelerator, tmp_path, at_step(5), plan=plan)
    no_space = filling_the_disk(FULL_DISK_ERRORS[writer], monkeypatch)
    monkeypatch.setattr(accelerator, "save_state", no_space)
    with pytest.raises(CheckpointError) as error:
        save_checkpoint(accelerator, tmp_path, at_step(10), plan=plan)
    assert str(error.value).startswith(
        f"no space left on device while saving step_10; the last complete checkpoint is {good}"
    )
    assert "\n" not in str(error.value) and "--resume latest" in str(error.value)
    monkeypatch.undo()
    assert list_checkpoints(tmp_path) == [good]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_5"]  # no .tmp
    assert load_checkpoint(accelerator, good, plan)[0].step == 5


@pytest.mark.parametrize("writer", ["python", "safetensors"])
def test_a_full_disk_during_an_export_keeps_the_export_before_it(writer, tmp_path, monkeypatch):
    target = tmp_path / "model"
    write_export(reference_state(), target, {"step": 1})
    before = {p.name: p.read_bytes() for p in target.iterdir()}

    def full(*_args, **_kwargs):
        raise FULL_DISK_ERRORS[writer]

    monkeypatch.setattr("accel_common.checkpoints.export.save_file", full)
    with pytest.raises(CheckpointError, match=r"^no space left on device while writing .*model"):
        write_export(reference_state(), target, {"step": 2})
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before  # no .tmp left either
