"""Launches the recipes must refuse, or tell apart, before they train: a GPU config on a machine
without GPUs (issue 27, case 1), and what the launcher asked for as a worker can tell it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
import yaml

from accel_common.errors import ConfigError, DataError
from accel_common.hardware import launch_guard
from accel_common.tools.doctor.config import check_config
from tests.processes import ACCELERATE_LAUNCH, BIN, REPO, TEMPLATE, free_port, recipe_env

CONFIGS = REPO / "accelerate_configs"
no_gpu = pytest.mark.skipif(torch.accelerator.is_available(), reason="needs a machine without GPUs")


# --------------------------------------------------------------------------- GPU configs on a CPU


@no_gpu
@pytest.mark.dist
@pytest.mark.parametrize("through", ["accelerate", "accel-recipes"])
def test_a_gpu_config_on_a_machine_without_gpus_is_refused_before_anything_is_written(
    through, tmp_path, template_data
):
    """`accelerate launch --config_file 2gpu.yaml` on a CPU machine used to train 2 CPU
    processes and exit 0 (the guard read ACCELERATE_USE_CPU, which its workers never get)."""
    out = tmp_path / "run"
    launch = [*ACCELERATE_LAUNCH, "--config_file", str(CONFIGS / "2gpu.yaml")]
    launch += ["--main_process_ip", "127.0.0.1", "--main_process_port", str(free_port())]
    if through == "accel-recipes":
        launch = [str(BIN / "accel-recipes"), "launch", "--", *launch]
    launch += [str(TEMPLATE), "--data", str(template_data), "--output-dir", str(out)]
    launch += ["--epochs", "1", "--hidden", "8", "--depth", "1", "--bs", "256"]
    result = subprocess.run(
        launch, cwd=tmp_path, env=recipe_env(tmp_path), capture_output=True, text=True, timeout=300
    )
    # the workers' user-error code; bare `accelerate launch` turns any failure into 1
    assert result.returncode == (2 if through == "accel-recipes" else 1), result.stderr
    refusal = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert refusal == [
        "error: this launch asks for 2 GPUs (config 2gpu.yaml): none is visible, so every "
        "process would train on the CPU; use accelerate_configs/cpu_2proc.yaml (or "
        "ACCELERATE_USE_CPU=true accelerate launch ...) on a CPU, or launch on a machine with GPUs"
    ], result.stderr
    assert "MULTI_CPU" not in result.stdout  # no banner: nothing started
    assert not out.exists()  # no output folder, no checkpoint, no export


class FakeLauncher:
    """The parent process a worker reads its launch request from."""

    def __init__(self, cmdline: list[str], cwd: Path) -> None:
        self._cmdline, self._cwd = cmdline, cwd

    def cmdline(self) -> list[str]:
        return self._cmdline

    def cwd(self) -> str:
        return str(self._cwd)


def as_worker(monkeypatch, tmp_path: Path, cmdline: list[str], world: int = 2) -> None:
    """This process as rank 0 of a `world`-process launch started by `cmdline`, without GPUs."""
    monkeypatch.setattr(
        launch_guard.psutil, "Process", lambda _pid: FakeLauncher(cmdline, tmp_path)
    )
    monkeypatch.setattr("torch.accelerator.is_available", lambda: False)
    for key, value in {"WORLD_SIZE": str(world), "LOCAL_RANK": "0", "RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    # no default config of the user's own
    monkeypatch.setattr(
        launch_guard, "default_accelerate_config", lambda: str(tmp_path / "none.yaml")
    )


ACCELERATE = ["/venv/bin/python", "/venv/bin/accelerate", "launch"]
SCRIPT = ["recipes/train_template.py", "--epochs", "1"]


@pytest.mark.parametrize(
    ("launcher", "refused"),
    [
        ([*ACCELERATE, "--config_file", str(CONFIGS / "8gpu.yaml"), *SCRIPT], "config 8gpu.yaml"),
        ([*ACCELERATE, "--config-file=accelerate_configs/2gpu.yaml", *SCRIPT], "config 2gpu.yaml"),
        (["python", "-m", "accelerate.commands.launch", "--multi_gpu", *SCRIPT], "--multi_gpu"),
        (
            [*ACCELERATE, "--config_file", str(CONFIGS / "fsdp_8gpu.yaml"), *SCRIPT],
            "config fsdp_8gpu",
        ),
        ([*ACCELERATE, "--config_file", str(CONFIGS / "cpu_2proc.yaml"), *SCRIPT], None),
        ([*ACCELERATE, "--config_file", str(CONFIGS / "8gpu.yaml"), "--cpu", *SCRIPT], None),
        (["torchrun", "--nproc-per-node", "2", *SCRIPT], None),  # no accelerate config to read
        # a GPU config's name among the script's own arguments is not the launcher's
        ([*ACCELERATE, "--multi_gpu", "--cpu", *SCRIPT, "--config_file", "8gpu.yaml"], None),
    ],
    ids=["8gpu", "2gpu", "multi_gpu", "fsdp", "cpu_2proc", "cpu", "torchrun", "script-args"],
)
def test_what_the_launcher_asked_for_is_read_from_its_command_line(
    launcher, refused, monkeypatch, tmp_path
):
    (tmp_path / "accelerate_configs").mkdir()
    (tmp_path / "accelerate_configs" / "2gpu.yaml").write_text((CONFIGS / "2gpu.yaml").read_text())
    as_worker(monkeypatch, tmp_path, launcher)
    if refused is None:
        launch_guard.require_requested_devices(cpu=True)
        return
    with pytest.raises(ConfigError, match=rf"^this launch asks for 2 GPUs \({refused}.*\): none"):
        launch_guard.require_requested_devices(cpu=True)


def test_accelerate_use_cpu_from_the_user_keeps_a_multi_gpu_launch_on_the_cpu(
    monkeypatch, tmp_path
):
    """`ACCELERATE_USE_CPU=true accelerate launch --multi_gpu`: the variable reaches the workers."""
    as_worker(monkeypatch, tmp_path, [*ACCELERATE, "--multi_gpu", *SCRIPT])
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    launch_guard.require_requested_devices(cpu=True)


def test_the_default_config_counts_when_no_config_file_is_given(monkeypatch, tmp_path):
    as_worker(monkeypatch, tmp_path, [*ACCELERATE, *SCRIPT])
    default = tmp_path / "default_config.yaml"
    default.write_text((CONFIGS / "2gpu.yaml").read_text())
    monkeypatch.setattr(launch_guard, "default_accelerate_config", lambda: str(default))
    with pytest.raises(ConfigError, match=r"asks for 2 GPUs \(config default_config.yaml"):
        launch_guard.require_requested_devices(cpu=True)


def test_plain_python_is_never_refused(monkeypatch, tmp_path):
    as_worker(monkeypatch, tmp_path, [*ACCELERATE, "--config_file", "8gpu.yaml", *SCRIPT])
    monkeypatch.delenv("LOCAL_RANK")
    launch_guard.require_requested_devices(cpu=True)  # no launcher: nothing was asked for


def as_one_process_worker(monkeypatch, tmp_path: Path, config: str, use_cpu: str) -> None:
    """This process as `accelerate launch --config_file CONFIG`'s one process: its simple launcher
    sets no LOCAL_RANK or WORLD_SIZE, but ACCELERATE_USE_CPU from the config (True or False)."""
    as_worker(monkeypatch, tmp_path, [*ACCELERATE, "--config_file", str(CONFIGS / config), *SCRIPT])
    for key in ("WORLD_SIZE", "LOCAL_RANK", "RANK"):
        monkeypatch.delenv(key)
    monkeypatch.setenv("ACCELERATE_USE_CPU", use_cpu)


def test_one_gpu_config_on_a_cpu_is_refused_like_the_multi_gpu_ones(monkeypatch, tmp_path):
    """1gpu.yaml without a GPU used to train on the CPU in bf16 and exit 0."""
    as_one_process_worker(monkeypatch, tmp_path, "1gpu.yaml", "False")
    with pytest.raises(ConfigError) as refused:
        launch_guard.require_requested_devices(cpu=True)
    assert str(refused.value).startswith(
        "this launch asks for 1 GPU (config 1gpu.yaml): none is visible, so every process would "
        "train on the CPU; use accelerate_configs/1cpu.yaml"
    )
    as_one_process_worker(monkeypatch, tmp_path, "1cpu.yaml", "True")
    launch_guard.require_requested_devices(cpu=True)


@pytest.mark.parametrize("config", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_the_doctor_calls_a_blocker_exactly_what_a_launch_refuses(config, monkeypatch, tmp_path):
    """`accel-recipes doctor --config-file` and the recipes' launch guard agree on every config
    shipped: one that asks for GPUs (one or several), on a machine without any."""
    settings = yaml.safe_load(config.read_text())
    _, problems = check_config(settings, config, {}, gpus=0, ipv4=[])
    blocked = any("but none is visible" in p.message for p in problems if p.severity == "blocker")
    world = int(settings.get("num_processes", 1))
    as_worker(monkeypatch, tmp_path, [*ACCELERATE, "--config_file", str(config), *SCRIPT], world)
    try:
        launch_guard.require_requested_devices(cpu=True)
        refused = False
    except ConfigError:
        refused = True
    assert blocked == launch_guard.config_asks_for_gpus(settings)
    assert refused == blocked
    assert blocked == (config.name not in ("1cpu.yaml", "cpu_2proc.yaml"))


def test_an_output_file_is_checked_and_its_folder_made_before_the_work(tmp_path):
    """Every single-device command's --out: an existing file is refused, a path under a file is
    one line naming the flag (it used to crash after the work, at the write), and the folder of
    a new one exists afterwards."""
    mine = tmp_path / "notes.txt"
    mine.write_text("mine")
    with pytest.raises(DataError, match=r"--out .*notes.txt exists"):
        launch_guard.require_new_file(mine)
    with pytest.raises(DataError, match=r"--png .*notes.txt/deeper/view.png: .*is a file"):
        launch_guard.require_new_file(mine / "deeper" / "view.png", "--png")
    assert mine.read_text() == "mine"
    out = tmp_path / "new" / "folder" / "scores.csv"
    launch_guard.require_new_file(out)
    assert out.parent.is_dir() and not out.exists()
