"""TrainLoop's bookkeeping, tested once for every recipe, and the exact item-weighted loss."""

from __future__ import annotations

import errno
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState
from torch import nn
from torch.utils.data import Dataset

from accel_common.batch_lr.batching import BatchRequest
from accel_common.batch_lr.lr import Decay, LRSettings, make_lr_schedule
from accel_common.checkpoints.checkpoint import list_checkpoints
from accel_common.data.loaders import make_train_loader
from accel_common.errors import CheckpointError, ConfigError, NonFiniteError
from accel_common.hardware.accelerator import make_accelerator
from accel_common.monitoring.tracking import RunningMean
from accel_common.training.loop import TrainLoop
from accel_common.training.policy import EarlyStopping, LoopPolicy, SavePolicy
from accel_common.training.run import Run, RunConfig, StartRequest
from tests.processes import REPO, run_recipe
from tests.results import exported_params, max_relative_difference
from tests.scaler_check import check_a_best_epoch_export_counts_skipped_steps

EXAMPLE = REPO / "examples" / "plain_argparse.py"


class EpochAwareData(Dataset):
    """20 samples of (x, y) whose x depends on the epoch; remembers the epochs it was told."""

    def __init__(self) -> None:
        self.epoch, self.epochs_seen = 0, []

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.epochs_seen.append(epoch)

    def __len__(self) -> int:
        return 20

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.full((3,), float(index + 100 * self.epoch)), torch.ones(1)


@pytest.fixture
def run(tmp_path):
    """A 1-process run: 20 samples, 2 per micro-batch, 2 micro-batches per optimizer step, so an
    epoch is 10 micro-batches = 5 optimizer steps, and 3 epochs' budget is cut to 12 steps."""

    def start(
        resume: str | None = None,
        max_steps: int = 12,
        save_every: int = 4,
        out: Path = tmp_path,
        config: dict | None = None,
        overwrite: bool = False,
        overwrite_later: bool = False,
        allow_unverified: bool = False,
        log_every: int = 1,
        eval_every: int = 0,
        epochs: int = 3,
        replacement: bool = False,
        **loop_options,
    ):
        AcceleratorState._reset_state(reset_partial_state=True)
        accelerator, plan = make_accelerator(
            output_dir=out,
            batch=BatchRequest(per_device_batch_size=2, grad_accum_steps=2),
            cpu=True,
        )
        data = EpochAwareData()
        model = nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        loader = make_train_loader(data, plan.per_device_batch_size, replacement=replacement)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        schedule = make_lr_schedule(
            accelerator, optimizer, plan, LRSettings(1e-3, ref_bs=4, decay=Decay.constant),
            steps_per_epoch=len(loader), epochs=epochs, max_steps=max_steps,
        )  # fmt: skip
        loop = open_loop(
            accelerator, plan, loader, schedule, RunConfig(
                "toy", config or {"lr": 1e-3}, adjustable=frozenset({"lr"})
            ), out, StartRequest(resume, overwrite, overwrite_later, allow_unverified),
            SavePolicy(log_every, save_every, 10, eval_every),
            **loop_options,
        )  # fmt: skip
        return accelerator, model, optimizer, loop, data

    yield start
    AcceleratorState._reset_state(reset_partial_state=True)


def open_loop(
    accelerator, plan, loader, schedule, config, out, start, saves, clip_grad=0.0, **stopping
) -> TrainLoop:
    """The run and its loop, as SharedSettings.make_loop opens them."""
    policy = LoopPolicy(saves, clip_grad, early_stopping=EarlyStopping(**stopping))
    run = Run.open(
        accelerator, plan, schedule, config, output_dir=out, start=start,
        monitored=bool(stopping.get("monitor")),
    )  # fmt: skip
    return TrainLoop(accelerator, plan, loader, schedule, run, policy)


def train(
    accelerator, model, optimizer, loop, metrics=lambda epoch: {"epoch": float(epoch)}
) -> tuple[list[int], list[float], list[int]]:
    """The recipes' loop, evaluating `metrics(epoch)`; returns the epoch numbers, first x of each
    batch, and the LR steps."""
    epochs, firsts, lr_steps = [], [], []
    for epoch in loop.epochs():
        epochs.append(epoch)
        for x, y in loop.batches():
            with accelerator.accumulate(model):
                loss = (model(x / 1000) - y).pow(2).mean()
                accelerator.backward(loss)
                loop.clip_gradients(model)
                optimizer.step()
                optimizer.zero_grad()
            loop.record(loss)
            firsts.append(x[0, 0].item())
            lr_steps.append(loop.scheduler.last_epoch)
        loop.end_epoch(metrics(epoch))
    return epochs, firsts, lr_steps


