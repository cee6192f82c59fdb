"""What the checkpoint manifest costs: hashing every file at save, verifying it at resume.

The largest preset's checkpoint (pointcloud's configs/original.yaml, pcdiff's PVCNN2: the preset
with the most parameters, so the largest model + AdamW state) is saved with
`accelerator.save_state` as a run saves it; then the manifest is written (`write_manifest`: size
and SHA-256 of every file) and verified as a resume verifies it (`verify_files` with hashes, the
main process's share). Medians of `--repeats`, interleaved (save, manifest, verify) so machine
noise falls on all three alike; the ratio to the save is the claim. Run with `make bench` (it
rewrites only its own section of docs/BENCHMARKS.md); `--smoke` uses the recipe's CPU-size
model, for CI.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from accelerate import Accelerator

from accel_common.checkpoints.checkpoint_files import read_manifest, verify_files, write_manifest
from accel_common.tools.bench.report import write_section

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.original_sizes import preset_model

SECTION_START = (
    "<!-- checkpoint-manifest benchmark: written by benchmarks/bench_checkpoint_manifest.py -->"
)
SECTION_END = "<!-- end of checkpoint-manifest benchmark -->"
RECIPE = "pointcloud"  # the preset (configs/original.yaml) with the most parameters: 27.6M


def checkpointed_model(smoke: bool) -> tuple[Accelerator, int]:
    """The preset's model and an AdamW with its state allocated, prepared as a run prepares
    them; the parameter count."""
    model = preset_model(RECIPE, smoke=smoke)
    optimizer = torch.optim.AdamW(model.parameters())
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()  # allocates both moments: the checkpoint's full size
    accelerator = Accelerator(cpu=True)
    accelerator.prepare(model, optimizer)
    return accelerator, sum(p.numel() for p in model.parameters())


def timed(action: Callable[..., object], *args: object) -> float:
    started = time.perf_counter()
    action(*args)
    return time.perf_counter() - started


def measure(smoke: bool, repeats: int) -> dict[str, float]:
    accelerator, parameters = checkpointed_model(smoke)
    save, manifest, verify, size = [], [], [], 0
    with tempfile.TemporaryDirectory() as root:
        for repeat in range(repeats):
            folder = Path(root) / f"step_{repeat}"
            save.append(timed(accelerator.save_state, str(folder)))
            manifest.append(timed(write_manifest, folder, {"progress": {}}))
            record = read_manifest(folder)
            assert record is not None
            verify.append(timed(verify_files, folder, record))
            size = sum(entry["size"] for entry in record["files"].values())
    return {
        "parameters": parameters,
        "bytes": size,
        "save": statistics.median(save),
        "manifest": statistics.median(manifest),
        "verify": statistics.median(verify),
    }


def report(numbers: dict[str, float], smoke: bool, repeats: int) -> str:
    what = f"{RECIPE} at its {'CPU-size defaults (smoke)' if smoke else 'original preset'}"
    save, manifest, verify = numbers["save"], numbers["manifest"], numbers["verify"]
    return f"""{SECTION_START}
## Checkpoint manifest: its cost at save and at resume

Reproduce with `python benchmarks/bench_checkpoint_manifest.py` (also run by `make bench`).
The largest preset's checkpoint, {what}: {numbers["parameters"] / 1e6:.1f}M parameters, model +
AdamW state + RNG = {numbers["bytes"] / 2**20:.0f} MiB, saved by `accelerator.save_state`. Then
`manifest.json` is written (size and SHA-256 of every file) and verified as a resume verifies it
(the main process hashes every file). Medians of {repeats} interleaved repeats; one thread;
{platform.processor() or platform.machine()}, {os.cpu_count()} cores, load average
{os.getloadavg()[0]:.1f} at the end, {datetime.date.today()}.

| step | seconds | vs the save |
| --- | ---: | ---: |
| `accelerator.save_state` | {save:.3f} | 1.00 |
| `write_manifest` (at save) | {manifest:.3f} | {manifest / save:.2f} |
| `verify_files` (at resume) | {verify:.3f} | {verify / save:.2f} |

Hashing (SHA-256, the fastest of hashlib's digests where the CPU has SHA instructions) reads what
the save has just written, from the page cache here; on a network disk it reads it back once
more. Saved every few hundred steps, that is a small share of a run; at resume it is paid once.
{SECTION_END}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the section into this Markdown file")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="the recipe's CPU-size model")
    args = parser.parse_args()
    numbers = measure(args.smoke, args.repeats)
    text = report(numbers, args.smoke, args.repeats)
    print(text)
    if args.out is not None:
        write_section(args.out, text, SECTION_START, SECTION_END)


if __name__ == "__main__":
    main()
