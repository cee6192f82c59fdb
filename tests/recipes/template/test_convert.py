"""A foreign checkpoint starts a template run: `accel-recipes convert` makes a DDP torch.save of
the template's network an export, and `--init-from` trains from its weights, strictly."""

from __future__ import annotations

import pytest
import torch
from accelerate.state import AcceleratorState
from safetensors.torch import load_file
from typer.testing import CliRunner

import recipes.train_template as recipe
from accel_common.errors import CheckpointError, ConfigError
from accel_common.recipe_cli.entry import train_in_python
from accel_common.tools import cli
from tests.processes import TEMPLATE

SIZES = ["--hidden", "16", "--depth", "1"]


def ddp_checkpoint(path, seed: int = 123) -> dict[str, torch.Tensor]:
    """A plain DDP script's `torch.save(model.state_dict())`: every key under `module.`."""
    torch.manual_seed(seed)
    state = recipe.MLPRegressor(recipe.FEATURES, 16, 1).state_dict()
    torch.save({f"module.{k}": v for k, v in state.items()}, path)
    return state


def train(argv: list[str], out) -> None:
    try:
        train_in_python(recipe.train, [*argv, "--output-dir", str(out)], out, script=TEMPLATE)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.parametrize("named", [["--recipe", "template"], []], ids=["recipe", "unnamed"])
def test_init_from_trains_from_a_converted_ddp_checkpoint(tmp_path, template_data, named):
    """Converted with --recipe template, or without (as `accel-recipes convert SRC OUT` says
    it: recorded as no recipe's, which the strict load then checks, not refused as another's)."""
    start = ddp_checkpoint(tmp_path / "ddp.pt")
    converted = tmp_path / "converted"
    argv = ["convert", str(tmp_path / "ddp.pt"), str(converted), *named]
    result = CliRunner().invoke(cli.app, argv)
    assert result.exit_code == 0, result.output
    # one step at a tiny learning rate: the weights stay the checkpoint's, not a fresh draw's
    run = ["--data", str(template_data), *SIZES, "--max-steps", "1", "--lr", "1e-7"]
    train([*run, "--init-from", str(converted)], tmp_path / "run")
    trained = load_file(tmp_path / "run" / "model" / "model.safetensors")
    assert trained.keys() == start.keys()
    for name, tensor in start.items():
        torch.testing.assert_close(trained[name], tensor, atol=1e-5, rtol=0)
    fresh = recipe.MLPRegressor(recipe.FEATURES, 16, 1).state_dict()  # another draw: far off
    assert (fresh["net.0.weight"] - start["net.0.weight"]).abs().max() > 0.1


def test_init_from_refuses_an_unconverted_checkpoint_and_other_sizes(tmp_path, template_data):
    ddp_checkpoint(tmp_path / "ddp.pt")
    run = ["--data", str(template_data), *SIZES, "--max-steps", "1"]
    hint = r"convert it first: accel-recipes convert .*ddp\.pt OUT --recipe template"
    with pytest.raises(ConfigError, match=hint):
        train([*run, "--init-from", str(tmp_path / "ddp.pt")], tmp_path / "a")
    converted = tmp_path / "converted"
    argv = ["convert", str(tmp_path / "ddp.pt"), str(converted), "--recipe", "template"]
    assert CliRunner().invoke(cli.app, argv).exit_code == 0
    with pytest.raises(CheckpointError, match=r"does not fit this model"):
        train([*run, "--hidden", "24", "--init-from", str(converted)], tmp_path / "b")
    assert not (tmp_path / "a").exists()
