"""A checkpoint folder vouches for itself, round five: a forged position that its own arithmetic
contradicts, a `step_N` no save wrote (a link, an empty folder), an unfinished save named by
--resume, a file the manifest does not list (convert as well as resume), nested JSON and pickled
payloads: each refused in one line before anything trains or is exported, nothing the user
named deleted."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from accel_common.batch_lr.batching import plan_batch
from accel_common.checkpoints.checkpoint import TrainProgress, load_checkpoint, save_checkpoint
from accel_common.checkpoints.checkpoint_files import MANIFEST_FILE, load_state_file
from accel_common.checkpoints.progress import position_problem
from accel_common.conversion.convert import convert_checkpoint
from accel_common.errors import CheckpointError
from tests.checkpoints.test_checkpoint import Net, at_step
from tests.checkpoints.test_checkpoint_safety import PLAN, Payload
from tests.training.test_loop import run, train  # noqa: F401 (run: a fixture)


def forge(checkpoint: Path, edit) -> None:
    """Edit progress.json's progress record and rewrite its manifest to match, as an attacker
    who knows the format would: only the record's own arithmetic can tell."""
    progress_file = checkpoint / "progress.json"
    record = json.loads(progress_file.read_text())
    edit(record["progress"])
    progress_file.write_text(json.dumps(record))
    manifest = json.loads((checkpoint / MANIFEST_FILE).read_text())
    manifest["progress"]["progress"] = record["progress"]
    data = progress_file.read_bytes()
    manifest["files"]["progress.json"] = {
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    (checkpoint / MANIFEST_FILE).write_text(json.dumps(manifest))


# ------------------------------------------------------------------- the position's arithmetic


def test_a_run_records_each_epochs_samples(run, tmp_path):  # noqa: F811
    """The fixture's toy run: epochs of 10 micro-batches of 2 samples, 2 per optimizer step. The
    record at step 8 says one finished epoch of 20 samples and 12 samples into the second."""
    accelerator, model, optimizer, loop, _ = run()
    train(accelerator, model, optimizer, loop)
    record = json.loads((tmp_path / "checkpoints" / "step_8" / "progress.json").read_text())
    progress = record["progress"]
    assert (progress["epoch"], progress["samples_in_epoch"]) == (1, 12)
    assert progress["epoch_samples"] == [[20, 2, 1]]
    assert record["manifest_format"] == 1


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        ({"samples_in_epoch": 0}, "samples_in_epoch is 0 at step 8"),  # replays 3 steps' data
        ({"samples_in_epoch": 16}, "samples_in_epoch is 16 at step 8"),  # skips one step's
        ({"epoch": 0, "epoch_samples": []}, "samples_in_epoch is 12 at step 8"),
        ({"epoch_samples": [[16, 2, 1]]}, "samples_in_epoch is 12 at step 8"),
        ({"epoch": 2}, "epoch is 2, while epoch_samples records 1 finished epochs"),
        ({"epoch_samples": None}, r"epoch_samples is missing \(saved before version 0.2.0"),
        ({"epoch_samples": [[20, 2, 0]]}, "epoch_samples is"),
        ({"epoch_samples": [[21, 2, 1]]}, "epoch_samples is"),  # not whole rounds
        ({"epoch_samples": "5"}, "epoch_samples is"),
    ],
)
def test_a_forged_position_is_refused_naming_the_field(run, tmp_path, edit, field):  # noqa: F811
    accelerator, model, optimizer, loop, _ = run()
    train(accelerator, model, optimizer, loop)
    checkpoint = tmp_path / "checkpoints" / "step_8"
    forge(checkpoint, lambda progress: progress.update(edit))
    with pytest.raises(CheckpointError) as refused:
        run(resume=str(checkpoint), overwrite_later=True)
    message = str(refused.value)
    assert re.match(re.escape(f"{checkpoint / 'progress.json'}: ") + field, message), message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("edit", "refusal"),
    [  # each adds up to step 8's 32 samples, but no pass over this data reaches it
        ({"epoch": 0, "epoch_samples": [], "samples_in_epoch": 32}, "samples_in_epoch 32 is past"),
        (
            {"epoch": 2, "epoch_samples": [[16, 2, 2]], "samples_in_epoch": 0},  # skips epoch 1
            "epoch_samples records an epoch of 16 samples in rounds of 2, while an epoch of this "
            "data is 20",
        ),
        ({"epoch_samples": [[24, 2, 1]], "samples_in_epoch": 8}, "an epoch of 24 samples"),
    ],
)
def test_a_position_no_pass_over_the_data_reaches_is_refused(run, tmp_path, edit, refusal):  # noqa: F811
    accelerator, model, optimizer, loop, _ = run()
    train(accelerator, model, optimizer, loop)
    checkpoint = tmp_path / "checkpoints" / "step_8"
    forge(checkpoint, lambda progress: progress.update(edit))
    accelerator, model, optimizer, loop, _ = run(resume=str(checkpoint), overwrite_later=True)
    with pytest.raises(CheckpointError, match=refusal) as refused:
        train(accelerator, model, optimizer, loop)
    assert loop.step == 8 and "\n" not in str(refused.value)


