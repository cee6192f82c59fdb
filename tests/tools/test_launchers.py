"""The cluster launchers build the right command on every node, and refuse bad input up front.

scripts/slurm/*.sbatch run as plain bash here, with fake `scontrol`, `srun`, `accelerate` and
`torchrun` first on PATH. The fakes behave like the real ones where the scripts depend on it:
`scontrol show hostnames` expands a nodelist, `srun` starts one task per node (concurrently),
with SLURM_NODEID/SLURM_PROCID set and output in the per-node file its --output pattern names,
and the launchers record their argv. The last test starts a real two-"node" job on this machine
(c10d rendezvous, 2 CPU processes over gloo) through the same scripts, so the command line is
proven to work, not only to look right.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.processes import BIN, REPO, free_port, recipe_env
from tests.results import metrics_log

SBATCH_MULTI = REPO / "scripts" / "slurm" / "train_multinode.sbatch"
SBATCH_1NODE = REPO / "scripts" / "slurm" / "train_1node.sbatch"
NODE_SH = REPO / "scripts" / "slurm" / "node.sh"
TORCHRUN_SH = REPO / "scripts" / "torchrun_multinode.sh"
MULTINODE_YAML = "accelerate_configs/multinode_2x8.yaml"

FAKE_SCONTROL = """
import json, os, re, sys
if sys.argv[1:2] == ["requeue"]:
    with open(os.environ["FAKE_LOG"], "a") as log:
        log.write(json.dumps({"prog": "scontrol", "argv": sys.argv[1:]}) + "\\n")
    sys.exit(0)
if sys.argv[1:3] != ["show", "hostnames"]:
    sys.exit("fake scontrol: only 'show hostnames [LIST]' and 'requeue JOBID'")
nodelist = sys.argv[3] if len(sys.argv) > 3 else os.environ["SLURM_JOB_NODELIST"]
for item in re.findall(r"[^,\\[]+(?:\\[[^\\]]*\\])?", nodelist):  # gpu[01-02,05],login1
    match = re.fullmatch(r"(.*)\\[(.*)\\]", item)
    if not match:
        print(item)
        continue
    prefix, ranges = match.groups()
    for part in ranges.split(","):
        lo, _, hi = part.partition("-")
        for i in range(int(lo), int(hi or lo) + 1):
            print(f"{prefix}{i:0{len(lo)}d}")
"""

FAKE_SRUN = """
import json, os, socket, subprocess, sys, time
args, opts = sys.argv[1:], {}
while args and args[0].startswith("--"):
    key, _, value = args.pop(0)[2:].partition("=")
    opts[key] = value
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write(json.dumps({"prog": "srun", "argv": sys.argv[1:]}) + "\\n")
hosts = subprocess.run(
    ["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
    capture_output=True, text=True, check=True,
).stdout.split()
nodes = int(opts["nodes"])
assert opts["ntasks-per-node"] == "1" and len(hosts) == nodes
gpus = os.environ.get("FAKE_GPUS_ON_NODE", "").split(",")  # per-node GPU counts, if given
procs = []
for i, host in enumerate(hosts):
    env = {**os.environ, "SLURM_NODEID": str(i), "SLURM_PROCID": str(i), "SLURMD_NODENAME": host}
    if gpus != [""]:
        env["SLURM_GPUS_ON_NODE"] = gpus[i]
    name = opts["output"].replace("%x", os.environ["SLURM_JOB_NAME"])
    name = name.replace("%j", os.environ["SLURM_JOB_ID"]).replace("%N", host)
    out = open(name, "w")
    procs.append(subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT))
    if i == 0 and os.environ.get("FAKE_SRUN_WAIT_PORT"):
        # all "nodes" share this machine: let node 0 own the rendezvous port before the others
        # start, as the head node does on a real cluster
        port = int(os.environ["MASTER_PORT"])
        deadline = time.time() + 120
        while procs[0].poll() is None and time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)
