"""A resume reads a checkpoint folder as untrusted input: no pickle in it runs code, its manifest
vouches for every file, and an edited progress record is refused naming the file and field."""

from __future__ import annotations

import io
import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from accel_common.batch_lr.batching import plan_batch
from accel_common.batch_lr.lr import Schedule, build_scheduler
from accel_common.checkpoints.checkpoint import TrainProgress, load_checkpoint, save_checkpoint
from accel_common.checkpoints.checkpoint_files import (
    MANIFEST_FILE,
    check_dcp_folders,
    load_state_file,
)
from accel_common.errors import CheckpointError

PLAN = plan_batch(1, global_batch_size=8)
STEP = 5


def touch(marker: Path) -> None:
    marker.touch()


class Payload:
    """Unpickling this touches `marker`: proof that code from the file ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (touch, (self.marker,))


def payload_bytes(marker: Path) -> bytes:
    stream = io.BytesIO()
    torch.save({"state": Payload(marker)}, stream)
    return stream.getvalue()


def saved_checkpoint(accelerator, root: Path, progress: TrainProgress | None = None) -> Path:
    """A real checkpoint: model, AdamW, a registered LR scheduler, RNG, progress, manifest."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    scheduler = build_scheduler(optimizer, Schedule(total_steps=10, warmup_steps=0))
    accelerator.register_for_checkpointing(scheduler)
    optimizer.step()  # no gradients: nothing changes, but torch wants it before the scheduler
    for _ in range(STEP):
        scheduler.step()
    progress = progress or TrainProgress(step=STEP, samples_in_epoch=8 * STEP)
    return save_checkpoint(accelerator, root, progress, plan=PLAN)


def edit_progress(path: Path, edit) -> None:
    record = json.loads((path / "progress.json").read_text())
    edit(record["progress"])
    (path / "progress.json").write_text(json.dumps(record))


# ------------------------------------------------------------------------- no code runs


@pytest.mark.parametrize("manifest", ["kept", "removed"])
def test_a_payload_in_any_file_runs_nothing_and_the_refusal_names_the_file(
    tmp_path, accelerator, manifest
):
    """Every file of a checkpoint folder replaced in turn by a pickle with a `__reduce__`
    payload: nothing runs, and the one-line refusal names that file. With the manifest removed
    (as an attacker would) the loaders themselves refuse it."""
    path = saved_checkpoint(accelerator, tmp_path / "run")
    names = sorted(p.name for p in path.iterdir() if p.name != MANIFEST_FILE)
    assert {"custom_checkpoint_0.pkl", "random_states_0.pkl", "optimizer.bin"} <= set(names)
    for name in names:
        copy = tmp_path / name / "checkpoints" / path.name
        shutil.copytree(path, copy)
        marker = tmp_path / f"ran-{name}"
        (copy / name).write_bytes(payload_bytes(marker))
        if manifest == "removed":
            (copy / MANIFEST_FILE).unlink()
        with pytest.raises(CheckpointError) as refused:
            load_checkpoint(accelerator, copy, PLAN, allow_unverified=manifest == "removed")
        assert not marker.exists(), f"{name}: the payload ran"
        assert str(copy / name) in str(refused.value), str(refused.value)
        assert "\n" not in str(refused.value)


def test_the_loaders_name_the_refused_global(tmp_path):
    marker = tmp_path / "ran"
    (tmp_path / "state.pkl").write_bytes(payload_bytes(marker))
    with pytest.raises(CheckpointError, match=r"state\.pkl holds a pickled [\w.]*\.touch, which"):
        load_state_file(tmp_path / "state.pkl")
    assert not marker.exists()


@pytest.fixture(autouse=True)
def _quiet_single_process_dcp():
    import warnings

    with warnings.catch_warnings():  # DCP warns that it saves in one process: on purpose here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def dcp_folder(root: Path, name: str = "pytorch_model_fsdp_0") -> Path:
    """A torch.distributed.checkpoint folder as FSDP's sharded save writes one: tensors plus
    non-tensor entries (which DCP itself reads with full pickle)."""
    import torch.distributed.checkpoint as dcp

    folder = root / name
    state = {"model": {"weight": torch.ones(3)}, "extra": {"step": 3, "groups": [{"lr": 0.1}]}}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(folder), no_dist=True)
    return folder