def test_finish_epoch_records_each_epochs_samples_and_the_arithmetic_holds_at_every_step():
    """Windows of 3 micro-batches of 2 samples carry across epochs of 16 micro-batches (no
    window is closed early), so an epoch's first step may take a micro-batch of the epoch
    before; after a change to 2 processes (same global batch) epochs are 18 samples long."""
    one = plan_batch(1, per_device_batch_size=2, grad_accum_steps=3)
    progress, seen = TrainProgress(epoch_samples=[]), 0
    for plan, micro_batches in ((one, 16), (one, 16), (one, 16)):
        for _ in range(micro_batches):
            progress.samples_in_epoch += 2
            seen += 2
            if seen % 6 == 0:  # a step: where a save records the position
                progress.step += 1
                assert position_problem(progress, plan) is None, progress
        progress.finish_epoch(plan)
    assert progress.epoch_samples == [[32, 2, 3]] and progress.epoch == 3
    assert progress.data_problem(32, one) is None
    assert "an epoch of 32 samples" in progress.data_problem(34, one)
    two = plan_batch(2, per_device_batch_size=3, grad_accum_steps=1)  # rounds of 6, the same 6
    assert progress.data_problem(36, two) is None  # padded by less than a round either way
    assert "an epoch of 32 samples" in progress.data_problem(42, two)
    progress.epoch_samples = [[36, 12, 1]]  # rounds of 12 do not divide the global batch of 6
    assert "an epoch of 36 samples in rounds of 12" in progress.data_problem(36, two)
    unrecorded = TrainProgress(step=3, samples_in_epoch=0, epoch_samples=None)  # an older save
    assert position_problem(unrecorded, one) is None


# ------------------------------------------------------------------- step folders no save wrote


def test_resume_of_an_unfinished_save_keeps_it(run, tmp_path):  # noqa: F811
    accelerator, model, optimizer, loop, _ = run()
    train(accelerator, model, optimizer, loop)
    unfinished = tmp_path / "checkpoints" / "step_16.tmp"
    shutil.copytree(tmp_path / "checkpoints" / "step_8", unfinished)
    with pytest.raises(CheckpointError, match=r"step_16\.tmp: an unfinished save .* kept as it is"):
        run(resume=str(unfinished))
    assert (unfinished / "progress.json").is_file()


