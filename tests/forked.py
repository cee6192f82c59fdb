"""Recipe processes forked from a server that has already imported torch.

Importing torch costs every Python process ~3.5 CPU-seconds (the CUDA build, on this suite's
2-core machines), a third or more of a small recipe run, and the suite starts some 150 of them.
The tests start recipes here instead: `multiprocessing`'s forkserver imports torch (and PyG)
once per pytest worker, and each run is a fresh child forked from it that executes the script as
`python script.py args` would (its own pid, working directory, environment, argv, stdout and
stderr files, and exit code; `sys.modules['__main__']` is the script). Libraries that read the
environment at import time (datasets, huggingface_hub, wandb, accelerate) are not preloaded, so
they see the run's own environment. Tests of launchers and signals start real `python` and
`accelerate launch` processes instead (see processes.launch_command).

Where CUDA is present (the GPU suite), each run is a fresh `python script args` interpreter
instead: a child forked from a process whose torch has initialised CUDA dies at its first CUDA
call (`CUDA error: initialization error`), and with 16 cores the import costs little there.
RECIPE_RUNS=fresh or RECIPE_RUNS=forked in the environment chooses either way anywhere.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import runpy
import sys
from multiprocessing.context import ForkServerContext
from pathlib import Path

from accel_common.tools.check.processes import start_fresh

# torch_geometric too: it imports torch._dynamo, ~3.5 CPU-s more for each graph recipe's run
PRELOAD = ["torch", "numpy", "torch_geometric"]
_context: ForkServerContext | None = None
RUN_MODES = ("fresh", "forked")


def fresh_interpreters() -> bool:
    """Whether runs start as new interpreters: RECIPE_RUNS if set, else where CUDA is present."""
    mode = os.environ.get("RECIPE_RUNS")
    if mode is None:
        import torch

        return torch.cuda.is_available()
    if mode not in RUN_MODES:
        raise ValueError(f"RECIPE_RUNS={mode!r}: expected one of {', '.join(RUN_MODES)}")
    return mode == "fresh"


def context() -> ForkServerContext:
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def _redirect(fd: int, path: str) -> None:
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(target, fd)
    os.close(target)


def _run_script(
    script: str, args: list[str], cwd: str, env: dict[str, str], logs: str, new_session: bool
) -> None:
    """The child: become `python script args` in `cwd` with `env`, outputs into `logs`."""
    if new_session:
        os.setsid()  # its own process group, so that os.killpg reaches its data-loader workers
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    _redirect(1, os.path.join(logs, "out"))
    _redirect(2, os.path.join(logs, "err"))
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 (the process's own)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(script)  # what `python script` puts first
    sys.path[1:1] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    import torch  # preloaded: its thread count was read from the server's environment

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        atexit._run_exitfuncs()  # a forked child ends with os._exit, which skips them
        sys.stdout.flush()
        sys.stderr.flush()


def start(
    script: Path,
    args: list[str],
    *,
    cwd: Path,
    env: dict[str, str],
    logs: Path,
    new_session: bool = False,
):
    """Start one run; `logs` receives `out` and `err`. Returns the child (`.join()`,
    `.exitcode`, `.pid`, `.kill()`); with `new_session`, it leads a session of its own, as
    `subprocess.Popen(..., start_new_session=True)` would. A fresh interpreter where
    `fresh_interpreters()`, else forked from the server."""
    if fresh_interpreters():
        return start_fresh(script, args, cwd=cwd, env=env, logs=logs, new_session=new_session)
    child = context().Process(
        target=_run_script,
        args=(str(script), list(args), str(cwd), dict(env), str(logs), new_session),
    )
    child.start()
    return child