def test_counts_optimizer_steps_across_epoch_ends_and_stops_mid_epoch(run, tmp_path: Path):
    accelerator, model, optimizer, loop, data = run()
    epochs, firsts, lr_steps = train(accelerator, model, optimizer, loop)
    assert epochs == [1, 2, 3]
    assert len(firsts) == 24  # 12 optimizer steps x 2 micro-batches, over epoch ends
    assert list(dict.fromkeys(data.epochs_seen)) == [0, 1, 2]  # the loop tells the dataset
    assert [f // 100 for f in firsts] == [0] * 10 + [1] * 10 + [2] * 4
    # the scheduler steps once per optimizer step: after micro-batch k it has stepped k // 2 times
    # (the record for micro-batch k is taken before the loop's bookkeeping for it)
    assert lr_steps == [k // 2 for k in range(24)]
    assert loop.step == 12 and loop.done
    assert (loop.progress.epoch, loop.progress.samples_in_epoch) == (2, 8)  # unfinished epoch
    # saves every 4 optimizer steps, except at the end, which finish() saves
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_4", "step_8"]
    metrics = loop.finish(model)
    assert metrics["epoch"] == 3.0 and metrics["train_seconds"] > 0
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_4", "step_8", "step_12"]
    assert (tmp_path / "model" / "model.safetensors").is_file()


def test_resume_mid_epoch_skips_what_was_trained_and_ends_in_the_same_place(run, tmp_path):
    accelerator, model, optimizer, loop, _ = run()
    _, uninterrupted, _ = train(accelerator, model, optimizer, loop)
    accelerator, model, optimizer, loop, data = run(resume=str(tmp_path / "checkpoints/step_8"))
    assert (loop.step, loop.progress.epoch, loop.progress.samples_in_epoch) == (8, 1, 12)
    epochs, resumed, _ = train(accelerator, model, optimizer, loop)
    assert epochs == [2, 3] and list(dict.fromkeys(data.epochs_seen)) == [1, 2]
    assert resumed == uninterrupted[16:]  # the remaining micro-batches, in the same order


def test_a_finished_run_resumed_leaves_its_export_as_it_was(run, tmp_path, capsys):
    """Issue 27: resuming a finished run rewrote its model.json with `train_loss: NaN` (not
    JSON), `train_seconds: 0.0` and the resuming launch's process count."""
    accelerator, model, optimizer, loop, _ = run()
    train(accelerator, model, optimizer, loop)
    loop.finish(model)
    export = tmp_path / "model"
    before = {name: (export / name).read_bytes() for name in ("model.json", "model.safetensors")}
    capsys.readouterr()
    accelerator, model, optimizer, loop, _ = run(resume="latest")
    epochs, firsts, _ = train(accelerator, model, optimizer, loop)
    assert (epochs, firsts) == ([], [])  # nothing to train or evaluate
    metrics = loop.finish(model)
    printed = capsys.readouterr().out
    assert f"the run in {tmp_path} already finished at step 12; its export in {export} is " in (
        printed
    )
    assert "train_loss nan" not in printed
    assert {name: (export / name).read_bytes() for name in before} == before
    assert metrics == json.loads(before["model.json"])["metrics"]
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_4", "step_8", "step_12"]


def test_a_finished_run_without_its_export_is_evaluated_and_exported_again(run, tmp_path, capsys):
    """A run killed between its final save and its export: the resume evaluates once more and
    exports, with the training loss of the run's last epoch (kept in the final checkpoint)."""
    accelerator, model, optimizer, loop, _ = run()
    train(accelerator, model, optimizer, loop)
    expected = loop.finish(model)
    shutil.rmtree(tmp_path / "model")
    capsys.readouterr()
    accelerator, model, optimizer, loop, _ = run(resume="latest")
    epochs, firsts, _ = train(accelerator, model, optimizer, loop)
    assert (epochs, firsts) == ([3], [])  # one epoch with no batches: the evaluation runs
    loop.finish(model)
    assert "nan" not in capsys.readouterr().out
    exported = json.loads((tmp_path / "model" / "model.json").read_text(), parse_constant=refuse)
    assert exported["step"] == 12 and exported["metrics"]["epoch"] == 3.0
    assert exported["metrics"]["train_loss"] == expected["train_loss"]
    logged = [json.loads(line, parse_constant=refuse) for line in metrics_lines(tmp_path)]
    assert logged[-1]["train/epoch_loss"] == expected["train_loss"]
    assert logged[-1]["eval/epoch"] == 3.0


def refuse(constant: str) -> None:
    raise AssertionError(f"{constant} in a JSON file")


def metrics_lines(out: Path) -> list[str]:
    return (out / "logs" / "metrics.jsonl").read_text().splitlines()


def test_an_epoch_resumed_at_its_end_reports_its_training_loss(run, tmp_path, capsys):
    """Saved after the last step of epoch 1 (step 5 of 5): the resumed run trains nothing in
    that epoch before its evaluation, which used to print `train_loss nan`, then no training
    loss; the checkpoint's loss sums give the uninterrupted run's. A checkpoint from before
    they were stored still reports none (nothing was trained since the resume)."""
    accelerator, model, optimizer, loop, _ = run(save_every=5)
    train(accelerator, model, optimizer, loop)  # saves step_5 and step_10; not finished
    shutil.rmtree(tmp_path / "checkpoints" / "step_10")
    capsys.readouterr()
    accelerator, model, optimizer, loop, _ = run(resume="latest", save_every=5)
    epochs, _, _ = train(accelerator, model, optimizer, loop)
    assert epochs == [1, 2, 3]
    printed = capsys.readouterr().out
    assert "nan" not in printed
    logged = [json.loads(line, parse_constant=refuse) for line in metrics_lines(tmp_path)]
    first, resumed = [r["train/epoch_loss"] for r in logged if r.get("eval/epoch") == 1.0]
    assert resumed == first

    forget_loss_sums(tmp_path / "checkpoints" / "step_5")
    accelerator, model, optimizer, loop, _ = run(
        resume=str(tmp_path / "checkpoints" / "step_5"),
        save_every=5,
        overwrite_later=True,
        allow_unverified=True,
    )
    train(accelerator, model, optimizer, loop)
    printed = capsys.readouterr().out
    assert "epoch 1: epoch 1\n" in printed.replace("\r", "\n")  # its evaluation, no train_loss
    assert "nan" not in printed


def forget_loss_sums(checkpoint: Path) -> None:
    """Make `checkpoint` look like one saved before the running loss sums were stored (and so
    before manifests and the record of each epoch's steps): it resumes --allow-unverified."""
    record = json.loads((checkpoint / "progress.json").read_text())
    del record["progress"]["loss_sums"], record["progress"]["epoch_samples"]
    del record["manifest_format"]
    (checkpoint / "progress.json").write_text(json.dumps(record))
    (checkpoint / "manifest.json").unlink()


@pytest.mark.parametrize(
    "damaged", [{"epoch": 1.5}, {"window": {"sums": [1.0, 2.0], "counts": [1, 1]}}]
)
def test_damaged_loss_sums_are_one_line_naming_the_file(run, tmp_path, damaged):
    accelerator, model, optimizer, loop, _ = run()
    train(accelerator, model, optimizer, loop)
    progress = tmp_path / "checkpoints" / "step_8" / "progress.json"
    record = json.loads(progress.read_text())
    record["progress"]["loss_sums"] |= damaged
    progress.write_text(json.dumps(record))
    with pytest.raises(CheckpointError, match=rf"^{progress}: loss_sums\.(epoch|window)"):
        run(resume="latest")


def test_a_run_resumed_mid_epoch_logs_and_exports_the_uninterrupted_runs_losses(run, tmp_path):
    """Issue 43: an epoch resumed mid-way logged (and exported) the mean loss of the steps after
    the resume only, and so did the first logging window: the running sums are checkpointed.
    Resumed at step 8 (mid-epoch 2, 2 steps after a log at step 6)."""
    full, cut = tmp_path / "full", tmp_path / "cut"
    accelerator, model, optimizer, loop, _ = run(out=full, log_every=3)
    train(accelerator, model, optimizer, loop)
    expected = loop.finish(model)
    accelerator, model, optimizer, loop, _ = run(out=cut, log_every=3)
    train(accelerator, model, optimizer, loop)  # saves step_4 and step_8; not finished
    (cut / "logs" / "metrics.jsonl").unlink()
    accelerator, model, optimizer, loop, _ = run(
        out=cut, resume=str(cut / "checkpoints" / "step_8"), log_every=3
    )
    train(accelerator, model, optimizer, loop)
    resumed = loop.finish(model)
    del expected["train_seconds"], resumed["train_seconds"]
    assert resumed == expected

    def records(out: Path) -> list[dict]:
        logged = [json.loads(line) for line in metrics_lines(out)]
        timing = ("time", "train/samples_per_s", "train/tflops_per_device")
        return [
            {k: v for k, v in r.items() if k not in timing}
            for r in logged
            if r["step"] is not None and r["step"] > 8
        ]

    assert [r["step"] for r in records(cut)] == [9, 10, 12, 12]  # 2 windows, 2 epochs
    assert records(cut) == records(full)


def test_a_checkpoint_without_loss_sums_resumes_and_marks_its_means_partial(run, tmp_path, capsys):
    """A checkpoint saved before the sums were stored: the first window's and the epoch's
    means cover only the steps since the resume, which the logs and a warning say."""
    accelerator, model, optimizer, loop, _ = run(log_every=3)
    train(accelerator, model, optimizer, loop)
    forget_loss_sums(tmp_path / "checkpoints" / "step_8")
    (tmp_path / "logs" / "metrics.jsonl").unlink()
    capsys.readouterr()
    accelerator, model, optimizer, loop, _ = run(
        resume="latest", log_every=3, allow_unverified=True
    )
    train(accelerator, model, optimizer, loop)
    metrics = loop.finish(model)
    printed = capsys.readouterr().out
    warning = [line for line in printed.splitlines() if "stores no running loss sums" in line]
    assert len(warning) == 1, printed
    logged = [json.loads(line) for line in metrics_lines(tmp_path)]
    windows = [r for r in logged if "train/loss" in r]
    assert [r.get("train/loss_partial") for r in windows] == [True, None]
    epochs = [r for r in logged if "eval/epoch" in r]
    assert [r.get("train/epoch_loss_partial") for r in epochs] == [True, None]
    assert "train_loss_partial" not in metrics  # the last epoch was trained whole


def test_a_non_finite_evaluation_metric_stops_the_run_before_it_reaches_a_json_file(run, tmp_path):
    accelerator, model, optimizer, loop, _ = run()
    with pytest.raises(NonFiniteError, match=r"the evaluation metric r2 is nan at epoch 1"):
        train(accelerator, model, optimizer, loop, lambda epoch: {"r2": float("nan")})
    for line in metrics_lines(tmp_path):
        json.loads(line, parse_constant=refuse)
    assert not (tmp_path / "model").exists()


def test_forgetting_record_or_batches_is_an_error(run, tmp_path):
    loop = run()[3]
    with pytest.raises(RuntimeError, match=r"loop.record\(loss\)"):
        for _epoch in loop.epochs():
            for _batch in loop.batches():
                pass
    loop = run(out=tmp_path / "second")[3]
    with pytest.raises(RuntimeError, match=r"loop.batches\(\)"):
        for _epoch in loop.epochs():
            pass


def test_clip_gradients_never_clips_a_partial_accumulation(run):
    accelerator, model, _, loop, _ = run(max_steps=12)
    loop.clip_grad = 0.1
    x = torch.ones(4, 3)
    with accelerator.accumulate(model):  # first of 2 micro-batches: no optimizer step follows
        accelerator.backward(model(x).pow(2).mean() * 100)
        partial = [p.grad.clone() for p in model.parameters()]
        assert not accelerator.sync_gradients
        loop.clip_gradients(model)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), partial, strict=True))
    with accelerator.accumulate(model):  # second: the window closes, clipping applies
        accelerator.backward(model(x).pow(2).mean() * 100)
        loop.clip_gradients(model)
    assert loop._grad_norm is not None and loop._grad_norm > 0.1
    clipped = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
    assert clipped.item() <= 0.1 + 1e-6