@pytest.mark.parametrize("kind", ["empty folder", "folder without progress.json", "file"])
def test_a_step_folder_no_save_wrote_is_refused_and_kept(run, tmp_path, kind):  # noqa: F811
    """An empty step_20/ used to be passed over by --resume latest (which then advised
    --resume latest) and deleted by the run's save at step 20."""
    accelerator, model, optimizer, loop, _ = run()
    train(accelerator, model, optimizer, loop)
    odd = tmp_path / "checkpoints" / "step_20"
    if kind == "file":
        odd.write_text("kept")
    else:
        odd.mkdir()
        if kind != "empty folder":
            (odd / "model.safetensors").write_text("kept")
    for resume in ("latest", None):  # a fresh run into the folder too
        with pytest.raises(CheckpointError) as refused:
            run(resume=resume)
        message = str(refused.value)
        assert message.startswith(f"{odd} is "), message
        assert "move it out of" in message and "--resume latest" not in message
    assert odd.exists()


def test_a_linked_step_folder_is_refused_before_training_and_its_target_kept(run, tmp_path):  # noqa: F811
    """A step_N that is a symbolic link: training used to finish, then pruning crashed on it
    (rmtree on a link), leaving the previous run's export in model/."""
    accelerator, model, optimizer, loop, _ = run(out=tmp_path / "out")
    train(accelerator, model, optimizer, loop)
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(tmp_path / "out" / "checkpoints" / "step_8", elsewhere)
    link = tmp_path / "out" / "checkpoints" / "step_2"
    link.symlink_to(elsewhere, target_is_directory=True)
    before = sorted(p.name for p in elsewhere.iterdir())
    with pytest.raises(CheckpointError, match=rf"^{link} is a symbolic link to {elsewhere}"):
        run(resume="latest", out=tmp_path / "out")
    assert link.is_symlink() and sorted(p.name for p in elsewhere.iterdir()) == before


def test_a_linked_unfinished_save_is_removed_without_following_it(run, tmp_path):  # noqa: F811
    """A step_N.tmp link: the next save would write through it into the folder it names."""
    accelerator, model, optimizer, loop, _ = run(out=tmp_path / "out", save_every=0)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "mine.txt").write_text("kept")
    link = tmp_path / "out" / "checkpoints" / "step_4.tmp"
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(elsewhere, target_is_directory=True)
    accelerator, model, optimizer, loop, _ = run(out=tmp_path / "out", resume="latest")
    train(accelerator, model, optimizer, loop)
    assert not link.is_symlink()
    assert [p.name for p in elsewhere.iterdir()] == ["mine.txt"]


# ------------------------------------------------------------------- files the manifest vouches for


def saved_folder(accelerator, root: Path) -> Path:
    accelerator.prepare(Net())
    return save_checkpoint(accelerator, root, at_step(1), plan=PLAN)


def test_convert_refuses_a_file_the_manifest_does_not_list(tmp_path, accelerator):
    """The fault-injection case: a tied.json added after the save made convert export a tensor
    the model does not have, exit 0."""
    path = saved_folder(accelerator, tmp_path / "run")
    tied = {"models": {"0": [["net.0.bias", "bogus.weight"]]}}
    (path / "tied.json").write_text(json.dumps(tied))
    for source in (path, path / "model.safetensors"):
        with pytest.raises(CheckpointError) as refused:
            convert_checkpoint(source, tmp_path / "out")
        assert str(refused.value).startswith(f"{path / 'tied.json'} is not one of the files")
    with pytest.raises(CheckpointError, match=r"tied\.json is not one of the files"):
        load_checkpoint(accelerator, path, PLAN)
    assert not (tmp_path / "out").exists()


def test_convert_refuses_a_checkpoint_without_its_manifest_unless_allowed(tmp_path, accelerator):
    path = saved_folder(accelerator, tmp_path / "run")
    (path / MANIFEST_FILE).unlink()
    with pytest.raises(CheckpointError, match=r"manifest\.json is missing, though progress\.json"):
        convert_checkpoint(path, tmp_path / "out")
    converted = convert_checkpoint(path, tmp_path / "out", allow_unverified=True)
    assert set(load_file(str(converted))) == set(Net().state_dict())


