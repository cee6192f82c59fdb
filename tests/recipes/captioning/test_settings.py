"""The captioning recipe's settings: config files under flags, the dry run's vocabulary, resume
refusals naming the flag.
"""

from __future__ import annotations

from unittest.mock import Mock

import pytest
import torch
import typer
from typer.testing import CliRunner

import recipes.train_captioning as recipe
from accel_common.batch_lr.lr import make_lr_schedule
from recipes.captioning.example import write_dataset
from recipes.captioning.model import Captioner
from tests.processes import CAPTIONING, CAPTIONING_TINY, dry_run_plan, run_recipe


def test_a_config_file_sets_flags_a_flag_overrides_it_and_a_dry_run_writes_nothing(
    tmp_path, monkeypatch
):
    """The --config file's values are used, a flag on the command line wins over the file, and
    --dry-run prints the plan and that network's parameter count without writing anything (no
    output folder, no example data)."""
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "sizes.yaml"
    config.write_text("image-size: 64\ndim: 96\nheads: 8\ndecoder-depth: 3\nlr: 3.0e-4\n")
    app = typer.Typer()
    app.command()(recipe.train)
    flags = ["--config", str(config), "--dim", "128", "--dry-run", "--processes", "2"]
    result = CliRunner().invoke(app, flags)
    assert result.exit_code == 0, result.output
    sizes = {"image_size": 64, "patch": 8, "dim": 128, "depth": 2, "decoder_depth": 3}
    network = Captioner(recipe.EXAMPLE_VOCAB, **sizes, heads=8, max_tokens=24)
    assert f"  parameters: {sum(p.numel() for p in network.parameters())}\n" in result.output
    assert "global batch 64 = 8 per device x 2 processes x 4 accumulation steps" in result.output
    assert "(--lr 0.0003 at --ref-bs 64," in result.output
    assert list(tmp_path.iterdir()) == [config]


def test_the_dry_run_prints_the_warmup_the_run_uses_under_max_steps():
    """--max-steps 3 cuts the run's 20 warmup steps to 3; the dry run printed 20. It prints the
    run's own LR line: the one make_lr_schedule builds for a 3-step run."""
    plan = dry_run_plan(recipe.train, ["--max-steps", "3"])
    assert "; 3 warmup steps, then" in plan["learning rate"], plan["learning rate"]
    args, _ = recipe.train.resolve(max_steps=3)
    batch = args.batch_request.plan(1, warn_small=False)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = make_lr_schedule(
        Mock(), optimizer, batch, args.lr_settings,  # Mock: the accelerator only registers it
        steps_per_epoch=1000 * batch.grad_accum_steps, epochs=1, max_steps=3,
    )  # fmt: skip
    assert plan["learning rate"] == schedule.description


def test_the_dry_run_counts_the_vocabulary_of_the_data_else_the_examples(captioning_data, tmp_path):
    """--dry-run builds the network without preparing the data: the vocabulary (the token
    embedding and the output layer) is counted from --data's training captions as the run's
    tokenizer counts it, or is the example's without --data."""

    def vocabulary(**values: object) -> int:
        with torch.device("meta"):
            return recipe.build_model(*recipe.train.resolve(**values)).embed.num_embeddings

    assert vocabulary() == vocabulary(data=captioning_data) == recipe.EXAMPLE_VOCAB
    data = write_dataset(tmp_path / "d", train_images=2, test_images=1)
    rows = [
        '{"file_name": "00000.png", "text": "a cat"}',
        '{"file_name": "00001.png", "text": "a dog"}',
    ]
    (data / "train" / "metadata.jsonl").write_text("\n".join(rows) + "\n")
    assert vocabulary(data=data) == 3 + 4  # a, cat, dog and [PAD] [UNK] [BOS] [EOS]


@pytest.mark.slow
def test_resuming_with_another_number_of_heads_is_refused_naming_the_flag(tmp_path):
    """--heads changes no parameter's shape, so only the run identity tells that the checkpoint
    was trained as another network; the refusal is one line naming the flag and both values."""
    data = write_dataset(tmp_path / "d", train_images=16, test_images=4)
    args = ["--data", str(data), "--output-dir", str(tmp_path / "run"), *CAPTIONING_TINY]
    args += ["--bs", "8", "--max-steps", "2"]
    run_recipe(args, cwd=tmp_path, script=CAPTIONING)
    again = [*args, "--heads", "2", "--resume", "latest"]
    result = run_recipe(again, cwd=tmp_path, script=CAPTIONING, check=False)
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert "belongs to another run" in line and "--heads 4 in the checkpoint, 2 now" in line, line