# --------------------------------------------------------------------------- never silently wrong


def test_a_non_finite_loss_stops_the_run_without_saving_or_exporting(run, tmp_path):
    accelerator, model, optimizer, loop, _ = run()
    with pytest.raises(NonFiniteError) as error:
        for _epoch in loop.epochs():
            for x, y in loop.batches():
                with accelerator.accumulate(model):
                    loss = (model(x / 1000) - y).pow(2).mean()
                    if loop.step >= 6:  # diverges during optimizer step 7
                        loss = loss * float("inf")
                    accelerator.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
                loop.record(loss)
    message = str(error.value)
    assert "the training loss went non-finite (inf) on process 0 at optimizer step 7" in message
    assert f"The last good checkpoint is {tmp_path / 'checkpoints' / 'step_4'}" in message
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_4"]
    assert not (tmp_path / "model").exists()


def test_non_finite_weights_are_never_exported(run, tmp_path):
    accelerator, model, optimizer, loop, _ = run()
    train(accelerator, model, optimizer, loop)
    with torch.no_grad():
        next(model.parameters())[0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match="the weights contain NaN"):
        loop.finish(model)
    assert not (tmp_path / "model").exists()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_4", "step_8"]


# --------------------------------------------------------------------------- exact item means


@pytest.mark.dist
def test_item_weighted_loss_is_exact_over_processes_and_accumulation(tmp_path):
    """Sequences of 1..12 items, loss = mean over the items of the global batch (16 sequences).

    1 process x 1 micro-batch and 2 processes x 2 accumulation steps must end with the same
    parameters after 24 steps (rel 1e-5, the bound of the other equivalence tests). The naive
    per-micro-batch mean, run the same two ways, must miss that bound: the test can fail.
    """
    common = ["--bs", "16", "--max-steps", "24"]
    runs = {}
    for name, extra, nproc in (
        ("exact-1", [], 1),
        ("exact-2x2", ["--grad-accum", "2"], 2),
        ("naive-1", ["--naive-mean"], 1),
        ("naive-2x2", ["--grad-accum", "2", "--naive-mean"], 2),
    ):
        out = tmp_path / name
        run_recipe([*common, *extra, "--output-dir", str(out)], cwd=tmp_path, nproc=nproc,
                   script=EXAMPLE)  # fmt: skip
        runs[name] = exported_params(out)
    assert max_relative_difference(runs["exact-1"], runs["exact-2x2"]) <= 1e-5
    assert max_relative_difference(runs["naive-1"], runs["naive-2x2"]) > 1e-5
    # in one process without accumulation both are the plain mean over the batch's items
    assert max_relative_difference(runs["exact-1"], runs["naive-1"]) <= 1e-5


