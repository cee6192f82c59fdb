"""convert reads Hugging Face layouts: diffusers and transformers save_pretrained folders (one
file, and shards with their index), diffusers pipeline folders, and accelerate save_state folders
whose model a save hook wrote into a subfolder; each written by the libraries themselves."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from accel_common.tools.cli import app

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")
runner = CliRunner()


def tiny_unet() -> torch.nn.Module:
    torch.manual_seed(0)
    return diffusers.UNet2DModel(
        sample_size=8,
        block_out_channels=(8, 16),
        layers_per_block=1,
        norm_num_groups=4,
        down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"),
    )


def convert(*args: str):
    return runner.invoke(app, ["convert", *map(str, args)])


def assert_bit_equal(export, model: torch.nn.Module) -> None:
    got = load_file(str(export / "model.safetensors"))
    expected = model.state_dict()
    assert sorted(got) == sorted(expected)
    for key, tensor in expected.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key


def test_a_diffusers_save_pretrained_folder(tmp_path):
    unet = tiny_unet()
    unet.save_pretrained(tmp_path / "unet")
    result = convert(tmp_path / "unet", tmp_path / "out")
    assert result.exit_code == 0, result.output
    weights = tmp_path / "unet" / "diffusion_pytorch_model.safetensors"
    n = len(unet.state_dict())
    assert f"read diffusers UNet2DModel weights from {weights} ({n} tensors)" in result.output
    assert_bit_equal(tmp_path / "out", unet)


def test_a_sharded_transformers_folder_is_read_whole_and_a_missing_shard_named(tmp_path):
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.BertModel(config)
    model.save_pretrained(tmp_path / "bert", max_shard_size="8KB")
    index = tmp_path / "bert" / "model.safetensors.index.json"
    shards = sorted((tmp_path / "bert").glob("model-*.safetensors"))
    assert index.is_file() and len(shards) > 2
    result = convert(tmp_path / "bert", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert f"read transformers BertModel weights from {index} ({len(shards)} shards" in (
        " ".join(result.output.split())
    )
    assert_bit_equal(tmp_path / "out", model)

    shards[1].unlink()
    missing = convert(tmp_path / "bert", tmp_path / "out2")
    assert missing.exit_code != 0
    assert f"shard {shards[1].name} is missing" in " ".join(missing.output.split())
    assert not (tmp_path / "out2").exists()


def test_a_shard_that_disagrees_with_its_index_is_named(tmp_path):
    model = transformers.BertModel(
        transformers.BertConfig(
            vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
            intermediate_size=32, max_position_embeddings=16,
        )
    )  # fmt: skip
    model.save_pretrained(tmp_path / "bert", max_shard_size="8KB")
    shard = sorted((tmp_path / "bert").glob("model-*.safetensors"))[0]
    tensors = load_file(str(shard))
    from safetensors.torch import save_file

    save_file(dict(list(tensors.items())[1:]), str(shard))
    result = convert(tmp_path / "bert", tmp_path / "out")
    assert result.exit_code != 0
    assert f"{shard.name} lacks {next(iter(tensors))}" in " ".join(result.output.split())


def test_a_pipeline_folder_gives_its_trainable_component_or_the_one_named(tmp_path):
    unet = tiny_unet()
    diffusers.DDPMPipeline(unet, diffusers.DDPMScheduler()).save_pretrained(tmp_path / "pipe")
    result = convert(tmp_path / "pipe", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert f"from {tmp_path / 'pipe' / 'unet' / 'diffusion_pytorch_model.safetensors'}" in (
        result.output.replace("\n", "")
    )
    assert_bit_equal(tmp_path / "out", unet)
    named = convert(tmp_path / "pipe", tmp_path / "out2", "--component", "unet")
    assert named.exit_code == 0, named.output
    wrong = convert(tmp_path / "pipe", tmp_path / "out3", "--component", "vae")
    assert wrong.exit_code != 0
    assert "--component vae" in wrong.output and "it has unet" in " ".join(wrong.output.split())


def test_a_pipeline_with_two_trainable_models_asks_for_component(tmp_path):
    pipe = tmp_path / "pipe"
    for name in ("unet", "transformer"):
        tiny_unet().save_pretrained(pipe / name)
    (pipe / "model_index.json").write_text(
        '{"_class_name": "X", "unet": ["diffusers", "UNet2DModel"], '
        '"transformer": ["diffusers", "UNet2DModel"], "scheduler": ["diffusers", "DDPMScheduler"]}'
    )
    result = convert(pipe, tmp_path / "out")
    assert result.exit_code != 0
    text = " ".join(result.output.split())
    assert "several models (unet, transformer)" in text and "--component" in text


def test_a_save_state_folder_whose_hook_saved_the_unet(tmp_path):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    unet = tiny_unet()
    optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-3)
    unet, optimizer = accelerator.prepare(unet, optimizer)

    def save_model_hook(models, weights, output_dir):  # as diffusers' train_unconditional.py
        for model in models:
            accelerator.unwrap_model(model).save_pretrained(f"{output_dir}/unet")
            weights.pop()

    accelerator.register_save_state_pre_hook(save_model_hook)
    accelerator.save_state(str(tmp_path / "checkpoint-2"))
    assert not (tmp_path / "checkpoint-2" / "model.safetensors").exists()
    result = convert(tmp_path / "checkpoint-2", tmp_path / "out")
    assert result.exit_code == 0, result.output
    weights = tmp_path / "checkpoint-2" / "unet" / "diffusion_pytorch_model.safetensors"
    assert f"from {weights}" in result.output.replace("\n", "")
    assert_bit_equal(tmp_path / "out", accelerator.unwrap_model(unet))
