"""Peak memory of a quality run against the number of images: the images stream from disk
through the data loader (recipes/quality/data.py ImageReader), so the peak should stay flat.

    python benchmarks/quality_memory.py 10000 100000

For each N: N generated 32x32 PNGs and N comparisons by one annotator in the original's layout
(in a temporary folder), then a short run (--max-steps 10, one epoch, which ends by scoring every
image) in a child process; prints the child's peak resident memory (ru_maxrss).
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parents[1]


def write_set(root: Path, count: int) -> None:
    rng = np.random.default_rng(0)
    (root / "images").mkdir(parents=True)
    names = []
    for k in range(count):
        name = f"img_{k:06d}.png"
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(
            root / "images" / name
        )
        names.append(name)
    pairs = rng.integers(0, count, size=(count, 2))
    records = [
        {"img1": names[i], "img2": names[j], "choice": "left" if i < j else "right"}
        for i, j in pairs
        if i != j
    ]
    (root / "annotator").mkdir()
    (root / "annotator" / "comparison_data.json").write_text(json.dumps({"comparisons": records}))


def peak_rss(count: int) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "data"
        write_set(root, count)
        args = [sys.executable, str(REPO / "recipes" / "train_quality.py"), "--data", str(root)]
        args += ["--output-dir", str(Path(tmp) / "run"), "--max-steps", "10", "--epochs", "1"]
        args += ["--workers", "2"]
        start = time.perf_counter()
        subprocess.run(args, check=True, capture_output=True, cwd=tmp)
        seconds = time.perf_counter() - start
    # the largest child's peak (KiB on Linux): the trainer's process, not its workers summed
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, seconds


if __name__ == "__main__":
    for n in map(int, sys.argv[1:] or ["10000", "100000"]):
        rss, seconds = peak_rss(n)
        print(f"{n} images: peak RSS {rss:.0f} MiB (largest process so far), run {seconds:.0f} s")