def train_monitored(accelerator, model, optimizer, loop, values: list[float]) -> dict:
    """Train, reporting `values` as val_mae at each evaluation (step evaluations, with the model,
    and epoch ends) in turn: {step: the weights evaluated there}."""
    values, weights_at = iter(values), {}

    def evaluate() -> dict[str, float]:
        weights_at[loop.step] = model.weight.detach().clone()
        return {"val_mae": next(values)}

    for _epoch in loop.epochs():
        for x, y in loop.batches():
            with accelerator.accumulate(model):
                accelerator.backward((model(x / 1000) - y).pow(2).mean())
                optimizer.step()
                optimizer.zero_grad()
            loop.record(torch.zeros(()))
            if loop.eval_due():
                loop.log_eval(evaluate(), model)
        loop.end_epoch(evaluate(), model)
    return weights_at


def test_early_stopping_exports_the_best_epoch_and_a_resume_keeps_its_count(run, tmp_path):
    """val_mae 2, then 3 with patience 1: the run stops after epoch 2 of 3, and the export
    holds epoch 1's weights and metrics, not the last epoch's."""
    accelerator, model, optimizer, loop, _ = run(monitor="val_mae", patience=1)
    weights_at = train_monitored(accelerator, model, optimizer, loop, [2.0, 3.0])
    assert loop.progress.epoch == 2 and loop.done and loop.step == 10  # 5 steps an epoch
    metrics = loop.finish(model)
    assert (metrics["val_mae"], metrics["best_epoch"]) == (2.0, 1)
    exported = exported_params(tmp_path)["weight"]
    assert torch.equal(exported, weights_at[5]) and not torch.equal(exported, weights_at[10])
    # a resumed stopped run trains no more and exports the same best epoch again
    accelerator, model, optimizer, loop, _ = run(resume="latest", monitor="val_mae", patience=1)
    assert loop.done and (loop.progress.best, loop.progress.bad_epochs) == (2.0, 1)
    for _ in loop.epochs():
        assert list(loop.batches()) == []
        loop.end_epoch({"val_mae": 9.0}, model)
    assert loop.finish(model)["best_epoch"] == 1
    assert torch.equal(exported_params(tmp_path)["weight"], weights_at[5])


