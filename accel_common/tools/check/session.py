"""One check of one recipe: its example data in a temporary folder, and the runs the promises
compare, each started once (as fresh processes, one thread each) and shared by the promises that
need it."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from accel_common.tools.check.processes import (
    REPO,
    finished,
    kill_once_written,
    recipe_env,
    run_processes,
)
from accel_common.tools.check.recipe import Recipe
from accel_common.tools.ports import free_port

STEPS = 8  # optimizer steps of each compared run
SAVE_EVERY = 2  # checkpoints at steps 2, 4, 6, 8: the kill comes after the first
SHORT = 2  # steps of the runs that check only that a setting trains (--compile, bf16)
TIMEOUT = 600  # seconds a run may take
FSDP_SHIM = Path(__file__).with_name("fsdp_on_cpu.py")
AUDIT = Path(__file__).with_name("opened.py")


def fsdp_cpu_config(folder: Path, min_num_params: int = 1000) -> Path:
    """fsdp_8gpu.yaml on 2 CPU processes, written into `folder`: only the hardware keys changed,
    and a wrap threshold that gives a small model nested units (1000: the template's 32x32
    layers on their own)."""
    config = yaml.safe_load((REPO / "accelerate_configs" / "fsdp_8gpu.yaml").read_text())
    config.update(num_processes=2, use_cpu=True, mixed_precision="no")
    config["fsdp_config"]["fsdp_min_num_params"] = min_num_params
    path = folder / "fsdp_cpu_2proc.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@dataclass
class Session:
    recipe: Recipe
    tmp: Path
    data: Path | None = None

    def __post_init__(self) -> None:
        self.runs: dict[str, Path | Exception] = {}

    def example(self) -> Path:
        """The recipe's example data, written on first use."""
        if self.data is None:
            self.data = self.recipe.write_example(self.tmp / "data")
        return self.data

    def flags(self, *extra: str, steps: int = STEPS) -> list[str]:
        """The recipe's check flags on its example, `steps` steps, every step logged, a checkpoint
        every SAVE_EVERY steps (all kept), then `extra`."""
        base = ["--data", str(self.example()), *self.recipe.args, "--max-steps", str(steps)]
        base += ["--log-every", "1", "--save-every", str(SAVE_EVERY), "--keep-last", "100"]
        return [*base, *extra]

    def process(
        self,
        args: list[str],
        nproc: int = 1,
        script: Path | None = None,
        hf: Path | None = None,
        env: dict[str, str] | None = None,
    ):
        """`python SCRIPT args` (default: the recipe) in the check's folder, on `nproc` ranks;
        with `hf`, its own Hugging Face cache (a run reads no data its cache holds already);
        `env` added to the runs' environment."""
        script = script or self.recipe.script
        env = recipe_env(self.tmp) | ({"HF_HOME": str(hf)} if hf else {}) | (env or {})
        return run_processes(script, args, nproc, cwd=self.tmp, env=env, timeout=TIMEOUT)

    def run(
        self,
        name: str,
        *extra: str,
        nproc: int = 1,
        steps: int = STEPS,
        env: dict[str, str] | None = None,
    ) -> Path:
        """The output folder of run `name` (`extra` flags and `env`, on `nproc` processes), run
        once; a run that failed raises RuntimeError naming it, each time it is asked for."""
        if name not in self.runs:
            out = self.tmp / "runs" / name
            try:
                args = self.flags(*extra, "--output-dir", str(out), steps=steps)
                finished(self.process(args, nproc, env=env), f"the {name} run")
                self.runs[name] = out
            except RuntimeError as err:
                self.runs[name] = err
        if isinstance(self.runs[name], Exception):
            raise self.runs[name]
        return self.runs[name]

    def killed_and_resumed(self, *extra: str) -> tuple[Path, int]:
        """A run (`extra` flags) SIGKILLed once its first checkpoint is complete, then resumed
        with `--resume latest`: its folder and the step it resumed from."""
        out = self.tmp / "runs" / "killed"
        args = self.flags(*extra, "--output-dir", str(out))
        marker = out / "checkpoints" / f"step_{SAVE_EVERY}" / "progress.json"
        why = kill_once_written(self.recipe.script, args, cwd=self.tmp, marker=marker)
        if why is not None:
            raise RuntimeError(f"the killed run: {why}")
        steps = sorted(
            int(p.name.removeprefix("step_")) for p in (out / "checkpoints").glob("step_*")
        )
        latest = steps[-1] if steps else 0
        finished(self.process([*args, "--resume", "latest"]), "the resumed run")
        return out, latest

    def fsdp(self, name: str) -> tuple[Path, str]:
        """The recipe as FSDP2 on 2 CPU processes (fsdp_on_cpu.py, `fsdp_cpu_config`): its output
        folder and stdout."""
        path = fsdp_cpu_config(self.tmp)
        out = self.tmp / "runs" / name
        command = [
            sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(path),
            "--main_process_ip", "127.0.0.1", "--main_process_port", str(free_port()),
            str(FSDP_SHIM), str(self.recipe.script), *self.flags("--output-dir", str(out)),
        ]  # fmt: skip
        result = subprocess.run(
            command, cwd=self.tmp, env=recipe_env(self.tmp), capture_output=True, text=True,
            timeout=TIMEOUT,
        )  # fmt: skip
        return out, finished(result, "the FSDP run").stdout

    def fill(self, command: list[str], model: Path) -> list[str]:
        """CHECK_COMMAND with {model}, {data} and {out} (a new file in the check's folder)."""
        out = self.tmp / "outputs" / f"{model.parent.name}-{model.name}"
        out.mkdir(parents=True, exist_ok=True)
        values = {"model": str(model), "data": str(self.example()), "out": str(out / "out")}
        return [word.format(**values) for word in command]
