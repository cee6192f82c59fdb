"""Our launch configs serve any Accelerate script, not only the recipes: under each CPU config a
plain script (no accel_common) launched as the docs say is one N-process job."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.processes import ACCELERATE_LAUNCH, BIN, REPO, free_port, recipe_env

# what a ported example does: a bare Accelerator(), no cpu=True, then a collective
PLAIN_SCRIPT = """\
import torch
from accelerate import Accelerator

accelerator = Accelerator()
ones = torch.tensor([accelerator.process_index + 1.0], device=accelerator.device)
total = accelerator.reduce(ones, reduction="sum").item()
print(f"process {accelerator.process_index} of {accelerator.num_processes}: sum {total:g}")
accelerator.end_training()  # as Accelerate's examples end: gloo may abort at exit without it
"""


def cpu_configs() -> list[Path]:
    """Every shipped accelerate config that runs on the CPU (`use_cpu: true`), read from the
    files themselves, so a CPU config added later is tested too."""
    configs = sorted((REPO / "accelerate_configs").glob("*.yaml"))
    return [path for path in configs if yaml.safe_load(path.read_text()).get("use_cpu") is True]


@pytest.mark.dist
@pytest.mark.parametrize("config", cpu_configs(), ids=lambda path: path.name)
def test_a_plain_accelerate_script_is_one_job_over_every_process_of_a_cpu_config(tmp_path, config):
    """Before the fix cpu_2proc.yaml's two workers each printed `process 0 of 1: sum 1`."""
    script = tmp_path / "plain.py"
    script.write_text(PLAIN_SCRIPT)
    processes = yaml.safe_load(config.read_text())["num_processes"]
    command = [str(BIN / "accel-recipes"), "launch", "--", *ACCELERATE_LAUNCH]
    command += ["--config_file", str(config), "--main_process_port", str(free_port()), str(script)]
    env = recipe_env(tmp_path)
    env.pop("ACCELERATE_USE_CPU", None)  # what a user's shell has: nothing
    result = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    # unanchored: under PYTHONUNBUFFERED print writes the text and its newline apart, so two
    # workers' lines may come out as "process 0 of 2: sum 3process 1 of 2: sum 3\n\n"
    reports = sorted(re.findall(r"process \d+ of \d+: sum [\d.]+", result.stdout))
    total = processes * (processes + 1) // 2
    assert reports == [f"process {rank} of {processes}: sum {total}" for rank in range(processes)]