def test_a_gain_below_min_delta_keeps_the_best_model_but_not_the_patience(run, tmp_path):
    """As cricketmodel's trainer: val_mae 2.0 then 1.99995 (better by less than min_delta 1e-4)
    with patience 1: epoch 2's model is the best one exported, yet the run stops after it; with
    min_delta 0 the same gain resets the count and the run goes on to epoch 3."""
    for min_delta, last_epoch in ((1e-4, 2), (0.0, 3)):
        values = iter([2.0, 1.99995, 3.0])
        out = tmp_path / f"delta_{min_delta}"
        accelerator, model, _, loop, _ = run(
            out=out, monitor="val_mae", patience=1, min_delta=min_delta
        )
        epochs = []
        for epoch in loop.epochs():
            epochs.append(epoch)
            for _batch in loop.batches():
                with accelerator.accumulate(model):
                    pass  # no training: only the metric decides
                loop.record(torch.zeros(()))
            loop.end_epoch({"val_mae": next(values)}, model)
        assert epochs[-1] == last_epoch and loop.done
        assert loop.finish(model)["best_epoch"] == 2


@pytest.mark.dist
def test_early_stopping_waits_for_min_epochs_and_stops_every_process_at_once(tmp_path):
    """tests/scripts/early_stopping_check.py: the main process's val_mae stops improving after
    epoch 1, the other rank's never does. Patience 1 with --min-epochs 3 stops after epoch 4
    (not 2) on both ranks, with the 1-process run's weights (rel 1e-6: the same global batch of
    8) and its LR at every step: 2 epochs held at the peak, then cosine per epoch over the 6-2
    left."""
    script = REPO / "tests" / "scripts" / "early_stopping_check.py"
    reports, weights = {}, {}
    for nproc in (1, 2):
        out = tmp_path / str(nproc)
        run_recipe([str(out), "6", "1", "3"], cwd=tmp_path, nproc=nproc, script=script)
        reports[nproc] = [json.loads((out / f"rank_{r}.json").read_text()) for r in range(nproc)]
        weights[nproc] = exported_params(out)
    for report in (*reports[1], *reports[2]):
        assert report["epochs"] == [1, 2, 3, 4] and report["step"] == 32  # 8 steps an epoch
        assert report["lrs"] == reports[1][0]["lrs"]
    assert reports[2][0]["best"] == reports[2][1]["best"] == 1.0  # the main process's value
    lrs = reports[1][0]["lrs"]
    assert lrs[:24] == [0.05] * 24 and set(lrs[24:]) == {0.05 * (1 + math.cos(math.pi / 4)) / 2}
    assert max_relative_difference(weights[1], weights[2]) <= 1e-6
    # without the minimum the same run stops after epoch 2
    run_recipe([str(tmp_path / "early"), "6", "1", "0"], cwd=tmp_path, script=script)
    assert json.loads((tmp_path / "early" / "rank_0.json").read_text())["epochs"] == [1, 2]


