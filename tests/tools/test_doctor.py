"""`accel-recipes doctor`: the pre-launch report, its blockers, and a real gloo all-reduce."""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import socket
import time
from pathlib import Path

import accelerate
import psutil
import pytest
import torch
from typer.testing import CliRunner, Result

from accel_common.batch_lr.batching import BatchRequest
from accel_common.tools.cli import app
from accel_common.tools.doctor import comm as comm_check
from accel_common.tools.doctor.config import CPU_CONFIG, recommend
from tests.processes import REPO, free_port

runner = CliRunner()
CONFIGS = REPO / "accelerate_configs"
NO_GPU = not torch.cuda.is_available()
# everything the doctor judges; each test sets only what it is about
LAUNCH_VARS = (
    "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "CUDA_VISIBLE_DEVICES",
    "NCCL_SOCKET_IFNAME", "NCCL_DEBUG", "GLOO_SOCKET_IFNAME", "ACCELERATE_USE_CPU",
)  # fmt: skip


def launch_env(**env: str) -> dict[str, str | None]:
    """`env` with every other launch variable unset (None unsets it in CliRunner.invoke)."""
    return {**dict.fromkeys(LAUNCH_VARS), **env}


def doctor(*args: str, **env: str) -> tuple[Result, dict]:
    """Run `doctor --json` in a clean launch environment plus `env`; return result and report."""
    result = runner.invoke(app, ["doctor", "--json", *args], env=launch_env(**env))
    assert result.exit_code in (0, 1), result.output
    return result, json.loads(result.stdout)


def messages(report: dict, severity: str = "blocker") -> str:
    return "\n".join(p["message"] for p in report["problems"] if p["severity"] == severity)


def test_report_shows_versions_devices_interfaces_and_launch_variables():
    result, report = doctor("--port", str(free_port()), NCCL_DEBUG="INFO")
    versions = report["versions"]
    assert versions["torch"] == torch.__version__
    assert versions["accelerate"] == accelerate.__version__
    assert versions["python"] == platform.python_version()
    if NO_GPU:
        assert versions["nccl"].startswith("not available")
        assert report["devices"]["cuda"] == []
    assert report["devices"]["cpu_cores"] == os.cpu_count()
    assert "lo" in [nic["name"] for nic in report["interfaces"]]
    assert report["environment"]["NCCL_DEBUG"] == "INFO"
    assert report["environment"]["WORLD_SIZE"] is None
    assert report["problems"] == [] and result.exit_code == 0

    text = runner.invoke(
        app, ["doctor", "--port", str(free_port())], env=launch_env(NCCL_DEBUG="INFO")
    )
    flat = " ".join(text.output.split())
    assert "NCCL_DEBUG │ INFO" in flat and "WORLD_SIZE │ unset" in flat
    assert torch.__version__ in flat


def test_an_interface_that_does_not_exist_is_a_blocker_naming_it():
    result, report = doctor(NCCL_SOCKET_IFNAME="doesnotexist0")
    assert "NCCL_SOCKET_IFNAME=doesnotexist0 matches no network interface" in messages(report)
    assert result.exit_code == 1
    # NCCL reads prefixes, `=` exact names and `^` exclusions: none of these is a problem
    for value in ("l", "=lo", "^docker", "doesnotexist0,lo"):
        _, report = doctor(NCCL_SOCKET_IFNAME=value)
        assert "NCCL_SOCKET_IFNAME" not in messages(report), value
    _, report = doctor(GLOO_SOCKET_IFNAME="lo,doesnotexist1")
    assert "GLOO_SOCKET_IFNAME=lo,doesnotexist1" in messages(report)
    assert "doesnotexist1" in messages(report).split("exist here:")[1]


def test_a_port_in_use_is_a_blocker_that_names_its_owner_and_a_free_one_is_free():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        result, report = doctor("--port", str(port), "--addr", "127.0.0.1")
        assert result.exit_code == 1
        assert report["port"]["free"] is False
        assert f"pid {os.getpid()}" in report["port"]["owner"]
        problem = next(p for p in report["problems"] if f"port {port} is in use" in p["message"])
        assert "--main_process_port" in problem["advice"] and f":{port}" in problem["advice"]
    result, report = doctor("--port", str(port), "--addr", "127.0.0.1")
    assert report["port"] == {
        "addr": "127.0.0.1",
        "port": port,
        "free": True,
        "addr_is_local": True,
        "source": "--port",
    }
    assert result.exit_code == 0, report["problems"]
    _, report = doctor(MASTER_PORT=str(port))
    assert (report["port"]["port"], report["port"]["source"]) == (port, "MASTER_PORT")


@pytest.mark.parametrize("value", ["99999", "0", "29500x"])
def test_a_master_port_that_is_not_a_port_is_one_line_naming_it_and_the_range(value):
    result = runner.invoke(app, ["doctor"], env=launch_env(MASTER_PORT=value))
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [
        f"error: MASTER_PORT={value} is not a port: give a whole number from 1 to 65535 (above "
        "1024 without root), or leave it unset for the default 29500"
    ]