def test_convert_checks_the_hashes_of_a_checkpoint(tmp_path, accelerator):
    path = saved_folder(accelerator, tmp_path / "run")
    weights = path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one bit of one weight: same size
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.safetensors is corrupt or was changed"):
        convert_checkpoint(path, tmp_path / "out")


def test_a_foreign_accelerate_folder_converts_without_a_manifest(tmp_path):
    """Another tool's save_state folder has no manifest, and nothing of ours: converted as is."""
    folder = tmp_path / "foreign"
    folder.mkdir()
    torch.save(Net().state_dict(), folder / "pytorch_model.bin")
    converted = convert_checkpoint(folder, tmp_path / "out")
    assert set(load_file(str(converted))) == set(Net().state_dict())


@pytest.mark.parametrize("name", [MANIFEST_FILE, "progress.json", "tied.json"])
def test_deeply_nested_json_is_one_line(tmp_path, accelerator, name):
    path = saved_folder(accelerator, tmp_path / "run")
    (path / name).write_text("[" * 200_000 + "]" * 200_000)
    if name == "tied.json":
        (path / MANIFEST_FILE).unlink()  # as unverified: the reader itself must not crash
        with pytest.raises(CheckpointError, match=r"tied\.json is unreadable \(RecursionError"):
            convert_checkpoint(path, tmp_path / "out", allow_unverified=True)
        return
    with pytest.raises(CheckpointError) as refused:
        load_checkpoint(accelerator, path, PLAN)
    assert str(refused.value).startswith(str(path / name)), str(refused.value)
    assert "RecursionError" in str(refused.value)


# ------------------------------------------------------------------- pickled payloads


@pytest.mark.parametrize("name", ["random_states_0.pkl", "custom_checkpoint_0.pkl", "p.pt"])
def test_a_plain_pickle_payload_is_named_and_torchs_advice_never_printed(tmp_path, name):
    """A pickle.dump'ed payload (not torch.save's archive) used to be "corrupt or truncated",
    quoting torch's advice to retry with weights_only=False."""
    marker = tmp_path / "ran"
    (tmp_path / name).write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(CheckpointError) as refused:
        load_state_file(tmp_path / name)
    message = str(refused.value)
    assert message.startswith(
        f"{tmp_path / name} holds a pickled tests.checkpoints.test_checkpoint_safety."
    )
    assert "weights_only" not in message and "likely succeed" not in message
    assert not marker.exists()


def test_a_damaged_pickle_never_quotes_torchs_advice(tmp_path):
    (tmp_path / "state.pkl").write_bytes(pickle.dumps({"a": 1}, protocol=4)[:-3])
    with pytest.raises(CheckpointError) as refused:
        load_state_file(tmp_path / "state.pkl")
    message = str(refused.value)
    assert "is corrupt or truncated" in message
    assert "weights_only" not in message and "likely succeed" not in message


def test_convert_names_the_global_of_a_plain_pickle(tmp_path):
    marker = tmp_path / "ran"
    (tmp_path / "weights.pt").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(
        CheckpointError, match=r"holds a pickled tests\.checkpoints\.test_checkpoint_safety\."
    ):
        convert_checkpoint(tmp_path / "weights.pt", tmp_path / "out")
    assert not marker.exists() and not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("name", ["checkpoints", "model", "best", "logs"])