def test_a_full_disk_during_a_periodic_save_stops_the_run_and_keeps_the_last_checkpoint(
    run, tmp_path, monkeypatch
):
    accelerator, model, optimizer, loop, _ = run()
    saved = accelerator.save_state
    calls = []

    def full_on_the_second(output_dir: str) -> None:
        calls.append(output_dir)
        if len(calls) == 2:
            Path(output_dir).mkdir(parents=True, exist_ok=True)
            (Path(output_dir) / "model.safetensors").write_bytes(b"\x00" * 10)
            raise OSError(errno.ENOSPC, "No space left on device", output_dir)
        saved(output_dir)

    monkeypatch.setattr(accelerator, "save_state", full_on_the_second)
    with pytest.raises(CheckpointError) as error:
        train(accelerator, model, optimizer, loop)
    first = tmp_path / "checkpoints" / "step_4"
    assert str(error.value).startswith(
        f"no space left on device while saving step_8; the last complete checkpoint is {first}"
    )
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_4"]
    monkeypatch.undo()
    assert run(resume="latest")[3].step == 4  # what was complete still loads


def test_a_best_epoch_export_under_fp16_records_the_runs_skipped_steps(tmp_path):
    """cricket's export under fp16 lacked skipped_steps: the best epoch's metrics were taken
    before the run's totals were added (tests/scaler_check.py, CPU stand-in scaler)."""
    check_a_best_epoch_export_counts_skipped_steps(tmp_path, gpu=False)


def test_loss_sums_saved_by_two_processes_resume_on_one_as_their_total(tmp_path):
    """A checkpoint of 2 processes resumed on 1 (the same global batch): the one holds both
    ranks' sums and counts, so the mean still covers every step of the epoch."""
    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = make_accelerator(output_dir=tmp_path, batch=BatchRequest(4), cpu=True)[0]
    saved = {"sums": [3.0, 5.0], "counts": [2.0, 2.0]}  # rank 0: 1 + 2, rank 1: 2 + 3
    mean = RunningMean()
    mean.restore(saved, accelerator)
    mean.add(torch.tensor(4.0))  # the resumed step
    assert mean.compute(accelerator) == pytest.approx((1 + 2 + 2 + 3 + 4) / 5)  # float32
    assert mean.state(accelerator) == {"sums": [0.0], "counts": [0.0]}  # compute reset it
    AcceleratorState._reset_state(reset_partial_state=True)


