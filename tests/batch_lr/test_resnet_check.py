"""A BatchNorm network holds "2 processes = 1" with --sync-batchnorm (issue 57): torchvision's
ResNet-18 with SGD momentum 0.9 and per-image seeded crops and flips
(tests/fixtures/check_recipes/train_resnet.py), whose real 1- and 2-process (gloo) runs
`accel-recipes check --only a` makes. Without --sync-batchnorm each process normalises its own
half of the batch: another computation, which the same row refuses."""

from __future__ import annotations

import pytest

from tests.processes import REPO
from tests.tools.test_check import check, rows

pytestmark = [pytest.mark.dist, pytest.mark.slow]

RESNET = REPO / "tests" / "fixtures" / "check_recipes" / "train_resnet.py"


def test_resnet_with_sync_batchnorm_trains_on_two_processes_as_on_one(tmp_path):
    result = check(tmp_path, str(RESNET), "--only", "a")
    assert result.returncode == 0, result.stdout + result.stderr
    row = rows(result.stdout)["a"]
    assert row[1] == "held", row
    assert row[2].startswith("held vs one batch: weights "), row


def test_resnet_without_sync_batchnorm_fails_row_a(tmp_path):
    script = tmp_path / "train_resnet.py"
    text = RESNET.read_text()
    declared = '"--bs", "32", "--sync-batchnorm", "--float64"]'
    assert declared in text
    script.write_text(text.replace(declared, '"--bs", "32", "--float64"]'))
    result = check(tmp_path, str(script), "--only", "a")
    assert result.returncode == 1, result.stdout + result.stderr
    assert rows(result.stdout)["a"][1] == "not held"