def test_a_linked_folder_in_the_output_dir_is_refused_before_training(run, tmp_path, name):  # noqa: F811
    """OUTPUT/model linked to a folder elsewhere: the export would replace the files there, a
    linked checkpoints/ would be saved into and pruned. A run writes only inside OUTPUT."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "model.safetensors").write_text("theirs")
    out = tmp_path / "out"
    out.mkdir()
    (out / name).symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(CheckpointError) as refused:
        run(out=out)
    message = str(refused.value)
    assert message.startswith(f"{out / name} is a symbolic link (to {elsewhere})"), message
    assert [p.name for p in elsewhere.iterdir()] == ["model.safetensors"]
    assert (elsewhere / "model.safetensors").read_text() == "theirs"


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero"])
def test_convert_never_reads_a_progress_record_that_is_no_file(tmp_path, accelerator, kind):
    """A FIFO would block convert forever, a link to /dev/zero read without end."""
    path = saved_folder(accelerator, tmp_path / "run")
    (path / "progress.json").unlink()
    if kind == "fifo":
        os.mkfifo(path / "progress.json")
    else:
        (path / "progress.json").symlink_to("/dev/zero")
    with pytest.raises(CheckpointError, match=r"progress\.json is (a FIFO|a symbolic link)"):
        convert_checkpoint(path, tmp_path / "out")


def test_convert_of_a_fifo_is_one_line_without_reading_it(tmp_path):
    os.mkfifo(tmp_path / "weights.safetensors")
    with pytest.raises(CheckpointError, match=r"weights\.safetensors is a FIFO \(named pipe\)"):
        convert_checkpoint(tmp_path / "weights.safetensors", tmp_path / "out")


def test_convert_into_its_own_checkpoint_is_refused(tmp_path, accelerator):
    path = saved_folder(accelerator, tmp_path / "run")
    with pytest.raises(CheckpointError, match=r"is inside the checkpoint"):
        convert_checkpoint(path, path / "out")
    with pytest.raises(CheckpointError, match=r"is inside the checkpoint"):  # from one of its files
        convert_checkpoint(path / "model.safetensors", path / "out.safetensors")
    assert sorted(p.name for p in path.iterdir() if "out" in p.name) == []


def test_a_checkpoints_entry_that_is_a_file_is_refused_before_training(run, tmp_path):  # noqa: F811
    """It used to train from step 0, then fail at the first save advising --resume latest."""
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "checkpoints").write_text("kept")
    with pytest.raises(CheckpointError, match=r"checkpoints is not a folder"):
        run(out=tmp_path / "out", resume="latest")
    assert (tmp_path / "out" / "checkpoints").read_text() == "kept"


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        (lambda m: m.update(files=[]), r"TypeError: 'files' is no record of files"),
        (
            lambda m: m["files"]["model.safetensors"].update(size="7133"),
            r"TypeError: the entry of model\.safetensors is no size and SHA-256",
        ),
    ],
)
def test_a_malformed_manifest_names_what_is_wrong(tmp_path, accelerator, edit, reason):
    path = saved_folder(accelerator, tmp_path / "run")
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    edit(manifest)
    (path / MANIFEST_FILE).write_text(json.dumps(manifest))
    unreadable = rf"manifest\.json is unreadable or was edited \({reason}"
    with pytest.raises(CheckpointError, match=unreadable):
        load_checkpoint(accelerator, path, PLAN)


@pytest.mark.parametrize("broken", ["a link to a file elsewhere", "no safetensors"])
def test_a_finished_runs_broken_export_is_written_again(run, tmp_path, broken):  # noqa: F811
    """It used to be reported as 'unchanged' (a link to a text file, 8 bytes of garbage)."""
    accelerator, model, optimizer, loop, _ = run()
    train(accelerator, model, optimizer, loop)
    loop.finish(model)
    weights = tmp_path / "model" / "model.safetensors"
    intact = weights.read_bytes()
    weights.unlink()
    elsewhere = tmp_path.parent / f"{tmp_path.name}-theirs.txt"
    elsewhere.write_text("theirs")
    if broken == "no safetensors":
        weights.write_bytes(b"garbage!")
    else:
        weights.symlink_to(elsewhere)
    accelerator, model, optimizer, loop, _ = run(resume="latest")
    assert loop.run.finished_export is None  # not taken for the finished run's export
    train(accelerator, model, optimizer, loop)
    loop.finish(model)
    assert not weights.is_symlink() and weights.read_bytes() == intact
    assert elsewhere.read_text() == "theirs"
