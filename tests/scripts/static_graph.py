"""--ddp-static-graph in a real launch: make_accelerator with a recipe's own
DistributedDataParallelKwargs (cricket's find_unused_parameters) and the static graph, a model
with a layer it never uses, two optimizer steps.

tests/hardware/test_speed.py runs it on 2 processes (gloo); it prints what torch's DDP wrapper was
built with. Usage: static_graph.py OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from accelerate import DistributedDataParallelKwargs
from torch import nn

from accel_common.batch_lr.batching import BatchRequest
from accel_common.hardware.accelerator import make_accelerator


class Unused(nn.Module):
    """A layer and a parameter no step uses (find_unused_parameters' case)."""

    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(3, 1)
        self.unused = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


out = Path(sys.argv[1])
own = DistributedDataParallelKwargs(find_unused_parameters=True)
accelerator, plan = make_accelerator(
    output_dir=out,
    batch=BatchRequest(global_batch_size=8),
    kwargs_handlers=[own],
    ddp_static_graph=True,
)
torch.manual_seed(0)
model = nn.Sequential(Unused())
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = accelerator.prepare(model, optimizer)
data = torch.randn(16, 3, generator=torch.Generator().manual_seed(1))
share = plan.per_device_batch_size
for step in range(2):
    start = (step * accelerator.num_processes + accelerator.process_index) * share
    loss = model(data[start : start + share]).pow(2).mean()
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
if accelerator.is_main_process:
    built = {"static_graph": model.static_graph, "find_unused": model.find_unused_parameters}
    print(json.dumps({**built, "type": type(model).__name__}))
