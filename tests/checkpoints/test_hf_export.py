"""The export of a diffusers or transformers model is also that library's `from_pretrained`
folder (config.json beside the weights under its file name); every export has a README.md model
card naming the recipe, its metrics and a load snippet that runs. Tiny models from config
objects: nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from accel_common import load_exported
from accel_common.batch_lr.batching import plan_batch
from accel_common.checkpoints.export import MODEL_FILE, export_model, write_export
from accel_common.checkpoints.hf_layout import hf_library, read_hf_layout
from accel_common.checkpoints.model_card import model_card, training_command
from tests.checkpoints.test_checkpoint import Net

METRICS = {"test_mse": 0.125, "r2": 0.75}


def export(accelerator, model: torch.nn.Module, out: Path, recipe: str = "tiny") -> Path:
    """`model` through the run's export path (export_model), as a finished run exports it."""
    prepared = accelerator.prepare(model)
    return export_model(
        accelerator,
        prepared,
        out,
        recipe=recipe,
        config={"lr": 0.001, "hidden": 16, "compile": False, "data": None, "target_mean": 0.5},
        plan=plan_batch(1, global_batch_size=8),
        schedule={"learning_rate": "0.001 constant", "optimizer_steps": 2},
        step=2,
        metrics=METRICS,
        derived=("target_mean",),
    )


def assert_same_tensors(loaded: torch.nn.Module, folder: Path) -> None:
    exported = load_file(str(folder / MODEL_FILE))
    state = loaded.state_dict()
    assert set(state) == set(exported)
    for key, tensor in exported.items():
        assert torch.equal(state[key], tensor), key


def tiny_unet():
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    return diffusers.UNet2DModel(
        sample_size=8,
        in_channels=3,
        out_channels=3,
        block_out_channels=(8, 16),
        layers_per_block=1,
        norm_num_groups=4,
        down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"),
    )


def test_diffusers_export_loads_with_from_pretrained(tmp_path, accelerator):
    diffusers = pytest.importorskip("diffusers")
    model = tiny_unet()
    with torch.no_grad():  # weights unlike a fresh model's, so a re-initialised load would differ
        for param in model.parameters():
            param.add_(torch.randn_like(param))
    folder = tmp_path / "model"
    export(accelerator, model, folder)
    names = sorted(p.name for p in folder.iterdir())
    assert names == [
        "README.md",
        "config.json",
        "diffusion_pytorch_model.safetensors",
        "model.json",
        "model.safetensors",
    ]
    loaded = diffusers.UNet2DModel.from_pretrained(folder)
    assert_same_tensors(loaded, folder)
    assert list(loaded.config.block_out_channels) == [8, 16]
    # our own readers are unchanged
    fresh = tiny_unet()
    assert load_exported(folder, fresh)["metrics"] == METRICS
    assert_same_tensors(fresh, folder)
    layout = read_hf_layout(folder)
    assert layout is not None and (layout.library, layout.model_class) == (
        "diffusers",
        "UNet2DModel",
    )
    card = (folder / "README.md").read_text()
    assert 'library_name: "diffusers"' in card
    assert "UNet2DModel.from_pretrained(" in card


def test_transformers_export_loads_with_from_pretrained(tmp_path, accelerator):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=64, n_positions=16)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied: both names exported
    folder = tmp_path / "model"
    export(accelerator, model, folder)
    saved = json.loads((folder / "config.json").read_text())
    assert saved["architectures"] == ["GPT2LMHeadModel"]
    assert "transformers_version" in saved
    assert model.config.architectures is None  # the model's own config is left as it was
    loaded = transformers.GPT2LMHeadModel.from_pretrained(folder)
    assert_same_tensors(loaded, folder)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    auto = transformers.AutoModelForCausalLM.from_pretrained(folder)
    assert_same_tensors(auto, folder)
    tokens = torch.arange(8).unsqueeze(0)
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, model.eval()(tokens).logits)
    assert load_exported(folder, transformers.GPT2LMHeadModel(config))["step"] == 2
    assert 'library_name: "transformers"' in (folder / "README.md").read_text()


def test_bert_export_loads_with_from_pretrained(tmp_path, accelerator):
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        num_hidden_layers=2,
        hidden_size=16,
        num_attention_heads=2,
        intermediate_size=32,
        vocab_size=64,
        max_position_embeddings=16,
    )
    torch.manual_seed(0)
    model = transformers.BertModel(config)
    folder = tmp_path / "model"
    export(accelerator, model, folder)
    assert_same_tensors(transformers.BertModel.from_pretrained(folder), folder)


def test_plain_model_export_has_a_model_card_whose_snippet_runs(tmp_path, accelerator):
    torch.manual_seed(0)
    model = Net()
    folder = tmp_path / "model"
    export(accelerator, model, folder, recipe="template")
    assert hf_library(model) is None
    assert sorted(p.name for p in folder.iterdir()) == [
        "README.md",
        "model.json",
        "model.safetensors",
    ]
    card = (folder / "README.md").read_text()
    front, body = card.split("---\n")[1], card.split("---\n", 2)[2]
    assert 'library_name: "pytorch"' in front and '- "accel-recipes"' in front
    assert '- "template"' in front
    assert "# template model" in body
    assert "| test_mse | `0.125` |" in body and "| r2 | `0.75` |" in body
    # the command: the recipe's script with the settings as flags, not those from the data
    assert "python recipes/train_template.py --lr 0.001 --hidden 16 --no-compile" in body
    assert "--target-mean" not in body and "--data" not in body
    snippet = body.split("```python\n")[1].split("```")[0]
    assert "load_exported(" in snippet
    fresh = Net()
    scope = {"model": fresh}
    exec(snippet, scope)  # the card's own snippet, against the folder
    assert scope["meta"]["metrics"] == METRICS
    assert_same_tensors(fresh, folder)


def test_best_epoch_copy_keeps_the_layout_and_writes_a_new_card(tmp_path, accelerator):
    """Run.export_best: the best epoch's export, rewritten as the run's with its final metrics."""
    pytest.importorskip("diffusers")
    best, final = tmp_path / "best", tmp_path / "model"
    export(accelerator, tiny_unet(), best)
    metadata = json.loads((best / "model.json").read_text()) | {"metrics": {"fid": 3.5}}
    write_export(load_file(str(best / MODEL_FILE)), final, metadata, read_hf_layout(best), True)
    for name in ("config.json", "diffusion_pytorch_model.safetensors", "model.safetensors"):
        assert (final / name).read_bytes() == (best / name).read_bytes()
    assert "| fid | `3.5` |" in (final / "README.md").read_text()


def test_a_file_export_gets_no_layout_or_card(tmp_path):
    """NAME.safetensors (convert's file form): the folder may hold other exports."""
    write_export({"w": torch.ones(2)}, tmp_path / "a.safetensors", {"recipe": "x"}, card=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "a.safetensors"]


def test_recorded_command_is_used_as_is():
    assert training_command({"command": ["python", "train.py", "--lr", "1e-3"]}) == (
        "python train.py --lr 1e-3"
    )
    card = model_card({"recipe": "r", "metrics": {}, "config": {}}, "out/model")
    assert "None recorded." in card and "python recipes/train_r.py" in card