sys.exit(max(p.wait() for p in procs))
"""

FAKE_LAUNCHER = """
import json, os, sys
record = {
    "prog": os.path.basename(sys.argv[0]),
    "argv": sys.argv[1:],
    "cwd": os.getcwd(),
    "node": os.environ.get("SLURM_NODEID"),
    "mixed_precision": os.environ.get("ACCELERATE_MIXED_PRECISION"),
}
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write(json.dumps(record) + "\\n")
print("fake launcher ran:", *sys.argv[1:])
"""

# `accel-recipes launch -- CMD` (node.sh runs the launcher under it) as a pass-through
FAKE_WRAPPER = """
import os, sys
assert sys.argv[1:3] == ["launch", "--"], sys.argv
os.execvp(sys.argv[3], sys.argv[3:])
"""

# `accel-recipes launch -- CMD` whose workers are preempted: it waits, and a stop signal makes it
# exit 75 as the real one does once the workers have saved
FAKE_PREEMPTED_WRAPPER = """
import os, signal, sys, time
for name in ("SIGTERM", "SIGUSR1"):
    signal.signal(getattr(signal, name), lambda *_: sys.exit(75))
open(os.path.join(os.environ["FAKE_READY_DIR"], os.environ["SLURM_NODEID"]), "w").close()
time.sleep(120)
"""

# a GPU machine's nvidia-smi must not leak into the tests: by default it reports no driver
FAKE_NVIDIA_SMI_NONE = "import sys\nsys.exit('NVIDIA-SMI has failed: no driver')\n"
FAKE_NVIDIA_SMI_TWO = "print('GPU 0: NVIDIA H100 (UUID: a)\\nGPU 1: NVIDIA H100 (UUID: b)')\n"


def write_tool(folder: Path, name: str, source: str) -> None:
    path = folder / name
    path.write_text(f"#!{sys.executable}\n{source}")
    path.chmod(0o755)


@pytest.fixture
def fakes(tmp_path: Path) -> Path:
    folder = tmp_path / "fakebin"
    folder.mkdir()
    write_tool(folder, "scontrol", FAKE_SCONTROL)
    write_tool(folder, "srun", FAKE_SRUN)
    write_tool(folder, "accelerate", FAKE_LAUNCHER)
    write_tool(folder, "torchrun", FAKE_LAUNCHER)
    write_tool(folder, "accel-recipes", FAKE_WRAPPER)
    write_tool(folder, "nvidia-smi", FAKE_NVIDIA_SMI_NONE)
    return folder


def base_env(tmp_path: Path, fakes: Path, **extra: str) -> dict[str, str]:
    """A clean environment: nothing from a real SLURM job or make invocation leaks in."""
    return {
        "PATH": f"{fakes}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "FAKE_LOG": str(tmp_path / "calls.jsonl"),
        **extra,
    }


def slurm_env(tmp_path: Path, fakes: Path, **extra: str) -> dict[str, str]:
    defaults = {
        "SLURM_JOB_ID": "123456",
        "SLURM_JOB_NAME": "accel-recipes",
        "SLURM_SUBMIT_DIR": str(REPO),
        "LOG_DIR": str(tmp_path / "logs"),
        "ACCELERATE": str(fakes / "accelerate"),
        "ACCEL_RECIPES": str(fakes / "accel-recipes"),
    }
    return base_env(tmp_path, fakes, **{**defaults, **extra})


def run(cmd: list[str], env: dict[str, str], cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=120)


def calls(tmp_path: Path, prog: str) -> list[dict]:
    log = tmp_path / "calls.jsonl"
    if not log.exists():
        return []
    records = [json.loads(line) for line in log.read_text().splitlines()]
    return sorted((r for r in records if r["prog"] == prog), key=lambda r: r.get("node") or "")


def accelerate_argv(nodes: int, gpus: int, rank: int, head: str, port: int, config: str, rdzv: str):
    return [
        "launch", "--config_file", config,
        "--num_machines", str(nodes), "--num_processes", str(nodes * gpus),
        "--machine_rank", str(rank), "--main_process_ip", head, "--main_process_port", str(port),
        "--rdzv_backend", rdzv, "--max_restarts", "0",
    ]  # fmt: skip


# ---------------------------------------------------------------------------------------------
# SLURM


def test_multinode_sbatch_builds_one_launch_per_node(tmp_path, fakes):
    env = slurm_env(
        tmp_path,
        fakes,
        SLURM_JOB_NODELIST="gpu[07-08]",
        SLURM_NNODES="2",
        SLURM_GPUS_ON_NODE="8",
        SLURM_CPUS_PER_TASK="32",
        RECIPE="template",
        ARGS="--bs 1024 --lr-scaling sqrt",
    )
    result = run(["bash", str(SBATCH_MULTI), "--epochs", "3"], env)
    assert result.returncode == 0, result.stderr

    port = 10000 + 123456 % 20000  # from the job id
    launches = calls(tmp_path, "accelerate")
    assert [c["node"] for c in launches] == ["0", "1"]
    for rank, launch in enumerate(launches):
        expected = accelerate_argv(2, 8, rank, "gpu07", port, MULTINODE_YAML, "c10d")
        expected += ["recipes/train_template.py", "--bs", "1024", "--lr-scaling", "sqrt"]
        assert launch["argv"] == [*expected, "--epochs", "3"]
        assert launch["cwd"] == str(REPO)

    (srun,) = calls(tmp_path, "srun")
    assert srun["argv"][:8] == [
        "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
        "--export=ALL", f"--output={tmp_path}/logs/%x-%j-%N.out", "--open-mode=append",
        "--cpus-per-task=32",
    ]  # fmt: skip
    # one log per node, each holding that node's own command line
    for rank, host in enumerate(["gpu07", "gpu08"]):
        log = (tmp_path / "logs" / f"accel-recipes-123456-{host}.out").read_text()
        assert f"[node {rank} of 2," in log
        assert f"--machine_rank {rank} " in log
        assert "fake launcher ran: launch" in log
    assert "2 node(s) x 8 GPU(s) = 16 processes; rendezvous gpu07:13456" in result.stdout


def test_single_node_sbatch_uses_static_rendezvous_on_its_own_port(tmp_path, fakes):
    env = slurm_env(
        tmp_path, fakes, SLURM_JOB_NODELIST="node3", SLURM_NNODES="1", SLURM_GPUS_ON_NODE="4"
    )
    result = run(["bash", str(SBATCH_1NODE)], env)
    assert result.returncode == 0, result.stderr
    (launch,) = calls(tmp_path, "accelerate")
    expected = accelerate_argv(1, 4, 0, "node3", 13456, "accelerate_configs/8gpu.yaml", "static")
    assert launch["argv"] == [*expected, "recipes/train_pointcloud.py"]  # RECIPE's default


@pytest.mark.parametrize(
    ("gpu_env", "nvidia_smi", "gpus"),
    [
        ({"SLURM_GPUS_PER_NODE": "a100:4"}, None, 4),  # typed count, as --gpus-per-node=a100:4
        ({"SLURM_GPUS_PER_NODE": "2"}, None, 2),
        ({}, FAKE_NVIDIA_SMI_TWO, 2),  # no SLURM GPU variable: count what nvidia-smi lists
        ({"GPUS_PER_NODE": "3", "SLURM_GPUS_PER_NODE": "8"}, None, 3),  # explicit wins
    ],
)
def test_gpus_per_node_sources(tmp_path, fakes, gpu_env, nvidia_smi, gpus):
    if nvidia_smi:
        write_tool(fakes, "nvidia-smi", nvidia_smi)
    env = slurm_env(
        tmp_path, fakes, SLURM_JOB_NODELIST="a1,b2", SLURM_NNODES="2", RECIPE="template", **gpu_env
    )
    result = run(["bash", str(SBATCH_MULTI)], env)
    assert result.returncode == 0, result.stderr
    for rank, launch in enumerate(calls(tmp_path, "accelerate")):
        expected = accelerate_argv(2, gpus, rank, "a1", 13456, MULTINODE_YAML, "c10d")
        assert launch["argv"] == [*expected, "recipes/train_template.py"]


def test_address_port_config_and_launch_flags_can_be_overridden(tmp_path, fakes):
    env = slurm_env(
        tmp_path,
        fakes,
        SLURM_JOB_NODELIST="gpu[1-3]",
        SLURM_NNODES="3",
        SLURM_GPUS_ON_NODE="8",
        RECIPE="quality",
        MASTER_ADDR="10.1.2.3",  # e.g. the head's InfiniBand address
        MASTER_PORT="29555",
        CONFIG="accelerate_configs/fsdp_8gpu.yaml",
        LAUNCH_ARGS="--mixed_precision fp16",
    )
    result = run(["bash", str(SBATCH_MULTI)], env)
    assert result.returncode == 0, result.stderr
    launches = calls(tmp_path, "accelerate")
    assert len(launches) == 3
    for rank, launch in enumerate(launches):
        config = "accelerate_configs/fsdp_8gpu.yaml"
        expected = accelerate_argv(3, 8, rank, "10.1.2.3", 29555, config, "c10d")
        expected += ["--mixed_precision", "fp16", "recipes/train_quality.py"]
        assert launch["argv"] == expected


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"RECIPE": "nope"}, "RECIPE=nope: no file recipes/train_nope.py"),
        ({"SLURM_JOB_NODELIST": None}, "SLURM_JOB_NODELIST is not set"),
        ({"SLURM_JOB_ID": None}, "SLURM_JOB_ID is not set"),
        ({"SLURM_GPUS_ON_NODE": None}, "GPUS_PER_NODE is not set"),
        ({"SLURM_GPUS_ON_NODE": "eight"}, "GPUS_PER_NODE=eight: expected an integer"),
        ({"SLURM_NNODES": "3"}, "SLURM_NNODES=3 but SLURM_JOB_NODELIST=gpu[1-2] lists 2 hosts"),
        ({"MASTER_PORT": "port"}, "MASTER_PORT=port: expected an integer"),
        ({"SLURM_SUBMIT_DIR": "/"}, "error: / is not an accel-recipes checkout"),
    ],
)
def test_bad_input_fails_before_anything_starts(tmp_path, fakes, change, message):
    env = slurm_env(
        tmp_path, fakes, SLURM_JOB_NODELIST="gpu[1-2]", SLURM_NNODES="2", SLURM_GPUS_ON_NODE="8"
    )
    for key, value in change.items():
        if value is None:
            env.pop(key)
        else:
            env[key] = value
    result = run(["bash", str(SBATCH_MULTI)], env, cwd=tmp_path)
    assert result.returncode == 2
    assert message in result.stderr
    assert calls(tmp_path, "srun") == [] and calls(tmp_path, "accelerate") == []


def test_a_missing_recipe_names_the_choices(tmp_path, fakes):
    env = slurm_env(
        tmp_path, fakes, SLURM_JOB_NODELIST="gpu1", SLURM_NNODES="1", SLURM_GPUS_ON_NODE="8"
    )
    result = run(["bash", str(SBATCH_1NODE)], {**env, "RECIPE": "nope"})
    assert result.returncode == 2
    choices = sorted(p.stem.removeprefix("train_") for p in (REPO / "recipes").glob("train_*.py"))
    assert f"choose one of: {' '.join(choices)}" in result.stderr


def test_a_node_with_other_gpus_stops_the_job(tmp_path, fakes):
    env = slurm_env(
        tmp_path,
        fakes,
        SLURM_JOB_NODELIST="gpu[1-2]",
        SLURM_NNODES="2",
        SLURM_GPUS_ON_NODE="8",
        FAKE_GPUS_ON_NODE="8,4",
    )
    result = run(["bash", str(SBATCH_MULTI)], env)
    assert result.returncode == 2
    log = (tmp_path / "logs" / "accel-recipes-123456-gpu2.out").read_text()
    assert "has SLURM_GPUS_ON_NODE=4 but the job plans GPUS_PER_NODE=8" in log
    assert [c["node"] for c in calls(tmp_path, "accelerate")] == ["0"]


def test_node_step_refuses_two_tasks_on_one_node(tmp_path, fakes):
    env = base_env(
        tmp_path,
        fakes,
        NNODES="2",
        GPUS_PER_NODE="8",
        MASTER_ADDR="gpu1",
        MASTER_PORT="29500",
        SLURM_NODEID="0",
        SLURM_PROCID="1",
        ACCELERATE=str(fakes / "accelerate"),
        ACCEL_RECIPES=str(fakes / "accel-recipes"),
    )
    result = run(["bash", str(NODE_SH)], env)
    assert result.returncode == 2
    assert "srun must start exactly one task per node" in result.stderr
    assert calls(tmp_path, "accelerate") == []


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM], ids=lambda s: s.name)
def test_a_preempted_job_is_requeued_when_slurm_signals_its_steps(tmp_path, fakes, sig):
    """SLURM delivers --signal=USR1@120 (and `scancel -s TERM`) to every process of the job's
    steps: each node's node.sh as well as the launch under it. node.sh must live on to report the
    launch's exit code 75, so that launch.sh requeues the job."""
    write_tool(fakes, "accel-recipes", FAKE_PREEMPTED_WRAPPER)
    ready = tmp_path / "ready"
    ready.mkdir()
    env = slurm_env(
        tmp_path, fakes, SLURM_JOB_NODELIST="gpu[1-2]", SLURM_NNODES="2", SLURM_GPUS_ON_NODE="8",
        RECIPE="template", FAKE_READY_DIR=str(ready),
    )  # fmt: skip
    job = subprocess.Popen(
        ["bash", str(SBATCH_MULTI)], env=env, cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while sorted(p.name for p in ready.iterdir()) != ["0", "1"]:
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()
            time.sleep(0.05)
        # the job steps' processes (each node.sh and what it started), not the batch script
        steps = [
            p for p in psutil.Process(job.pid).children(recursive=True)
            if p.cmdline()[:2] == ["bash", "scripts/slurm/node.sh"]
        ]  # fmt: skip
        assert len(steps) == 2
        for step in steps:
            for process in [step, *step.children(recursive=True)]:
                process.send_signal(sig)
        stdout, stderr = job.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 0, stderr
    assert "job 123456: preempted, checkpoint saved; requeueing" in stdout
    assert [c["argv"] for c in calls(tmp_path, "scontrol")] == [["requeue", "123456"]]
    assert not (tmp_path / "logs" / ".preempted-123456").exists()  # consumed by the requeue


# ---------------------------------------------------------------------------------------------
# torchrun without SLURM


# this project's own `accel-recipes` (the launch wrapper itself is what the script relies on)
REAL_WRAPPER = str(Path(sys.executable).parent / "accel-recipes")

# a torchrun whose workers were preempted: a worker reported it, then the agent exits 1
FAKE_PREEMPTED_TORCHRUN = """
import sys
print("preempted (rank 0): step 7 saved to runs/x/checkpoints/step_7", file=sys.stderr)
print("torch.distributed.elastic.multiprocessing.errors.ChildFailedError", file=sys.stderr)
sys.exit(1)
"""


def torchrun_env(tmp_path: Path, fakes: Path, **extra: str) -> dict[str, str]:
    defaults = {
        "NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1", "GPUS_PER_NODE": "8",
        "ACCEL_RECIPES": REAL_WRAPPER,
    }  # fmt: skip
    return base_env(tmp_path, fakes, TORCHRUN=str(fakes / "torchrun"), **{**defaults, **extra})


def test_torchrun_script_exits_75_when_the_workers_were_preempted(tmp_path, fakes):
    """A bare torchrun exits 1 after its workers saved on a preemption; the script runs it under
    `accel-recipes launch`, so a scheduler sees 75 (requeue me), and one line says why."""
    write_tool(fakes, "torchrun", FAKE_PREEMPTED_TORCHRUN)
    result = run(["bash", str(TORCHRUN_SH)], torchrun_env(tmp_path, fakes))
    assert result.returncode == 75, result.stderr
    assert "launcher: preempted, the checkpoint is saved; exit code 75" in result.stderr
    assert "ChildFailedError" not in result.stderr


def test_torchrun_script_builds_the_command(tmp_path, fakes):
    env = torchrun_env(tmp_path, fakes, MASTER_PORT="29501", RECIPE="template", ARGS="--bs 1024")
    result = run(["bash", str(TORCHRUN_SH), "--epochs", "2"], env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    (launch,) = calls(tmp_path, "torchrun")
    assert launch["argv"] == [
        "--nnodes", "2", "--node_rank", "1", "--nproc_per_node", "8",
        "--rdzv_backend", "c10d", "--rdzv_endpoint", "10.0.0.1:29501", "--rdzv_id", "accel-recipes",
        "--max-restarts", "0", "recipes/train_template.py", "--bs", "1024", "--epochs", "2",
    ]  # fmt: skip
    assert launch["cwd"] == str(REPO)  # works from any directory
    assert launch["mixed_precision"] == "bf16"  # as the accelerate configs


def test_torchrun_script_defaults(tmp_path, fakes):
    write_tool(fakes, "nvidia-smi", FAKE_NVIDIA_SMI_TWO)
    env = torchrun_env(tmp_path, fakes, NODE_RANK="0", ACCELERATE_MIXED_PRECISION="fp16")
    env.pop("GPUS_PER_NODE")
    result = run(["bash", str(TORCHRUN_SH)], env)
    assert result.returncode == 0, result.stderr
    (launch,) = calls(tmp_path, "torchrun")
    assert launch["argv"][:10] == [
        "--nnodes", "2", "--node_rank", "0", "--nproc_per_node", "2",
        "--rdzv_backend", "c10d", "--rdzv_endpoint", "10.0.0.1:29500",
    ]  # fmt: skip
    assert launch["argv"][-1] == "recipes/train_pointcloud.py"
    assert launch["mixed_precision"] == "fp16"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"MASTER_ADDR": None}, "MASTER_ADDR is not set"),
        ({"NODE_RANK": None}, "NODE_RANK is not set"),
        ({"NNODES": None}, "NNODES is not set"),
        ({"NODE_RANK": "2"}, "NODE_RANK=2: expected 0..1 for NNODES=2"),
        ({"NNODES": "0"}, "NNODES=0: expected an integer >= 1"),
        ({"GPUS_PER_NODE": None}, "GPUS_PER_NODE is not set"),
        ({"RECIPE": "nope"}, "RECIPE=nope: no file recipes/train_nope.py"),
    ],
)
def test_torchrun_script_bad_input(tmp_path, fakes, change, message):
    env = torchrun_env(tmp_path, fakes)
    for key, value in change.items():
        if value is None:
            env.pop(key)
        else:
            env[key] = value
    result = run(["bash", str(TORCHRUN_SH)], env)
    assert result.returncode == 2
    assert message in result.stderr
    assert calls(tmp_path, "torchrun") == []