def test_a_config_port_that_is_not_a_port_is_one_line_naming_it(tmp_path: Path):
    config = tmp_path / "port.yaml"
    text = (CONFIGS / CPU_CONFIG).read_text()
    config.write_text(text.replace("main_process_port: 29511", "main_process_port: 70000"))
    result = runner.invoke(app, ["doctor", "--config-file", str(config)], env=launch_env())
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [
        f"error: --config-file {config}: main_process_port: 70000: give a port from 1 to 65535 "
        "(above 1024 without root)"
    ]


def test_world_size_that_disagrees_with_the_config_is_flagged():
    config = str(CONFIGS / "8gpu.yaml")
    result, report = doctor("--config-file", config, WORLD_SIZE="4")
    assert "WORLD_SIZE=4 in the environment, but 8gpu.yaml starts num_processes=8" in messages(
        report
    )
    assert result.exit_code == 1
    assert report["config"]["num_processes"] == 8
    if torch.cuda.device_count() < 8:  # and a GPU config on a machine without enough GPUs
        assert "8gpu.yaml" in messages(report) and "GPU(s)" in messages(report)
    _, report = doctor("--config-file", config, WORLD_SIZE="8")
    assert "WORLD_SIZE" not in messages(report)
    # multi-node: num_processes counts every machine; a loopback head address cannot work
    _, report = doctor("--config-file", str(CONFIGS / "multinode_2x8.yaml"), WORLD_SIZE="16")
    assert "WORLD_SIZE" not in messages(report)
    assert "main_process_ip is 127.0.0.1" in messages(report, "warning")


@pytest.mark.skipif(not NO_GPU, reason="the CPU recommendation needs a machine without GPUs")
def test_cpu_only_recommends_two_cpu_processes_with_a_batch_plan():
    _, report = doctor("--bs", "64")
    rec = report["recommendation"]
    assert rec["config"] == f"accelerate_configs/{CPU_CONFIG}"
    assert rec["batch"] == {
        "global_batch_size": 64,
        "per_device_batch_size": 32,
        "num_processes": 2,
        "grad_accum_steps": 1,
    }
    assert f"--config_file accelerate_configs/{CPU_CONFIG} recipes/" in rec["command"]
    # the shipped config is usable as it is here, and a GPU config is not
    _, report = doctor("--config-file", str(CONFIGS / CPU_CONFIG))
    assert messages(report) == ""
    _, report = doctor("--config-file", str(CONFIGS / "2gpu.yaml"))
    assert "2gpu.yaml asks for 2 GPU(s) per machine, but none is visible" in messages(report)
    result, report = doctor("--check-comm", "--backend", "nccl")
    assert "--backend nccl with 2 processes needs 2 GPUs; 0 visible" in messages(report)
    assert result.exit_code == 1 and report["comm"]["ok"] is False
    bad = runner.invoke(app, ["doctor", "--bs", "63"])
    assert bad.exit_code == 2 and "cannot be split evenly over 2 processes" in bad.output


def test_recommendation_picks_the_nearest_gpu_config_and_spells_out_the_override():
    exact = recommend(8, False, BatchRequest(per_device_batch_size=16))
    assert exact["config"].endswith("/8gpu.yaml") and "--num_processes" not in exact["command"]
    assert exact["batch"]["global_batch_size"] == 128
    three = recommend(3, False, BatchRequest(96))
    assert three["config"].endswith("/2gpu.yaml") and "--num_processes 3 " in three["command"]
    assert three["batch"]["per_device_batch_size"] == 32
    many = recommend(16, False, BatchRequest())
    assert many["config"].endswith("/8gpu.yaml") and "--num_processes 16 " in many["command"]
    assert recommend(1, False, BatchRequest())["config"].endswith("/1gpu.yaml")


def test_hiding_every_gpu_is_reported():
    _, report = doctor(CUDA_VISIBLE_DEVICES="")
    assert "CUDA_VISIBLE_DEVICES=''" in messages(report, "warning")


def test_an_unknown_config_file_is_a_clear_error(tmp_path: Path):
    missing = tmp_path / "nope.yaml"
    result = runner.invoke(app, ["doctor", "--config-file", str(missing)])
    assert result.exit_code == 2
    assert f"--config-file {missing}: no such file" in result.output
    assert CPU_CONFIG in result.output
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    bad = runner.invoke(app, ["doctor", "--config-file", str(tmp_path / "list.yaml")])
    assert bad.exit_code == 2 and "not an accelerate config" in bad.output


def test_a_folder_given_as_the_config_file_is_named_a_folder_with_the_yaml_inside(tmp_path):
    (tmp_path / "configs").mkdir()
    for name in ("b.yaml", "a.yaml", "notes.txt"):
        (tmp_path / "configs" / name).write_text("num_processes: 1\n")
    result = runner.invoke(app, ["doctor", "--config-file", str(tmp_path / "configs")])
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        f"error: --config-file {tmp_path / 'configs'}: a folder, not a config file; give the YAML "
        f"file inside it: {tmp_path / 'configs' / 'a.yaml'}, {tmp_path / 'configs' / 'b.yaml'}"
    ]
    empty = runner.invoke(app, ["doctor", "--config-file", str(tmp_path)])
    assert empty.exit_code == 2 and len(empty.stderr.splitlines()) == 1
    assert f"--config-file {tmp_path}: a folder with no .yaml file in it" in empty.stderr
    assert CPU_CONFIG in empty.stderr


