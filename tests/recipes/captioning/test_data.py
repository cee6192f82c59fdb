"""The captioning recipe: three readers (and `datasets`' imagefolder), learning in bf16, exact token
means over processes, fp16's loss scaler through the loop, the preprocessing cache, the tokenizer,
bad input, its settings (--config, --dry-run, the resume check)."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
import typer
from tokenizers import Tokenizer
from typer.testing import CliRunner

import recipes.train_captioning as recipe
from accel_common.errors import ConfigError, DataError
from recipes.captioning import data as caption_data
from recipes.captioning.data import read_split
from recipes.captioning.example import write_dataset
from recipes.captioning.model import Captioner
from recipes.captioning.tokenizer import PAD_ID, train_tokenizer
from tests.conftest import (
    CAPTIONING,
    CAPTIONING_TINY,
    exported_params,
    max_relative_difference,
    metrics_log,
    run_recipe,
)
from tests.scaler_check import check_overflow_is_skipped_and_resumes


@pytest.fixture(scope="module")
def trained(captioning_data, tmp_path_factory) -> Path:
    """The example at its defaults, fp32 (about 35 s of training on one thread)."""
    tmp = tmp_path_factory.mktemp("caption-run")
    args = ["--data", str(captioning_data), "--output-dir", str(tmp / "run")]
    run_recipe([*args, "--mixed-precision", "no"], cwd=tmp, script=CAPTIONING)
    return tmp / "run"


@pytest.mark.slow
def test_learns_to_caption_from_pixels(trained):
    metrics = json.loads((trained / "model" / "model.json").read_text())["metrics"]
    assert metrics["n"] == 100
    assert metrics["token_accuracy"] > metrics["baseline_majority_token_accuracy"] + 0.5, metrics
    assert metrics["cross_entropy"] < 0.3 * metrics["baseline_uniform_cross_entropy"], metrics
    assert metrics["exact_caption_share"] > 0.5, metrics


@pytest.mark.slow
def test_bf16_on_the_cpu_learns(captioning_data, tmp_path):
    """3 epochs only: a CPU without bf16 instructions (this project's CI machine) emulates bf16
    matrix products, about 3.5x slower than fp32 (docs/recipes/captioning.md). 37 optimizer steps
    already put token accuracy far above the majority baseline (about 0.63 against 0.165)."""
    args = ["--data", str(captioning_data), "--output-dir", str(tmp_path / "run"), "--epochs", "3"]
    run_recipe([*args, "--mixed-precision", "bf16"], cwd=tmp_path, script=CAPTIONING)
    metrics = json.loads((tmp_path / "run" / "model" / "model.json").read_text())["metrics"]
    assert metrics["token_accuracy"] > metrics["baseline_majority_token_accuracy"] + 0.3, metrics
    assert metrics["cross_entropy"] < 0.6 * metrics["baseline_uniform_cross_entropy"], metrics
    assert metrics_log(tmp_path / "run")[0]["config"]["mixed_precision"] == "bf16"


@pytest.mark.slow
def test_caption_command_writes_one_line_per_image(trained, captioning_data, tmp_path):
    out = tmp_path / "captions.tsv"
    args = ["caption", "--model", str(trained / "model"), "--images", str(captioning_data / "test")]
    run_recipe([*args, "--out", str(out)], cwd=tmp_path, script=CAPTIONING)
    written = dict(line.split("\t") for line in out.read_text().splitlines())
    truth = dict(read_split(captioning_data, "test")[1])
    assert written.keys() == truth.keys()
    assert sum(written[name] == truth[name] for name in truth) > 50  # most are exactly right
    again = run_recipe([*args, "--out", str(out)], cwd=tmp_path, script=CAPTIONING, check=False)
    assert again.returncode == 2 and "exists" in again.stderr
    # in chunks of 7 and at most 3 tokens ([BOS] and two words): the first two words of each
    short = tmp_path / "short.tsv"
    model, images = trained / "model", captioning_data / "test"
    recipe.caption(model, images, short, max_tokens=3, bs=7)
    cut = dict(line.split("\t") for line in short.read_text().splitlines())
    assert cut == {name: " ".join(text.split()[:2]) for name, text in written.items()}
    with pytest.raises(ConfigError, match="--max-tokens 99: the model was trained for at most"):
        recipe.caption(model, images, tmp_path / "long.tsv", max_tokens=99, bs=7)


@pytest.mark.dist
def test_two_processes_with_accumulation_equal_one_process_over_varying_caption_lengths(
    captioning_data, tmp_path
):
    """Captions hold 6 to 10 tokens, so a per-micro-batch mean would weigh tokens unequally;
    the global token mean makes 2 processes x 2 micro-batches equal 1 process (fp32, 20 steps;
    1e-5 leaves room for the order of floating-point sums only)."""
    base = ["--data", str(captioning_data), *CAPTIONING_TINY, "--bs", "16", "--max-steps", "20"]
    base += ["--log-every", "1", "--mixed-precision", "no"]
    one, two = tmp_path / "one", tmp_path / "two"
    run_recipe(
        [*base, "--grad-accum", "1", "--output-dir", str(one)], cwd=tmp_path, script=CAPTIONING
    )
    run_recipe(
        [*base, "--grad-accum", "2", "--output-dir", str(two)],
        cwd=tmp_path,
        script=CAPTIONING,
        nproc=2,
    )
    assert metrics_log(two)[0]["config"]["num_processes"] == 2
    assert max_relative_difference(exported_params(one), exported_params(two)) <= 1e-5
    # the captions were balanced by token count over the 2 x 2 micro-batches of every step: no
    # process's tokens more than the longest caption (10 of ~64 per slot) above the mean
    imbalances = [
        r["train/rank_imbalance"] for r in metrics_log(two) if "train/rank_imbalance" in r
    ]
    assert len(imbalances) == 20 and all(1 <= i <= 1 + 10 / 48 for i in imbalances)
    final = [
        json.loads((run / "model" / "model.json").read_text())["metrics"] for run in (one, two)
    ]
    assert final[0]["token_accuracy"] == pytest.approx(final[1]["token_accuracy"], abs=1e-9)


def test_the_three_layouts_read_the_same_records(tmp_path):
    imagefolder = write_dataset(tmp_path / "imagefolder", train_images=12, test_images=3)
    sidecars, manifest, csv_folder = (tmp_path / n for n in ("txt", "manifest", "csv"))
    expected = {split: read_split(imagefolder, split)[1] for split in ("train", "test")}
    for split, records in expected.items():
        for folder in (sidecars, manifest, csv_folder):
            shutil.copytree(
                imagefolder / split, folder / split, ignore=shutil.ignore_patterns("*.jsonl")
            )
        for name, text in records:
            (sidecars / split / name).with_suffix(".txt").write_text(text + "\n")
        (manifest / split / "captions.json").write_text(json.dumps(dict(records)))
        rows = "".join(f'{name},"{text}"\n' for name, text in records)
        (csv_folder / split / "metadata.csv").write_text("file_name,text\n" + rows)
    for folder in (sidecars, manifest, csv_folder):
        for split, records in expected.items():
            assert sorted(read_split(folder, split)[1]) == sorted(records), folder.name


def test_a_single_folder_holds_out_every_tenth_image(tmp_path):
    data = write_dataset(tmp_path / "d", train_images=60, test_images=0)
    train, test = (read_split(data / "train", split)[1] for split in ("train", "test"))
    assert len(test) > 0 and len(train) + len(test) == 60
    assert not {name for name, _ in train} & {name for name, _ in test}


def test_imagefolder_reads_as_datasets_does_with_validation_as_the_held_out_split(tmp_path):
    """Users' HF layout gives the records `datasets.load_dataset("imagefolder")` gives, and their
    validation/ folder is the held-out split when there is no test/."""
    data = write_dataset(tmp_path / "d", train_images=6, test_images=3)
    (data / "test").rename(data / "validation")
    loaded = datasets.load_dataset("imagefolder", data_dir=str(data), cache_dir=tmp_path / "hf")
    for split, ours in (("train", "train"), ("validation", "test")):
        rows = loaded[split].cast_column("image", datasets.Image(decode=False))
        theirs = [(Path(r["image"]["path"]).name, r["text"]) for r in rows]
        folder, records = read_split(data, ours)
        assert folder == data / split
        assert sorted(records) == sorted(theirs) and len(records) == len(rows)


def test_a_missing_held_out_folder_is_refused_with_what_to_add(tmp_path):
    data = write_dataset(tmp_path / "d", train_images=3, test_images=1)
    shutil.copytree(data / "test", data / "validation")
    assert read_split(data, "test")[0] == data / "test"  # test/ wins over validation/
    shutil.rmtree(data / "test")
    shutil.rmtree(data / "validation")
    expected = f"{data}: no test/ or validation/ folder beside train/; add one"
    with pytest.raises(DataError, match="^" + re.escape(expected)):
        read_split(data, "test")


BAD_METADATA = [
    ('{"file_name": "00001.png"}', "line 2: no 'text' key"),
    ('{"file_name": "gone.png", "text": "a red square"}', "line 2: image .*gone.png not found"),
    ('{"file_name": "00001.png", "text": "  "}', "line 2: empty caption for 00001.png"),
    ("{not json", "line 2: not JSON"),
]


@pytest.mark.parametrize(("line", "expected"), BAD_METADATA)
def test_bad_metadata_names_the_file_and_line(tmp_path, line, expected):
    data = write_dataset(tmp_path / "d", train_images=3, test_images=1)
    metadata = data / "train" / "metadata.jsonl"
    rows = metadata.read_text().splitlines()
    metadata.write_text("\n".join([rows[0], line, rows[2]]) + "\n")
    with pytest.raises(DataError, match=f"metadata.jsonl, {expected}"):
        read_split(data, "train")


def test_a_missing_caption_column_and_a_missing_txt_are_named(tmp_path):
    data = write_dataset(tmp_path / "d", train_images=3, test_images=1)
    (data / "train" / "metadata.jsonl").unlink()
    (data / "train" / "metadata.csv").write_text("file_name,caption\n00000.png,a cat\n")
    with pytest.raises(DataError, match=r"metadata\.csv: no 'text' column"):
        read_split(data, "train")
    (data / "train" / "metadata.csv").unlink()
    with pytest.raises(DataError, match=r"00000.png: no caption file 00000.txt beside it"):
        read_split(data, "train")


def _without_metadata(tmp_path: Path) -> Path:
    """A train/ folder of 3 images whose captions a test writes in another layout."""
    data = write_dataset(tmp_path / "d", train_images=3, test_images=1)
    (data / "train" / "metadata.jsonl").unlink()
    return data / "train"


BAD_MANIFESTS = [
    ("{not json", "{file}: not JSON (Expecting property name enclosed in double quotes, line 1)"),
    ('["00000.png", "a red square"]', "{file}: expected an object mapping image path -> caption"),
    ('{"00000.png": "a cat", "gone.png": "a dog"}', "{file}, key 'gone.png': image {gone}"),
    ('{"00000.png": "a cat", "00001.png": " "}', "{file}, key '00001.png': empty caption"),
]


@pytest.mark.parametrize(("text", "expected"), BAD_MANIFESTS)
def test_a_bad_manifest_names_the_file_and_key(tmp_path, text, expected):
    folder = _without_metadata(tmp_path)
    (folder / "captions.json").write_text(text)
    expected = expected.format(file=folder / "captions.json", gone=folder / "gone.png")
    with pytest.raises(DataError, match="^" + re.escape(expected)):
        read_split(folder.parent, "train")


BAD_CSV_ROWS = [
    ("gone.png,a red square", "line 3: image {folder}/gone.png not found"),
    ('00001.png,""', "line 3: empty caption for 00001.png"),
    ("00001.png", "line 3: empty caption for 00001.png"),  # the text cell is missing
]


@pytest.mark.parametrize(("row", "expected"), BAD_CSV_ROWS)
def test_a_bad_metadata_csv_row_names_the_file_and_line(tmp_path, row, expected):
    folder = _without_metadata(tmp_path)
    (folder / "metadata.csv").write_text(f"file_name,text\n00000.png,a cat\n{row}\n")
    expected = f"{folder / 'metadata.csv'}, {expected.format(folder=folder)}"
    with pytest.raises(DataError, match="^" + re.escape(expected)):
        read_split(folder.parent, "train")


@pytest.mark.parametrize(
    "others", [["metadata.csv"], ["captions.json"], ["metadata.csv", "captions.json"]]
)
def test_a_folder_with_two_caption_files_names_both_and_reads_neither(tmp_path, others):
    """metadata.jsonl beside metadata.csv (or captions.json): one would be read and the other
    silently ignored, so the folder is refused until one is kept."""
    data = write_dataset(tmp_path / "d", train_images=3, test_images=1)
    folder = data / "train"
    if "metadata.csv" in others:
        (folder / "metadata.csv").write_text("file_name,text\n00000.png,a cat\n")
    if "captions.json" in others:
        (folder / "captions.json").write_text(json.dumps({"00000.png": "a cat"}))
    named = {
        1: f"both metadata.jsonl and {others[0]}",
        2: "metadata.jsonl, metadata.csv and captions.json",
    }[len(others)]
    other = "other" if len(others) == 1 else "others"
    expected = (
        f"{folder}: holds {named}, and only one of them would be read; keep the one with the "
        f"captions to train on and move the {other} out of the folder"
    )
    with pytest.raises(DataError) as raised:
        read_split(data, "train")
    assert str(raised.value) == expected


def test_an_empty_txt_caption_names_the_txt_file(tmp_path):
    folder = _without_metadata(tmp_path)
    for name, text in (("00000", "a cat"), ("00001", "\n"), ("00002", "a dog")):
        (folder / f"{name}.txt").write_text(text)
    with pytest.raises(DataError, match=f"^{re.escape(str(folder / '00001.txt'))}: empty caption"):
        read_split(folder.parent, "train")


def test_a_caption_over_max_tokens_names_its_image(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    folder = _without_metadata(tmp_path)
    records = [("00000.png", "a cat"), ("00001.png", "a red square left of a blue circle")]
    tokenizer = train_tokenizer([text for _, text in records])
    expected = f"{folder / '00001.png'}: its caption has 10 tokens with [BOS]/[EOS], more than "
    expected += "--max-tokens 9; raise it"
    for _ in range(2):  # the failed preparation left no cache behind that would hide the error
        with pytest.raises(DataError, match="^" + re.escape(expected) + "$"):
            caption_data.prepare_split(folder, records, tokenizer, 8, max_tokens=9)


def test_preparation_is_cached_and_rebuilt_when_an_image_or_the_size_changes(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    data = write_dataset(tmp_path / "d", train_images=4, test_images=1)
    folder, records = read_split(data, "train")
    tokenizer = train_tokenizer([text for _, text in records])
    decoded = []
    read_rgb = caption_data.read_rgb

    def counted(path: Path, size: int) -> np.ndarray:
        decoded.append(path.name)
        return read_rgb(path, size)

    monkeypatch.setattr(caption_data, "read_rgb", counted)

    def prepare(size: int = 16) -> tuple[datasets.Dataset, bool, int]:
        decoded.clear()
        prepared, _, cached = caption_data.prepare_split(
            folder, records, tokenizer, size, max_tokens=24
        )
        return prepared, cached, len(decoded)

    first, cached, decodes = prepare()
    assert (cached, decodes) == (False, 4)
    again, cached, decodes = prepare()
    assert (cached, decodes) == (True, 0)  # read from the Arrow file, no image decoded
    first, again = first[:], again[:]
    assert again["pixels"].equal(first["pixels"])
    assert [t.tolist() for t in again["tokens"]] == [t.tolist() for t in first["tokens"]]
    smaller, cached, decodes = prepare(size=8)
    assert (cached, decodes, tuple(smaller[:]["pixels"].shape)) == (False, 4, (4, 3, 8, 8))
    touched = folder / records[0][0]
    mtime = touched.stat().st_mtime_ns + 10**9
    os.utime(touched, ns=(mtime, mtime))
    _, cached, decodes = prepare()
    assert (cached, decodes) == (False, 4)


def test_the_saved_tokenizer_adds_bos_eos_pads_with_pad_and_maps_unseen_words_to_unk(tmp_path):
    path = tmp_path / "tokenizer.json"
    captions = ["a red square", "two small green triangles", "a Red circle"]
    train_tokenizer(captions).save(str(path))
    tokenizer = Tokenizer.from_file(str(path))  # as `caption` loads model/tokenizer.json
    vocab = tokenizer.get_vocab()
    assert [vocab[t] for t in ("[PAD]", "[UNK]", "[BOS]", "[EOS]")] == [PAD_ID, 1, 2, 3]
    short, long = tokenizer.encode_batch(["A red square", "two small green triangles"])
    assert short.tokens == ["[BOS]", "a", "red", "square", "[EOS]", "[PAD]"]
    assert short.ids[-1] == 0 and short.attention_mask[-1] == 0
    assert long.tokens == ["[BOS]", "two", "small", "green", "triangles", "[EOS]"]
    unseen = tokenizer.encode("a purple square")
    assert unseen.tokens == ["[BOS]", "a", "[UNK]", "square", "[EOS]"]
    assert tokenizer.decode(long.ids, skip_special_tokens=True) == "two small green triangles"


def test_an_overflow_is_a_skipped_step_that_leaves_the_weights_and_survives_resume(tmp_path):
    """On the CPU through the stand-in scaler; tests/gpu runs the same check on CUDA's fp16."""
    check_overflow_is_skipped_and_resumes(tmp_path, gpu=False)


@pytest.mark.slow
def test_bad_data_stops_the_run_with_one_line_and_exit_code_2(tmp_path):
    data = write_dataset(tmp_path / "d", train_images=8, test_images=2)
    metadata = data / "test" / "metadata.jsonl"
    metadata.write_text(metadata.read_text() + '{"file_name": "lost.png", "text": "a cat"}\n')
    args = ["--data", str(data), "--output-dir", str(tmp_path / "run"), *CAPTIONING_TINY]
    result = run_recipe(args, cwd=tmp_path, script=CAPTIONING, check=False)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: {metadata}, line 3: image {data / 'test' / 'lost.png'} not found"
    ]
    assert not (tmp_path / "run" / "model").exists()


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