# ---------------------------------------------------------------------------------------------
# make train-multinode


def make_dry_run(tmp_path: Path, fakes: Path, *variables: str) -> tuple[str, subprocess.Popen]:
    """`make -n train-multinode ...` (never the install step), then run what it printed."""
    env = base_env(tmp_path, fakes)
    printed = run(
        ["make", "-n", "-o", ".venv/.installed", "train-multinode", f"BIN={fakes}", *variables],
        env,
    )
    assert printed.returncode == 0, printed.stderr
    return printed.stdout, run(["bash", "-e", "-c", printed.stdout], env)


def test_make_train_multinode_builds_the_launch_command(tmp_path, fakes):
    text, result = make_dry_run(
        tmp_path, fakes, "NNODES=2", "NODE_RANK=1", "MASTER_ADDR=10.0.0.1", "MASTER_PORT=29500",
        "RECIPE=template", "ARGS=--bs 1024 --epochs 2",
    )  # fmt: skip
    assert "--rdzv_backend c10d" in text
    assert result.returncode == 0, result.stderr
    (launch,) = calls(tmp_path, "accelerate")
    expected = accelerate_argv(2, 8, 1, "10.0.0.1", 29500, MULTINODE_YAML, "c10d")
    expected += ["recipes/train_template.py", "--bs", "1024", "--epochs", "2"]
    assert launch["argv"] == expected


