"""The template recipe's bad input: one clear error for bad data, flags and accelerate config
files; the help explains the batch conventions.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.processes import REPO, TEMPLATE, recipe_env, run_recipe
from tests.recipes.template.helpers import digest


@pytest.fixture
def bad_data(tmp_path, template_data) -> Path:
    folder = tmp_path / "bad-data"
    shutil.copytree(template_data, folder)
    lines = (folder / "train.csv").read_text().splitlines()
    lines[4] = lines[4].replace(lines[4].split(",")[2], "oops", 1)
    (folder / "train.csv").write_text("\n".join(lines) + "\n")
    return folder


@pytest.fixture
def odd_data(tmp_path, template_data) -> Path:
    """Folders whose train.csv is not comma-separated text: random bytes, `;`-separated."""
    for name in ("binary", "semicolon"):
        shutil.copytree(template_data, tmp_path / name)
    (tmp_path / "binary" / "train.csv").write_bytes(bytes(range(255, -1, -1)) * 8)
    train = tmp_path / "semicolon" / "train.csv"
    train.write_text(train.read_text().replace(",", ";"))
    return tmp_path


BAD_INPUTS = {
    "unsplittable batch": (["--bs", "30", "--grad-accum", "4"], "--bs 30 cannot be split"),
    "lr not a number": (["--lr", "nan"], "--lr nan: give a positive number"),
    "both batch flags": (["--bs", "32", "--per-device-bs", "16"], "both were given"),
    "batch above the split": (
        ["--bs", "4096"],
        "the training split is smaller than one global batch: its 20 epoch(s) fill 0 of the 4096 "
        "samples of one optimizer step",
    ),
    "missing data": (["--data", "/nonexistent/data"], "--data /nonexistent/data: no such folder"),
    "malformed csv": (["--data", "{bad_data}"], "train.csv, line 5: column x2 is 'oops'"),
    "random bytes": (
        ["--data", "{odd}/binary"],
        "binary/train.csv, line 1: byte 0xff at offset 0 is not UTF-8 text; save the file as "
        "UTF-8 comma-separated values",
    ),
    "semicolons": (
        ["--data", "{odd}/semicolon"],
        "semicolon/train.csv: the header 'x0;x1;x2;x3;x4;x5;x6;x7;y' looks ';'-separated; write "
        "comma-separated values (a header such as x0,x1,x2,x3,x4,x5,x6,x7,y)",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_gives_one_clear_error(
    case, finished_run, template_data, bad_data, odd_data, tmp_path
):
    flags, message = BAD_INPUTS[case]
    flags = [f.format(bad_data=bad_data, odd=odd_data) for f in flags]
    if "--data" not in flags:
        flags = ["--data", str(template_data), *flags]
    before = digest(finished_run)
    result = run_recipe([*flags, "--output-dir", str(finished_run)], cwd=tmp_path, check=False)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert digest(finished_run) == before


def test_unknown_accelerate_config_file_is_refused():
    result = subprocess.run(
        ["make", "-s", "-o", "install", "train-cpu", "CONFIG=accelerate_configs/nope.yaml"],
        cwd=REPO,
        env=recipe_env(REPO),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "CONFIG=accelerate_configs/nope.yaml: no such accelerate config file" in result.stderr
    assert "accelerate_configs/cpu_2proc.yaml" in result.stderr  # names the valid choices


@pytest.mark.slow
def test_help_explains_the_batch_conventions():
    result = subprocess.run(
        [sys.executable, str(TEMPLATE), "--help"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0
    # rich wraps the help in a box, with each flag's range ([x>=1]) in a column of its own
    text = re.sub(r"\[[^\]]*x[<>]=?[^\]]*\]", " ", result.stdout.replace("│", " "))
    text = " ".join(text.split())
    for flag in ("--bs", "--per-device-bs", "--ref-bs", "--lr-scaling", "--resume", "--hidden"):
        assert flag in text
    assert "GLOBAL batch" in text and "EACH device" in text
    assert "evaluate --help" in text
