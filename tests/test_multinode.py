"""Multi-node on one machine: two `accelerate launch` "machines" on loopback, one CPU process each.

Each machine is its own `accelerate launch --num_machines 2 --machine_rank R` (its own torchrun
agent and rendezvous, exactly as on a cluster), both pointing at the same --output-dir, as a
cluster's shared filesystem. The job must train exactly like one machine with 2 processes
(tolerance and its reasoning as in test_distributed: same per-sample gradients, only the order of
floating-point sums differs), and only the process holding global rank 0 may write the log and
the export.

Who wrote a file is read from its permission bits: each machine runs with its own umask (022 on
machine 0, 077 on machine 1), and a file created with open() carries its creator's umask.

The failure tests stop (SIGSTOP: a hang, like a stuck GPU or a paused VM) or kill (SIGKILL: a
crash, an out-of-memory kill) machine 1's worker mid-training: machine 0 must then exit non-zero
within --dist-timeout (plus tear-down margin) with one message naming what happened, instead of
waiting in its all-reduce for torch's default 30 minutes. A stopped process cannot notice
anything, so machine 1 stays hung until killed: on a cluster, the scheduler ends it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import psutil
import pytest

from accel_common.errors import describe_distributed_failure, exit_on_error
from tests.processes import (
    ACCELERATE_LAUNCH,
    CPU_2PROC,
    TEMPLATE,
    free_port,
    recipe_env,
    run_recipe,
)
from tests.results import exported_params, max_relative_difference, metrics_log

pytestmark = pytest.mark.dist

STEPS = 16  # one epoch at global batch 128
COMMON = ["--bs", "128", "--epochs", "2", "--max-steps", str(STEPS), "--log-every", "1"]
TOLERANCE = 1e-5
UMASKS = (0o022, 0o077)  # machine 0, machine 1: tells their files apart
DIST_TIMEOUT = 15
FAILURE_MARGIN = 45  # seconds for the survivor to print, exit and its launcher to tear down
RUN_TIMEOUT = 300  # a whole short training job, on a loaded 2-core machine


def machine_command(rank: int, port: int, rdzv: str, args: list[str]) -> list[str]:
    """`accelerate launch` for one of two machines with one CPU process each.

    With c10d, both agents resolve 127.0.0.1 as their own address, so each would try to host
    the rendezvous store; `is_host` says which one does, as distinct hostnames would on a cluster.
    """
    rdzv_conf = ["--rdzv_conf", f"is_host={int(rank == 0)}"] if rdzv == "c10d" else []
    return [
        *ACCELERATE_LAUNCH,
        "--config_file", str(CPU_2PROC),
        "--num_machines", "2", "--num_processes", "2", "--machine_rank", str(rank),
        "--main_process_ip", "127.0.0.1", "--main_process_port", str(port),
        "--rdzv_backend", rdzv, *rdzv_conf,
        str(TEMPLATE), *args,
    ]  # fmt: skip


def stop_all(marker: str) -> None:
    """Kill every process whose command line names `marker` (this test's own folder).

    torchrun starts each worker in a session of its own, so killing a launcher's process group
    would leave its worker behind; matching the test's folder finds orphans too. SIGCONT first,
    so that a stopped process does not sit on its signals.
    """
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if marker in " ".join(proc.info["cmdline"] or []) and proc.pid != os.getpid():
            found.append(proc)
    for proc in found:
        with suppress(psutil.NoSuchProcess):
            proc.send_signal(signal.SIGCONT)
            proc.kill()
    psutil.wait_procs(found, timeout=30)


@contextmanager
def two_machines(
    tmp: Path, args: list[str], rdzv: str = "static"
) -> Iterator[list[subprocess.Popen]]:
    """Start both machines' launchers at once; kill whatever is left of them on the way out."""
    port, launchers = free_port(), []
    try:
        for rank in (0, 1):
            with (tmp / f"machine{rank}.log").open("w") as log:
                launchers.append(
                    subprocess.Popen(
                        machine_command(rank, port, rdzv, args),
                        cwd=tmp,
                        env=recipe_env(tmp),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                        umask=UMASKS[rank],
                    )
                )
        yield launchers
    finally:
        stop_all(f"{tmp}/")
        for launcher in launchers:
            launcher.wait(timeout=30)


def machine_log(tmp: Path, rank: int) -> str:
    return (tmp / f"machine{rank}.log").read_text(errors="replace")


def mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def worker_of(launcher: subprocess.Popen) -> psutil.Process:
    """The training process that a machine's launcher (its torchrun agent) started."""
    workers = [
        child
        for child in psutil.Process(launcher.pid).children(recursive=True)
        if str(TEMPLATE) in " ".join(child.cmdline())
    ]
    assert len(workers) == 1, workers
    return workers[0]


def wait_for_training(out: Path, launchers: list[subprocess.Popen], limit: float) -> None:
    """Return once the main process has logged an optimizer step (so both ranks are training)."""
    log, deadline = out / "logs" / "metrics.jsonl", time.monotonic() + limit
    while not (log.is_file() and '"train/loss"' in log.read_text()):
        assert all(p.poll() is None for p in launchers), "a machine exited before training"
        assert time.monotonic() < deadline, f"no training step logged within {limit} s"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def one_machine(tmp_path_factory, template_data) -> Path:
    """The reference: one machine, 2 processes, the same global batch."""
    tmp = tmp_path_factory.mktemp("one-machine")
    out = tmp / "out"
    run_recipe(["--data", str(template_data), "--output-dir", str(out), *COMMON], cwd=tmp, nproc=2)
    return out


@pytest.mark.parametrize("rdzv", ["static", "c10d"])
def test_two_machines_train_like_one(tmp_path, template_data, one_machine, rdzv):
    out = tmp_path / "shared"
    args = ["--data", str(template_data), "--output-dir", str(out), *COMMON]
    with two_machines(tmp_path, args, rdzv) as launchers:
        codes = [launcher.wait(timeout=RUN_TIMEOUT) for launcher in launchers]
        pids = [launcher.pid for launcher in launchers]
    logs = [machine_log(tmp_path, rank) for rank in (0, 1)]
    assert codes == [0, 0], "\n\n".join(logs)

    # static: global rank 0 is on --machine_rank 0. c10d ignores --machine_rank and numbers the
    # agents by (hostname, agent pid); the agent runs inside `accelerate launch` itself.
    main = 0 if rdzv == "static" else pids.index(min(pids))
    other = 1 - main
    log = metrics_log(out)
    assert log[0]["config"]["num_processes"] == 2
    steps = [r["step"] for r in log if "train/loss" in r]
    assert steps == list(range(1, STEPS + 1))  # one writer: each step once, not twice
    diff = max_relative_difference(exported_params(one_machine), exported_params(out))
    assert diff <= TOLERANCE

    # the job's files come from the main machine (its umask)...
    main_mode, other_mode = (0o666 & ~UMASKS[main], 0o666 & ~UMASKS[other])
    assert mode(out / "model" / "model.json") == main_mode
    assert mode(out / "logs" / "metrics.jsonl") == main_mode
    # ...while each rank's own RNG state, needed to resume, lands in the shared checkpoint
    checkpoint = out / "checkpoints" / f"step_{STEPS}"
    assert mode(checkpoint / "random_states_0.pkl") == main_mode
    assert mode(checkpoint / "random_states_1.pkl") == other_mode
    assert "exported" in logs[main] and "exported" not in logs[other]


@pytest.mark.parametrize(
    ("sig", "expected"),
    [
        (signal.SIGSTOP, f"did not complete within --dist-timeout {DIST_TIMEOUT} s"),
        (signal.SIGKILL, "lost the connection to another process"),
    ],
    ids=["hung", "killed"],
)
def test_a_dead_or_hung_rank_ends_the_job(tmp_path, template_data, sig, expected):
    out = tmp_path / "shared"
    args = ["--data", str(template_data), "--output-dir", str(out), "--bs", "128"]
    args += ["--epochs", "100000", "--log-every", "1", "--dist-timeout", str(DIST_TIMEOUT)]
    with two_machines(tmp_path, args) as launchers:
        wait_for_training(out, launchers, limit=RUN_TIMEOUT)
        worker = worker_of(launchers[1])
        worker.send_signal(sig)
        signalled = time.monotonic()
        limit = DIST_TIMEOUT + FAILURE_MARGIN
        try:
            code = launchers[0].wait(timeout=limit)
        except subprocess.TimeoutExpired:
            log = machine_log(tmp_path, 0)
            pytest.fail(f"machine 0 still running {limit} s after {sig.name}:\n{log}")
        elapsed = time.monotonic() - signalled
        if sig == signal.SIGKILL:  # the dead worker's own launcher fails too (a hung one cannot)
            assert launchers[1].wait(timeout=FAILURE_MARGIN) != 0
    survivor = machine_log(tmp_path, 0)
    assert code != 0, survivor
    assert "error (rank 0): " in survivor and expected in survivor, survivor
    if sig == signal.SIGSTOP:
        # it was the timeout that fired: gloo got --dist-timeout, and waited for it
        assert f"Timed out waiting {DIST_TIMEOUT * 1000}ms" in survivor, survivor
        assert elapsed >= DIST_TIMEOUT * 0.8, elapsed
    print(f"{sig.name}: machine 0 exited {code} after {elapsed:.1f} s")


def test_other_runtime_errors_keep_their_traceback():
    """Only collective failures become one line; a bug in the recipe must still show where."""

    @exit_on_error
    def buggy() -> None:
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied (64x8 and 9x64)")

    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        buggy()


def test_a_timeout_under_the_default_says_how_to_shorten_it():
    gloo = RuntimeError(
        "[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] "
        "Timed out waiting 1800000ms for recv operation to complete"
    )
    message = describe_distributed_failure(gloo, 0)
    assert "default timeout (30 min on gloo" in message and "--dist-timeout sets it" in message
    assert message.endswith("(Timed out waiting 1800000ms for recv operation to complete)")