def test_make_train_multinode_scales_num_processes(tmp_path, fakes):
    _, result = make_dry_run(
        tmp_path, fakes, "NNODES=4", "GPUS_PER_NODE=4", "NODE_RANK=3", "MASTER_ADDR=head",
        "RECIPE=template",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    (launch,) = calls(tmp_path, "accelerate")
    assert launch["argv"][:-1] == accelerate_argv(4, 4, 3, "head", 29500, MULTINODE_YAML, "c10d")


def test_make_train_multinode_requires_master_addr(tmp_path, fakes):
    _, result = make_dry_run(tmp_path, fakes, "NNODES=2", "NODE_RANK=1", "RECIPE=template")
    assert result.returncode == 2
    assert "MASTER_ADDR is not set" in result.stderr
    assert calls(tmp_path, "accelerate") == []


# ---------------------------------------------------------------------------------------------
# a real two-node job on this machine


@pytest.mark.dist
def test_two_node_job_really_trains(tmp_path, fakes, template_data):
    """2 "nodes" x 1 CPU process: the SLURM scripts' command line forms one 2-process job."""
    out = tmp_path / "run"
    # the 2 x 8 config on CPUs (`accelerate launch --cpu` would start 1 process, not torchrun)
    config = tmp_path / "multinode_cpu.yaml"
    yaml = (REPO / MULTINODE_YAML).read_text()
    yaml = yaml.replace("use_cpu: false", "use_cpu: true").replace("mixed_precision: bf16", "")
    config.write_text(yaml + "mixed_precision: 'no'\n")
    ours = {"CONFIG", "ARGS", "RECIPE", "REPO_DIR", "LAUNCH_ARGS", "NNODES", "NODE_RANK"}
    env = {
        k: v
        for k, v in recipe_env(tmp_path).items()
        if not k.startswith(("SLURM_", "MASTER_", "MAKE")) and k not in ours
    }
    env.update(
        slurm_env(
            tmp_path,
            fakes,
            SLURM_JOB_NODELIST="node[1-2]",
            SLURM_NNODES="2",
            GPUS_PER_NODE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
            ACCELERATE=str(BIN / "accelerate"),
            ACCEL_RECIPES=str(BIN / "accel-recipes"),
            CONFIG=str(config),
            RECIPE="template",
            ARGS=f"--data {template_data} --output-dir {out} --bs 128 --max-steps 4",
            FAKE_SRUN_WAIT_PORT="1",
        )
    )
    env["PATH"] = f"{fakes}:{os.environ['PATH']}"
    result = subprocess.run(
        ["bash", str(SBATCH_MULTI), "--epochs", "1"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    logs = {p.name: p.read_text() for p in (tmp_path / "logs").glob("*.out")}
    assert result.returncode == 0, f"{result.stderr}\n{logs}"
    assert sorted(logs) == ["accel-recipes-123456-node1.out", "accel-recipes-123456-node2.out"]
    for rank, name in enumerate(sorted(logs)):
        assert f"--machine_rank {rank} " in logs[name]
        assert "--rdzv_backend c10d" in logs[name]
    plan = metrics_log(out)[0]["config"]
    assert plan["num_processes"] == 2  # one world over both "nodes", not two 1-process runs
    assert (plan["per_device_batch_size"], plan["grad_accum_steps"]) == (64, 1)
    assert (out / "model" / "model.safetensors").exists()
