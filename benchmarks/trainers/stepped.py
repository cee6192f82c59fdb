"""Runs an original's own trainer unchanged, logging the time after each optimizer step (a
global post-step hook on every torch optimizer) to steps.jsonl in the current folder: neither
cricketmodel's nor ComFormer's trainer logs a time per step. benchmarks/bench_trainers.py stops
the process once the steps it asked for are logged.

    python stepped.py --script train.py [ARGS...]        its command line, as `python train.py`
    python stepped.py --call module:function JSON        function(**JSON), its Python API
"""

from __future__ import annotations

import importlib
import json
import runpy
import sys
import time
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook


def main() -> None:
    with Path("steps.jsonl").open("a", buffering=1) as log:
        count = 0

        def logged(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
            nonlocal count
            count += 1
            log.write(json.dumps({"step": count, "time": time.time()}) + "\n")

        register_optimizer_step_post_hook(logged)
        how, target, *rest = sys.argv[1:]
        sys.path.pop(0)  # this folder: its modules' names must not hide the original's
        if how == "--script":  # as `python train.py ARGS`: its folder first on the path
            sys.argv = [target, *rest]
            sys.path.insert(0, str(Path(target).resolve().parent))
            runpy.run_path(target, run_name="__main__")
        else:
            module, function = target.split(":")
            getattr(importlib.import_module(module), function)(**json.loads(rest[0]))


if __name__ == "__main__":
    main()