def test_a_python_tag_in_the_config_is_a_blocker_naming_the_bare_launchers_traceback(tmp_path):
    tagged = tmp_path / "tagged.yaml"
    tagged.write_text("num_processes: !!python/object/apply:os.getpid []\n")
    result, report = doctor("--config-file", str(tagged))
    assert result.exit_code == 1
    (problem,) = [p for p in report["problems"] if "tagged.yaml" in p["message"]]
    assert problem["severity"] == "blocker"
    assert "python/object/apply:os.getpid' at line 1" in problem["message"]
    assert "a bare `accelerate launch` stops on it with a traceback" in problem["message"]
    assert "remove the tag" in problem["advice"] and "accel-recipes launch --" in problem["advice"]


def test_a_deepspeed_config_without_deepspeed_names_the_bare_launchers_traceback(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "deepspeed" else find_spec(name, *a),
    )
    _, report = doctor("--config-file", str(CONFIGS / "deepspeed_zero2_8gpu.yaml"))
    (problem,) = [p for p in report["problems"] if "needs DeepSpeed" in p["message"]]
    assert problem["severity"] == "blocker"
    assert "a bare `accelerate launch` stops with an ImportError traceback" in problem["message"]
    assert "pip install deepspeed" in problem["advice"]
    assert "accel-recipes launch -- accelerate launch" in problem["advice"]


def test_a_multi_process_cpu_config_warns_that_own_scripts_need_accelerate_use_cpu():
    config = str(CONFIGS / CPU_CONFIG)
    result, report = doctor("--config-file", config)
    assert result.exit_code == 0
    warning = messages(report, "warning")
    assert f"{CPU_CONFIG}: a bare `accelerate launch` starts 2 workers without telling" in warning
    assert "2 separate one-process jobs" in warning
    (advice,) = [p["advice"] for p in report["problems"] if CPU_CONFIG in p["message"]]
    assert f"accel-recipes launch -- accelerate launch --config_file {config}" in advice
    _, report = doctor("--config-file", config, ACCELERATE_USE_CPU="true")
    assert CPU_CONFIG not in messages(report, "warning")
    _, report = doctor("--config-file", str(CONFIGS / "1cpu.yaml"))  # its launcher tells it
    assert "1cpu.yaml" not in messages(report, "warning")


@pytest.mark.dist
def test_check_comm_runs_a_real_gloo_all_reduce_and_reports_bandwidth():
    args = ["--check-comm", "--backend", "gloo", "--nproc", "2", "--sizes-mb", "0.25,1"]
    result, report = doctor(*args, "--iters", "3")
    comm = report["comm"]
    assert comm["ok"] is True, comm
    assert result.exit_code == 0, report["problems"]
    assert comm["latency_us"] > 0
    assert [row["bytes"] for row in comm["sizes"]] == [2**18, 2**20]
    for row in comm["sizes"]:
        assert row["algbw_gbps"] > 0
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"])  # 2 (n-1) / n = 1 for n = 2


@pytest.mark.dist
def test_check_comm_failure_is_caught_and_reported_with_advice():
    args = ["--check-comm", "--backend", "gloo", "--nproc", "2", "--sizes-mb", "0.25"]
    result, report = doctor(*args, "--dist-timeout", "20", GLOO_SOCKET_IFNAME="doesnotexist0")
    assert result.exit_code == 1
    assert report["comm"]["ok"] is False
    failure = next(p for p in report["problems"] if "all-reduce failed" in p["message"])
    assert "doesnotexist0" in failure["message"]
    assert "GLOO_SOCKET_IFNAME" in failure["advice"] and "--dist-timeout" in failure["advice"]


@pytest.mark.dist
def test_check_comm_that_runs_past_its_deadline_is_stopped_and_reported(monkeypatch):
    monkeypatch.setattr(comm_check, "STARTUP_ALLOWANCE_S", 0.0)  # workers are still importing
    # children that other tests of this pytest process left (e.g. a DataLoader's workers) are
    # not check_comm's
    earlier = {c.pid for c in psutil.Process().children()}
    started = time.monotonic()
    result, problems = comm_check.check_comm("gloo", 2, (0.25,), 1, timeout_s=1.0)
    assert time.monotonic() - started < 30
    assert result["ok"] is False and "timed out" in result["error"]
    assert "--dist-timeout" in problems[0].advice
    workers = [
        c
        for c in psutil.Process().children()
        if c.pid not in earlier
        and c.status() != psutil.STATUS_ZOMBIE
        and "resource_tracker" not in " ".join(c.cmdline())
    ]
    assert workers == []  # killed, not left running (the tracker is multiprocessing's own)
