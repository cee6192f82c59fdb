"""`--init-from`: a captioning run starts from an export's weights and keeps the tokenizer beside
it (its token ids are what the weights learnt), whatever words the new captions hold."""

from __future__ import annotations

import shutil

import pytest
from accelerate.state import AcceleratorState
from safetensors.torch import load_file

import recipes.train_captioning as recipe
from accel_common.errors import CheckpointError
from accel_common.recipe_cli.entry import train_in_python
from tests.processes import CAPTIONING, CAPTIONING_TINY


def train(argv: list[str], out) -> None:
    argv = [*argv, *CAPTIONING_TINY, "--mixed-precision", "no", "--output-dir", str(out)]
    try:
        train_in_python(recipe.train, argv, out, script=CAPTIONING)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def test_init_from_starts_from_the_exports_weights_and_tokenizer(captioning_data, tmp_path):
    train(["--data", str(captioning_data), "--max-steps", "1"], tmp_path / "first")
    start = tmp_path / "first" / "model"
    # new captions with a word the export's tokenizer never saw: one trained on them would have
    # another vocabulary, and the weights would not load
    data = tmp_path / "more"
    shutil.copytree(captioning_data, data)
    for split in ("train", "test"):
        lines = (data / split / "metadata.jsonl").read_text().splitlines()
        text = "\n".join(line.replace('"}', ' today"}') for line in lines) + "\n"
        (data / split / "metadata.jsonl").write_text(text)
    run = ["--data", str(data), "--max-steps", "1", "--lr", "1e-9"]
    train([*run, "--init-from", str(start)], tmp_path / "second")
    second = tmp_path / "second" / "model"
    weights, source = (load_file(d / "model.safetensors") for d in (second, start))
    assert weights.keys() == source.keys()
    assert max((weights[k] - source[k]).abs().max().item() for k in source) < 1e-6
    tokenizer = recipe.TOKENIZER_FILE
    assert (second / tokenizer).read_text() == (start / tokenizer).read_text()

    bare = tmp_path / "bare"  # the weights without their tokenizer: refused, naming it
    bare.mkdir()
    for name in ("model.safetensors", "model.json"):
        shutil.copy(start / name, bare / name)
    with pytest.raises(CheckpointError, match=rf"--init-from {bare}: no {tokenizer} beside"):
        train([*run, "--init-from", str(bare)], tmp_path / "third")
    assert not (tmp_path / "third").exists()
