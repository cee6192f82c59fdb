"""One memory measurement: run a recipe in this (fresh) process and write its peak as JSON.

    python -m accel_common.tools.memory_probe OUT.json recipes/train_X.py [recipe flags]

On a GPU the peak is the CUDA allocator's (torch.cuda.max_memory_allocated). On the CPU it is the
peak of the bytes torch's CPU allocator holds, replayed from the allocation events that torch's
profiler records (profile_memory): the process's peak resident size was tried first, but on a
small model glibc's reuse of freed blocks and the libraries' own peaks hid the batch's share
(three batches gave the same peak). Only the training steps count: the peak is taken up to the
end of the last optimizer step, leaving out the evaluation, checkpoint and export after them
(exporting briefly copies the weights, which on a small model outweighs a batch). `baseline` is
what the process held before the recipe ran (interpreter and libraries, resident size): it
counts only where processes share the memory (CPU RAM).
The size of the parameters (what DDP's gradient buckets add with 2+ processes) is read off the
optimizer through torch's global step hook, so the recipe needs no change.
"""

from __future__ import annotations

import json
import runpy
import sys
import time
from pathlib import Path

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.profiler import ProfilerActivity, profile


def resident_bytes() -> int:
    """This process's resident size now (Linux /proc; 0 elsewhere)."""
    status = Path("/proc/self/status")
    if not status.exists():
        return 0
    line = next(ln for ln in status.read_text().splitlines() if ln.startswith("VmRSS"))
    return int(line.split()[1]) * 1024  # reported in kB


def run_recipe(script: str) -> int:
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else 1
    return 0


def cpu_peak(prof: profile, until_ns: int) -> int:
    """The highest sum of live bytes over the allocations and frees the profiler saw up to
    `until_ns` (its events carry wall-clock times, as time.time_ns)."""
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        if event.start_ns() > until_ns:
            break
        if event.device_type() == torch.autograd.DeviceType.CPU:
            live += event.nbytes()
            peak = max(peak, live)
    return peak


def main() -> int:
    out, script, *args = sys.argv[1:]
    grad_bytes, last_step_ns, gpu_peak = 0, 0, 0

    def note_peak(_optimizer: torch.optim.Optimizer, _args: object, _kwargs: object) -> None:
        nonlocal last_step_ns, gpu_peak
        last_step_ns = time.time_ns()
        if torch.cuda.is_initialized():
            gpu_peak = torch.cuda.max_memory_allocated()

    def note_parameters(optimizer: torch.optim.Optimizer, _args: object, _kwargs: object) -> None:
        nonlocal grad_bytes
        params = [p for group in optimizer.param_groups for p in group["params"]]
        grad_bytes = sum(p.numel() * p.element_size() for p in params)

    register_optimizer_step_pre_hook(note_parameters)
    register_optimizer_step_post_hook(note_peak)
    sys.argv = [script, *args]
    baseline = resident_bytes()
    if torch.cuda.is_available():
        code = run_recipe(script)
        kind, name, peak = "cuda", torch.cuda.get_device_name(), gpu_peak
        baseline = 0  # the GPU holds no interpreter
    else:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            code = run_recipe(script)
        kind, name, peak = "cpu", "cpu", cpu_peak(prof, last_step_ns)
    record = {"device_kind": kind, "device_name": name, "peak": peak, "baseline": baseline}
    Path(out).write_text(json.dumps({**record, "grad_bytes": grad_bytes}))
    return code


if __name__ == "__main__":
    sys.exit(main())
