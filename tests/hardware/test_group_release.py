"""A finished 2-process launch frees its process group before the interpreter exits.

torch 2.14.1 keeps the destroyed default group alive (function defaults of
torch.distributed.nn.functional, DTensor's caches), and with it gloo's threads, into Python's
finalisation, where a gloo thread releasing a tensor aborted a finished worker now and then
("terminate called without an active exception", SIGABRT; CI's FSDP check row, 1 run in 100 of
a short DDP job under load). With collectives left in flight at the end, as here, the abort came
in about half the runs. `make_accelerator` has the group freed at exit (group_release)."""

from __future__ import annotations

import re
import subprocess

import pytest

from tests.processes import launch_command, recipe_env

# a launched worker's end as the recipes have it (make_accelerator, DDP, end_training, all in the
# training function), plus collectives left in flight; its own atexit handler, registered first,
# runs last and reports the gloo threads still alive after every other one
SCRIPT = """\
import atexit, importlib, os, tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from accel_common.batch_lr.batching import BatchRequest
from accel_common.hardware.accelerator import make_accelerator
from accel_common.hardware.group_release import gloo_threads

rank = os.environ["RANK"]
atexit.register(lambda: print(f"rank {rank} at exit: gloo threads {gloo_threads()}", flush=True))


def train():
    out = Path(tempfile.mkdtemp())
    accelerator, plan = make_accelerator(output_dir=out, batch=BatchRequest(2), cpu=True)
    model = accelerator.prepare(torch.nn.Linear(64, 1))
    for _ in range(2):
        accelerator.backward(model(torch.randn(4, 64)).sum())
    # after the group exists, as DDP and DCP import it: its functions' defaults hold the group
    importlib.import_module("torch.distributed.nn")

    works = [dist.all_reduce(torch.randn(1 << 16), async_op=True) for _ in range(4)]
    del works
    accelerator.end_training()


train()
print(f"rank {rank} trained; gloo threads {gloo_threads()}", flush=True)
"""


@pytest.mark.dist
def test_a_finished_launch_frees_its_group_before_python_exits(tmp_path):
    script = tmp_path / "ends.py"
    script.write_text(SCRIPT)
    result = subprocess.run(
        launch_command(script, [], 2), cwd=tmp_path, env=recipe_env(tmp_path),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    # end_training destroyed the group, but torch still holds it (`trained; gloo threads [...]`):
    # freed at exit, before Python finalises, no gloo thread is left to abort the worker
    # unanchored: under PYTHONUNBUFFERED print writes the text and its newline apart, so the two
    # ranks' lines may come out run together
    ends = sorted(re.findall(r"rank \d at exit: gloo threads \[[^\]]*\]", result.stdout))
    assert ends == [f"rank {rank} at exit: gloo threads []" for rank in (0, 1)], result.stdout