def test_a_recipe_metric_named_like_one_the_loop_owns_is_refused(run):
    """An evaluation returning 'train_loss' silently replaced the loop's training-loss mean in
    the log, the printout and the export."""
    accelerator, model, optimizer, loop, _ = run()
    with pytest.raises(ConfigError, match=r"returns 'train_loss', a metric name the training"):
        train(accelerator, model, optimizer, loop, lambda epoch: {"train_loss": 9.0})


def test_the_logged_lr_is_the_lr_the_step_used(tmp_path):
    """`train/lr` at step k is the LR the optimizer applied in step k, not the next step's."""
    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator, plan = make_accelerator(
        output_dir=tmp_path, batch=BatchRequest(per_device_batch_size=2), cpu=True
    )
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    loader = make_train_loader(EpochAwareData(), plan.per_device_batch_size)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    settings = LRSettings(1.0, ref_bs=2, decay=Decay.cosine, warmup_steps=2)
    schedule = make_lr_schedule(
        accelerator, optimizer, plan, settings, steps_per_epoch=len(loader), epochs=1
    )
    config = RunConfig("toy", {"lr": 1.0})
    loop = open_loop(
        accelerator, plan, loader, schedule, config, tmp_path, StartRequest(), SavePolicy(1, 0, 1)
    )
    used = []
    for _epoch in loop.epochs():
        for x, y in loop.batches():
            with accelerator.accumulate(model):
                loss = (model(x / 1000) - y).pow(2).mean()
                accelerator.backward(loss)
                used.append(optimizer.param_groups[0]["lr"])
                optimizer.step()
                optimizer.zero_grad()
            loop.record(loss)
        loop.end_epoch({})
    AcceleratorState._reset_state(reset_partial_state=True)
    records = [json.loads(line) for line in metrics_lines(tmp_path)]
    logged = [record["train/lr"] for record in records if "train/lr" in record]
    assert len(set(used)) > 2  # warmup and decay: the LR changes from step to step
    assert logged == used


def train_evaluating(accelerator, model, optimizer, loop) -> list[tuple[int, int, float]]:
    """The template's loop with --eval-every: (step, scheduler steps, weights' sum) at each
    evaluation between epoch ends."""
    evaluated = []
    for _epoch in loop.epochs():
        for x, y in loop.batches():
            with accelerator.accumulate(model):
                loss = (model(x / 1000) - y).pow(2).mean()
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            loop.record(loss)
            if loop.eval_due():
                weights = sum(p.sum().item() for p in model.parameters())
                metrics = loop.log_eval({"weights": weights})
                evaluated.append((loop.step, loop.scheduler.last_epoch, metrics["weights"]))
        loop.end_epoch({"weights": sum(p.sum().item() for p in model.parameters())})
    return evaluated


def eval_records(out: Path) -> list[tuple[int, float]]:
    logged = [json.loads(line) for line in metrics_lines(out)]
    return [(r["step"], r["eval/weights"]) for r in logged if "eval/weights" in r]


def test_eval_every_evaluates_after_the_step_and_a_resume_at_the_same_steps(run, tmp_path):
    """--eval-every 3 on 12 steps of 5-step epochs: evaluations after steps 3, 6 and 9 (the
    step counted, the LR stepped), logged at their step; not at an epoch's end (5, 10) or the
    run's (12), which end_epoch evaluates. Resumed from step 4, the run evaluates at 6 and 9
    again, with the uninterrupted run's values."""
    full, cut = tmp_path / "full", tmp_path / "cut"
    accelerator, model, optimizer, loop, _ = run(out=full, eval_every=3)
    evaluated = train_evaluating(accelerator, model, optimizer, loop)
    loop.finish(model)
    assert [(step, lr_steps) for step, lr_steps, _ in evaluated] == [(3, 3), (6, 6), (9, 9)]
    logged = eval_records(full)
    assert [step for step, _ in logged] == [3, 5, 6, 9, 10, 12]  # between epochs and at their ends
    assert [(s, w) for s, _, w in evaluated] == [r for r in logged if r[0] in (3, 6, 9)]

    accelerator, model, optimizer, loop, _ = run(out=cut, eval_every=3)
    train_evaluating(accelerator, model, optimizer, loop)  # saves step_4 and step_8
    (cut / "logs" / "metrics.jsonl").unlink()
    accelerator, model, optimizer, loop, _ = run(
        out=cut, eval_every=3, resume=str(cut / "checkpoints" / "step_4"), overwrite_later=True
    )
    resumed = train_evaluating(accelerator, model, optimizer, loop)
    assert [(s, w) for s, _, w in resumed] == [(s, w) for s, _, w in evaluated[1:]]
    assert eval_records(cut) == [r for r in logged if r[0] > 4]