def test_a_payload_in_a_sharded_checkpoint_runs_nothing(tmp_path):
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from accel_common.checkpoints.dcp_reader import read_dcp_metadata

    folder = dcp_folder(tmp_path / "ok")
    check_dcp_folders(folder.parent)  # an intact one passes

    # a non-tensor entry swapped for a payload of the same length, in place in its shard
    metadata = read_dcp_metadata(folder)
    key, info = next(
        (k, v)
        for k, v in metadata.storage_data.items()
        if isinstance(metadata.state_dict_metadata[k.fqn], BytesStorageMetadata)
    )
    marker = tmp_path / "ran"
    shard = folder / info.relative_path
    data = bytearray(shard.read_bytes())
    evil = payload_bytes(marker)
    data[info.offset : info.offset + info.length] = evil
    shard.write_bytes(bytes(data))
    metadata.storage_data[key].length = len(evil)
    for other in metadata.storage_data.values():  # entries behind it moved
        if other.relative_path == info.relative_path and other.offset > info.offset:
            other.offset += len(evil) - info.length
    import pickle

    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match=re.escape(f"{shard} (entry {key.fqn})")):
        check_dcp_folders(folder.parent)
    assert not marker.exists()

    # the index itself a payload
    other = dcp_folder(tmp_path / "index")
    (other / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(CheckpointError, match=r"\.metadata: the DCP index refers to [\w.]*touch"):
        check_dcp_folders(other.parent)
    assert not marker.exists()


def test_a_payload_in_a_sharded_index_stops_the_resume_before_anything_loads(tmp_path, accelerator):
    import pickle

    path = saved_checkpoint(accelerator, tmp_path / "run")
    (path / MANIFEST_FILE).unlink()
    folder = dcp_folder(path, "optimizer_0")  # as FSDP's sharded optimizer state
    marker = tmp_path / "ran"
    (folder / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(CheckpointError, match=re.escape(str(folder / ".metadata"))):
        load_checkpoint(accelerator, path, PLAN, allow_unverified=True)
    assert not marker.exists()


def test_a_sharded_checkpoint_resumed_without_sharding_is_named_as_such(tmp_path, accelerator):
    path = saved_checkpoint(accelerator, tmp_path / "run")
    (path / MANIFEST_FILE).unlink()
    dcp_folder(path)
    with pytest.raises(CheckpointError) as refused:
        load_checkpoint(accelerator, path, PLAN, allow_unverified=True)
    message = str(refused.value)
    assert f"{path} is an intact FSDP-sharded checkpoint" in message
    assert f"accel-recipes convert {path} OUT" in message
    assert "corrupt" not in message


# ------------------------------------------------------------------------- RNG: never skipped


def test_an_rng_state_the_safe_loader_cannot_read_stops_the_resume(tmp_path, accelerator):
    """Accelerate logs 'Could not load random states' at info level and resumes without them;
    here the resume stops, naming the file: truncated, missing, or holding another object."""
    import fractions

    path = saved_checkpoint(accelerator, tmp_path / "run")
    (path / MANIFEST_FILE).unlink()  # unverified: the loaders refuse
    rng = path / "random_states_0.pkl"
    intact = rng.read_bytes()
    rng.write_bytes(intact[:20])
    with pytest.raises(CheckpointError, match=r"random_states_0\.pkl is corrupt or truncated"):
        load_checkpoint(accelerator, path, PLAN, allow_unverified=True)
    torch.save({"random_state": fractions.Fraction(1, 3)}, rng)
    with pytest.raises(CheckpointError, match=r"random_states_0\.pkl holds a pickled"):
        load_checkpoint(accelerator, path, PLAN, allow_unverified=True)
    torch.save({"step": 0}, rng)
    with pytest.raises(CheckpointError, match=r"random_states_0\.pkl lacks random_state"):
        load_checkpoint(accelerator, path, PLAN, allow_unverified=True)
    rng.unlink()
    with pytest.raises(CheckpointError, match=r"random_states_0\.pkl is missing"):
        load_checkpoint(accelerator, path, PLAN, allow_unverified=True)
    rng.write_bytes(intact)
    load_checkpoint(accelerator, path, PLAN, allow_unverified=True)


def test_the_rng_state_is_restored_exactly(tmp_path, accelerator):
    path = saved_checkpoint(accelerator, tmp_path / "run")
    expected = torch.rand(3)  # the draw right after the save
    torch.manual_seed(123)
    load_checkpoint(accelerator, path, PLAN)
    assert torch.equal(torch.rand(3), expected)


# ------------------------------------------------------------------------- the manifest


def test_the_manifest_names_a_changed_missing_or_added_file(tmp_path, accelerator):
    path = saved_checkpoint(accelerator, tmp_path / "run")
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    assert set(manifest["files"]) == {p.name for p in path.iterdir()} - {MANIFEST_FILE}
    load_checkpoint(accelerator, path, PLAN)  # intact: loads

    optimizer = path / "optimizer.bin"
    intact = optimizer.read_bytes()
    flipped = bytearray(intact)
    flipped[len(flipped) // 2] ^= 0xFF  # same size, other contents
    optimizer.write_bytes(bytes(flipped))
    changed = r"optimizer\.bin is corrupt or was changed after the save: its contents differ"
    with pytest.raises(CheckpointError, match=changed):
        load_checkpoint(accelerator, path, PLAN)
    optimizer.write_bytes(intact[:-10])
    truncated = r"optimizer\.bin is truncated or was changed .* holds \d+ bytes, \d+ when saved"
    with pytest.raises(CheckpointError, match=truncated):
        load_checkpoint(accelerator, path, PLAN)
    optimizer.unlink()
    with pytest.raises(CheckpointError, match=r"optimizer\.bin is missing \(manifest\.json"):
        load_checkpoint(accelerator, path, PLAN)
    optimizer.write_bytes(intact)
    (path / "custom_checkpoint_1.pkl").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"custom_checkpoint_1\.pkl is not one of the files"):
        load_checkpoint(accelerator, path, PLAN)
    (path / "custom_checkpoint_1.pkl").unlink()
    (path / MANIFEST_FILE).write_text("{")
    with pytest.raises(CheckpointError, match=r"manifest\.json is unreadable or was edited"):
        load_checkpoint(accelerator, path, PLAN)


def test_a_link_or_special_file_in_a_checkpoint_is_named_as_such(tmp_path, accelerator):
    path = saved_checkpoint(accelerator, tmp_path / "run")
    (path / "optimizer.bin").unlink()
    (path / "optimizer.bin").symlink_to("/dev/zero")
    with pytest.raises(CheckpointError, match=r"optimizer\.bin is a symbolic link"):
        load_checkpoint(accelerator, path, PLAN)


# the fault-injection pass's edits of progress.json, each once with the manifest kept (the edit
# differs from the save's record) and once removed (the record contradicts itself)
EDITS = {
    "step 25 in step_5": (lambda p: p.update(step=25), "(step is 25|at step 25)"),
    "epoch -1": (lambda p: p.update(epoch=-1), "epoch is -1"),
    "negative loss count": (
        lambda p: p["loss_sums"]["epoch"].update(counts=[-3.0]),
        r"loss_sums\.epoch\.counts(\[0\] is -3\.0| holds -3\.0)",
    ),
    "NaN loss sum": (lambda p: p["loss_sums"]["window"].update(sums=[math.nan]), "sums"),
    "huge loss sum": (lambda p: p["loss_sums"]["window"].update(sums=[math.inf]), "sums"),
    "samples_in_epoch": (lambda p: p.update(samples_in_epoch=20), "samples_in_epoch"),
    "fractional step": (lambda p: p.update(step=5.5), "step is 5.5"),
}


@pytest.mark.parametrize("manifest", ["kept", "removed"])
@pytest.mark.parametrize("edit", list(EDITS))
def test_an_edited_progress_record_is_refused_naming_the_field(
    tmp_path, accelerator, edit, manifest
):
    sums = {"sums": [1.0], "counts": [2.0]}
    progress = TrainProgress(
        step=STEP,
        samples_in_epoch=8 * STEP,
        loss_sums={"window": sums, "epoch": dict(sums), "last_epoch": None},
    )
    path = saved_checkpoint(accelerator, tmp_path / "run", progress)
    change, field = EDITS[edit]
    edit_progress(path, change)
    if manifest == "removed":
        (path / MANIFEST_FILE).unlink()
    with pytest.raises(CheckpointError) as refused:
        load_checkpoint(accelerator, path, PLAN, allow_unverified=manifest == "removed")
    message = str(refused.value)
    assert str(path / "progress.json") in message
    assert re.search(field, message), message
    assert "the original number of processes" not in message  # an edit, not a launch change


def test_a_step_edited_with_its_folder_is_caught_by_the_scheduler(tmp_path, accelerator):
    """Folder renamed and progress.json edited alike, manifest removed: the LR scheduler's own
    count (another file) still says step 5."""
    path = saved_checkpoint(accelerator, tmp_path / "run")
    (path / MANIFEST_FILE).unlink()
    edit_progress(path, lambda p: p.update(step=25, samples_in_epoch=8 * 25))  # adds up
    moved = path.rename(path.with_name("step_25"))
    with pytest.raises(CheckpointError, match=r"custom_checkpoint_0\.pkl: the LR scheduler is at"):
        load_checkpoint(accelerator, moved, PLAN, allow_unverified=True)


@pytest.mark.parametrize("saved", ["with a manifest", "before manifests"])
def test_a_checkpoint_without_its_manifest_resumes_only_when_allowed(
    tmp_path, accelerator, capsys, saved
):
    """Deleting manifest.json no longer turns verification off: refused in one line that says
    what is not checked (and, where progress.json says the save wrote one, that it was
    removed), unless --allow-unverified, which resumes with one warning."""
    path = saved_checkpoint(accelerator, tmp_path / "run")
    (path / MANIFEST_FILE).unlink()
    if saved == "before manifests":  # progress.json as versions before manifests wrote it
        record = json.loads((path / "progress.json").read_text())
        del record["manifest_format"]
        (path / "progress.json").write_text(json.dumps(record))
    why = {
        "with a manifest": f"{path / MANIFEST_FILE} is missing, though progress.json says its "
        "save wrote one (it was removed)",
        "before manifests": f"{path} has no {MANIFEST_FILE} (saved before checkpoints carried "
        "one, or it was removed)",
    }[saved]
    with pytest.raises(CheckpointError) as refused:
        load_checkpoint(accelerator, path, PLAN)
    message = str(refused.value)
    assert message.startswith(why) and "\n" not in message, message
    assert "--allow-unverified" in message and "is not checked" in message
    progress, _ = load_checkpoint(accelerator, path, PLAN, allow_unverified=True)
    assert progress.step == STEP
    assert capsys.readouterr().err.count(f"warning: {why}; --allow-unverified") == 1


def test_the_manifest_benchmark_runs_and_writes_its_section(tmp_path):
    """`make bench`'s manifest cost, at the smoke size: it runs and writes its own section."""
    import subprocess
    import sys

    out = tmp_path / "BENCHMARKS.md"
    out.write_text("# Benchmarks\n\nkept\n")
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_checkpoint_manifest.py"
    done = subprocess.run(
        [sys.executable, str(script), "--smoke", "--repeats", "1", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    text = out.read_text()
    assert "kept" in text and "## Checkpoint manifest" in text
    assert re.search(r"`write_manifest` \(at save\) \| \d+\.\d+ \| \d+\.\d+", text)


@pytest.mark.dist
def test_a_payload_in_one_ranks_file_stops_every_rank_and_runs_nothing(tmp_path):
    """2 gloo processes: rank 1's RNG file (read by rank 1 only) holds a payload, the manifest
    removed. Both ranks refuse in one line, neither hangs in a collective, nothing runs."""
    from tests.processes import run_recipe

    args = ["--epochs", "2", "--bs", "64", "--save-every", "8", "--max-steps", "8"]
    run_recipe([*args, "--output-dir", "run"], cwd=tmp_path, nproc=2)
    path = tmp_path / "run" / "checkpoints" / "step_8"
    marker = tmp_path / "ran"
    (path / "random_states_1.pkl").write_bytes(payload_bytes(marker))
    (path / MANIFEST_FILE).unlink()
    args[-1] = "16"
    resume = ["--output-dir", "run", "--resume", "latest", "--allow-unverified"]
    result = run_recipe([*args, *resume], cwd=tmp_path, nproc=2, check=False)
    assert result.returncode != 0
    assert not marker.exists()
    output = result.stdout + result.stderr
    assert "random_states_1.pkl holds a pickled" in output, output[-3000:]
    assert "Traceback" not in output


def test_a_fifo_in_a_checkpoint_is_named_as_one_without_reading_it(tmp_path, accelerator):
    import os

    path = saved_checkpoint(accelerator, tmp_path / "run")
    (path / "optimizer.bin").unlink()
    os.mkfifo(path / "optimizer.bin")
    with pytest.raises(CheckpointError, match=r"optimizer\.bin is a FIFO \(named pipe\)"):
        load_checkpoint(accelerator, path, PLAN)
    (path / MANIFEST_FILE).unlink()  # unverified: refused all the same, never opened
    with pytest.raises(CheckpointError, match=r"optimizer\.bin is a FIFO \(named pipe\)"):
        load_checkpoint(accelerator, path, PLAN, allow_unverified=True)
