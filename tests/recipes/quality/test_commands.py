"""The quality recipe's single-device commands (`score`, `compare`; `export-onnx` against the
original in test_original.py) on an export: what they read and write.
"""

from __future__ import annotations

import os
from pathlib import Path

from PIL import Image

from accel_common.export import write_export
from recipes.quality.commands import compare, score_folder
from recipes.quality.model import QualityScorer

NOT_UTF8 = os.fsdecode(b"\xff")  # a file name whose bytes are not UTF-8, as Python holds it


def tiny_export(folder: Path) -> Path:
    """An untrained export, as training writes it (no training: the `score` and `compare`
    commands' reading and writing is what is tested)."""
    config = {"backbone": "test_efficientnet_gn", "image_size": 8, "dropout": 0.2}
    config |= {"annotators": ["hitul"]}
    model = QualityScorer(config["backbone"], 1, config["dropout"])
    write_export(model.state_dict(), folder, {"recipe": "quality", "config": config})
    return folder


def test_an_image_whose_name_is_not_utf8_is_scored_and_compared_under_its_name(
    tmp_path, capfdbinary
):
    """Before: score's CSV and compare's printout stopped with UnicodeEncodeError."""
    images = tmp_path / "images"
    images.mkdir()
    for name in (NOT_UTF8, "plain"):
        Image.new("RGB", (8, 8), "red").save(images / f"{name}.png")
    model = tiny_export(tmp_path / "model")
    out = tmp_path / "scores.csv"
    score_folder(model, images, out, bs=4)
    names = sorted(line.split(b",")[0] for line in out.read_bytes().splitlines()[1:])
    assert names == [b"plain.png", b"\xff.png"]  # the file's own bytes
    capfdbinary.readouterr()
    compare(model, [images / f"{NOT_UTF8}.png", images / "plain.png"], margin=1.0)
    first, second, verdict = capfdbinary.readouterr().out.splitlines()
    assert first.startswith(os.fsencode(images / f"{NOT_UTF8}.png: score "))
    assert second.startswith(os.fsencode(images / "plain.png: score "))
    assert verdict.startswith(b"draw")  # an untrained scorer: the same image, the same score