def test_without_eval_every_no_step_is_due(run):
    accelerator, model, optimizer, loop, _ = run(eval_every=0)
    assert train_evaluating(accelerator, model, optimizer, loop) == []
    accelerator, model, optimizer, loop, _ = run(eval_every=5, out=loop.run.output_dir / "b")
    assert train_evaluating(accelerator, model, optimizer, loop) == []  # 5, 10: epoch ends


def test_epochs_0_trains_by_iterations_on_draws_with_replacement_and_resumes_exactly(run, tmp_path):
    """--epochs 0 --max-steps 23: the run is 23 optimizer steps over as many 5-step epochs as
    that takes; with `replacement` each epoch draws its 20 items with replacement, by (seed,
    epoch), and a run resumed mid-epoch sees the uninterrupted run's remaining draws."""
    full, cut = tmp_path / "full", tmp_path / "cut"
    accelerator, model, optimizer, loop, _ = run(out=full, epochs=0, max_steps=23, replacement=True)
    assert loop.total_steps == 23
    epochs, uninterrupted, _ = train(accelerator, model, optimizer, loop)
    assert epochs == [1, 2, 3, 4, 5] and loop.step == 23 and len(uninterrupted) == 46
    first_epoch = [int(x) for x in uninterrupted[:10]]  # 10 micro-batches' first items
    assert len(set(first_epoch)) < 10  # drawn with replacement: items repeat
    accelerator, model, optimizer, loop, _ = run(out=cut, epochs=0, max_steps=23, replacement=True)
    train(accelerator, model, optimizer, loop)  # saves step_4 ... step_20
    accelerator, model, optimizer, loop, _ = run(
        out=cut, epochs=0, max_steps=23, replacement=True, overwrite_later=True,
        resume=str(cut / "checkpoints" / "step_12"),
    )  # fmt: skip
    _, resumed, _ = train(accelerator, model, optimizer, loop)
    assert resumed == uninterrupted[24:]


def test_a_mean_weighted_by_items_is_the_mean_over_every_item(tmp_path):
    """loop.record(loss, items=n): micro-batches of 1 and 3 items with per-item means 2.0 and
    6.0 log (2 + 18) / 4 = 5.0, as one batch of all 4 items would, not (2 + 6) / 2 = 4.0; and
    the sums resume as they were saved."""
    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = make_accelerator(output_dir=tmp_path, batch=BatchRequest(4), cpu=True)[0]
    mean = RunningMean()
    mean.add(torch.tensor(2.0), torch.tensor(1))
    mean.add(torch.tensor(6.0), 3)
    saved = mean.state(accelerator)
    assert saved == {"sums": [20.0], "counts": [4.0]}
    resumed = RunningMean()
    resumed.restore(saved, accelerator)
    assert mean.compute(accelerator) == resumed.compute(accelerator) == 5.0
    AcceleratorState._reset_state(reset_partial_state=True)


def test_a_step_evaluation_keeps_the_best_model_and_its_patience_stops_the_run(run, tmp_path):
    """--eval-every 3 with a monitor, the model passed to log_eval: val_mae 2 at step 3, 1.5 at
    epoch 1's end (step 5), 3 at step 6 with patience 1: the run stops right after step 6, in
    its epoch (the epoch-end evaluation that follows judges nothing again), and exports step 5's
    model, recorded as best_epoch 1, best_step 5."""
    accelerator, model, optimizer, loop, _ = run(monitor="val_mae", patience=1, eval_every=3)
    weights_at = train_monitored(accelerator, model, optimizer, loop, [2.0, 1.5, 3.0, 9.0])
    assert loop.done and loop.step == 6 and sorted(weights_at) == [3, 5, 6]
    metrics = loop.finish(model)
    assert (metrics["val_mae"], metrics["best_epoch"], metrics["best_step"]) == (1.5, 1, 5)
    assert torch.equal(exported_params(tmp_path)["weight"], weights_at[5])
