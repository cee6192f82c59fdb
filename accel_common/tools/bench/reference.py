"""The reference DDP loop: what the recipes' scaling is held against.

Plain `torch.distributed` code that shares nothing with Accelerate or the recipes' loop: the
template's example data read from its CSV, an MLP of the template's shape, DistributedDataParallel,
DistributedSampler and AdamW. One process without torchrun, otherwise one worker of it
(`python -m accel_common.tools.bench`); it logs samples/s as the recipes do. It imports no
recipe: tests/tools/test_bench.py holds its data and initial model to the template recipe's.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from accel_common.data.files import read_numeric_csv
from accel_common.monitoring.sync_wait import SyncWaitTimer, timing_requested
from accel_common.monitoring.tracking import METRICS_FILE


def read_train_split(data: Path) -> TensorDataset:
    """The template's `train.csv` (columns x0..xD-1, y) as (features, target) tensors, read as
    the template recipe reads it."""
    names, table = read_numeric_csv(data / "train.csv", required=["y"])
    target = names.index("y")
    features = [i for i in range(len(names)) if i != target]
    return TensorDataset(table[:, features], table[:, target : target + 1])


def mlp(in_features: int, hidden: int, depth: int) -> nn.Sequential:
    """The template's MLPRegressor written out: `depth` x (Linear, SiLU), then Linear to 1, its
    layers made in the same order, so the same seed gives the same initial weights."""
    layers: list[nn.Module] = []
    width = in_features
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.SiLU()]
        width = hidden
    layers.append(nn.Linear(width, 1))
    return nn.Sequential(*layers)


def reference_loop(argv: Sequence[str] | None = None) -> None:
    """Plain PyTorch DDP: what the recipes' scaling is held against. One process without
    torchrun, otherwise one worker of it; logs samples/s like the recipes do."""
    parser = argparse.ArgumentParser(description="Hand-written DDP loop (reference).")
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--per-device-bs", type=int, required=True)
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--log-every", type=int, required=True)
    parser.add_argument("--hidden", type=int, required=True)
    parser.add_argument("--depth", type=int, required=True)
    parser.add_argument("--cpu", action="store_true")
    args = parser.parse_args(argv)

    distributed = "WORLD_SIZE" in os.environ  # set by torchrun
    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cpu")
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    if distributed:
        dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)

    dataset = read_train_split(args.data)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, seed=0, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.per_device_bs, sampler=sampler, drop_last=True)

    torch.manual_seed(0)
    in_features = dataset.tensors[0].shape[1]
    model: nn.Module = mlp(in_features, args.hidden, args.depth).to(device)
    timer = None
    if distributed:
        model = DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
        if timing_requested():  # the recipes' timing of the all-reduce wait, for comparison
            timer = SyncWaitTimer()
            timer.attach(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)

    log = None
    if rank == 0:
        (args.output_dir / "logs").mkdir(parents=True, exist_ok=True)
        log = (args.output_dir / "logs" / METRICS_FILE).open("w", buffering=1)
        # as the recipes' first record: the run's global batch (the benchmark's step time)
        log.write(json.dumps({"config": {"global_batch_size": args.per_device_bs * world}}) + "\n")
    samples = args.per_device_bs * world * args.log_every
    step, epoch, window_start = 0, 0, time.perf_counter()
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                loss = F.mse_loss(model(x.to(device)), y.to(device))
            loss.backward()
            if timer is not None:
                timer.backward_done()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if timer is not None:
                timer.take_step()
            if step % args.log_every == 0:  # as the recipes log: the loss averaged over ranks
                loss = loss.detach()
                if distributed:
                    dist.all_reduce(loss)  # a sum: gloo has no average
                now = time.perf_counter()
                record = {"step": step, "train/loss": loss.item() / world}
                if timer is not None:
                    waits = [torch.zeros(1) for _ in range(world)]
                    dist.all_gather(waits, torch.tensor([timer.take_mean_ms()]))
                    record["train/sync_wait_ms_min"] = min(w.item() for w in waits)
                    record["train/sync_wait_ms_max"] = max(w.item() for w in waits)
                record["train/samples_per_s"] = samples / (now - window_start)
                window_start = now
                if log is not None:
                    log.write(json.dumps(record) + "\n")
            if step >= args.max_steps:
                break
        epoch += 1
    if log is not None:
        log.close()
    if distributed:
        dist.barrier()  # no rank tears gloo down while another still talks to it
        dist.destroy_process_group()
