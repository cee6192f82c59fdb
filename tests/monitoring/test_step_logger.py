"""The loop's step logger as a user sees it: the progress bar shows the loss just logged, and
an epoch's mean training loss is logged as a training metric, not an evaluation."""

from __future__ import annotations

import io

import pytest
import torch
from accelerate import Accelerator

from accel_common.monitoring.tracking import StepLogger


@pytest.fixture
def logger(monkeypatch) -> StepLogger:
    screen = io.StringIO()  # what the bar draws, read back below
    monkeypatch.setattr("sys.stdout", screen)
    accelerator = Accelerator(cpu=True)
    logged = []
    accelerator.log = lambda record, step: logged.append((step, record))
    logger = StepLogger(
        accelerator, total_steps=60, initial_step=0, log_every=10, global_batch_size=4, desc="t"
    )
    logger.logged, logger.screen = logged, screen
    return logger


def test_the_bar_shows_each_logged_loss_when_it_is_logged(logger):
    for step in range(1, 61):
        logger.add_loss(torch.tensor(float(step)))
        logged = logger.step(step, lr=0.1, grad_norm=None)
        if logged is not None:  # the mean of the window's losses, drawn at once
            shown = logger.screen.getvalue().split("\r")[-1]
            assert f"loss={logged:.4f}" in shown, shown
    logger.bar.close()


def test_the_epoch_loss_is_logged_under_train_not_eval(logger):
    logger.add_loss(torch.tensor(2.0))
    logger.add_loss(torch.tensor(4.0))
    metrics = logger.end_epoch(1, 2, {"test_mse": 0.5})
    assert metrics == {"train_loss": 3.0, "test_mse": 0.5}  # the export's names
    assert logger.logged == [(2, {"train/epoch_loss": 3.0, "eval/test_mse": 0.5})]
    assert logger.screen.getvalue().split("\r")[-1].endswith("loss=3.0000]")  # the latest
    logger.bar.close()
