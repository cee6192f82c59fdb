"""Template recipe: the smallest complete training recipe. Copy it with `accel-recipes new NAME`.

It regresses y from a row of features (CSV files `train.csv` / `test.csv`, columns x0..xD-1, y)
with an MLP, and shows every part a recipe needs, in the order a reader meets them:

    data -> model -> evaluation -> set-up (accelerator, loaders, LR schedule) -> training loop
    -> export -> `evaluate` command that loads the export on one device

Launch it unchanged on 1 CPU, 2 CPU processes, N GPUs or several nodes:

    python recipes/train_template.py
    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml recipes/train_template.py
    accelerate launch --config_file accelerate_configs/8gpu.yaml recipes/train_template.py --bs 512
    python recipes/train_template.py evaluate --model runs/template/model

Check a command's plan (batch, LR, parameters, memory) without running it, for any process count:

    python recipes/train_template.py --bs 512 --dry-run --processes 8

What a new workload replaces is marked WORKLOAD: `write_dataset` (a small example in your data's
format: `accel-recipes make-data NAME DIR` finds it here), `load_split` (read your data),
`MLPSettings` (your model's settings: flags, `--help`, `--config` keys, the export's config and the
resume check all come from it), `MLPRegressor`, `build_model` and `build_optimizer` (the
`--dry-run` builds them too), `evaluate` (your quality measure next to a trivial baseline),
`evaluate_export`, and in `train` the lines that load data, the
files they read (`data_files`: their contents are part of the run's identity, so a resume on
changed data is refused; tests/data/test_data_files.py checks the list against the files opened),
the values the export needs besides the settings (`derived`), the forward pass and loss, and the
evaluation at each epoch's end. Keep the rest: `accelerator.backward`, the optimizer step inside
`accelerator.accumulate`, and the `loop` calls, which do the bookkeeping every recipe shares
(epochs, step counting, LR schedule, logging: accel_common/training/loop.py; the run's identity,
resume, checkpoints and export: accel_common/training/run.py; with `model=model` and `with
loop.ema.applied():`, the EMA of the weights that --ema-decay keeps: accel_common/training/ema.py).
A recipe is found by existing: `accel-recipes make-data`, `accel-recipes check NAME` (what the
library promises every recipe, proved on the CPU) and the tests discover every
`recipes/train_*.py`, no list to edit; they run it as `CHECK_ARGS`, `CHECK_DATA`,
`CHECK_COMMAND` and `CHECK_RESUME` below declare (WORKLOAD: yours).
A workload that outgrows one file keeps this script and moves its model, readers and example
generator into `recipes/NAME/` (see recipes/pointcloud/). That folder holds the script's parts: the
script imports them, and none of them imports the script (tests/test_layout.py checks it), so what
a part needs from here moves into the folder with it (e.g. the settings, to
`recipes/NAME/settings.py`, once convert.py builds the network from them). From a plain DDP
script to a recipe, step by step: docs/porting.md.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import typer
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from accel_common import (
    MAX_BLOCKS,
    Settings,
    SharedSettings,
    format_metrics,
    load_exported,
    model_option,
    read_recipe_export,
    require_start_export,
    run_recipe,
    setting,
    train_command,
)
from accel_common.data import (
    existing_data,
    named_files,
    per_sample_rng,
    read_numeric_csv,
    resolve_data,
)

RECIPE = "template"
FEATURES = 8  # columns x0..x7 in the generated example
NOISE = 0.1
# WORKLOAD: how `accel-recipes check template` (and the tests, which find every recipe by its
# file) run this recipe: small, with the global batch given (--bs: the same on 1 and 2
# processes) and any randomness drawn per process switched off (e.g. --dropout 0), so that 2
# processes train exactly as 1 does; on an example of CHECK_DATA's size (write_dataset's
# options); CHECK_COMMAND is the single-device command that loads the export ({model}, {data},
# {out} are filled in).
CHECK_ARGS = ["--hidden", "32", "--bs", "32"]
CHECK_DATA = {"train_size": 128, "test_size": 32}
CHECK_COMMAND = ["evaluate", "--model", "{model}", "--data", "{data}"]
# CHECK_RESUME: what the kill-and-resume test (tests/training/test_resume.py: one process, 2 epochs,
# killed in the second) adds to CHECK_ARGS: randomness and state a resume must restore bit for bit
# (here per-row noise on the features; elsewhere dropout, which CHECK_ARGS turns off, or an EMA).
CHECK_RESUME = ["--jitter", "0.1"]


# --------------------------------------------------------------------------- WORKLOAD: data


def target(x: np.ndarray, seed: int = 1234) -> np.ndarray:
    """The example's ground truth y = f(x): smooth and nonlinear, so a model can learn it and the
    predict-the-mean baseline cannot."""
    w = np.random.default_rng(seed).normal(size=(x.shape[1], 3)) / np.sqrt(x.shape[1])
    z = x @ w
    return np.sin(2.0 * z[:, 0]) + 0.5 * z[:, 1] ** 2 + np.tanh(z[:, 2])


def write_dataset(
    out_dir: Path,
    *,
    train_size: int = 2048,
    test_size: int = 512,
    features: int = FEATURES,
    seed: int = 0,
) -> Path:
    """The example data set: train.csv / test.csv of x0..xD-1, y (with small noise)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for split, size in (("train", train_size), ("test", test_size)):
        x = rng.normal(size=(size, features))
        y = target(x) + NOISE * rng.normal(size=size)
        with (out_dir / f"{split}.csv").open("w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow([*(f"x{i}" for i in range(features)), "y"])
            writer.writerows(
                [*(f"{v:.6f}" for v in row), f"{t:.6f}"] for row, t in zip(x, y, strict=True)
            )
    return out_dir


def load_split(data_dir: Path, split: str, columns: list[str] | None = None) -> TensorDataset:
    """Read `<split>.csv` into (features, target) tensors; bad rows name their line, and a
    header other than `columns` (the training split's) is refused at load."""
    names, table = read_numeric_csv(data_dir / f"{split}.csv", required=["y"], columns=columns)
    target = names.index("y")
    features = [i for i in range(len(names)) if i != target]
    dataset = TensorDataset(table[:, features], table[:, target : target + 1])
    dataset.columns = names
    return dataset


class Jittered(Dataset):
    """The training rows with Gaussian noise on their features (--jitter), drawn for each row
    and epoch inside `per_sample_rng`: the same draws whichever process reads a row and after a
    resume, so N processes train as 1. WORKLOAD: your augmentation (torchvision's random
    transforms draw from the same global RNG, and are made exact the same way)."""

    def __init__(self, rows: TensorDataset, std: float, seed: int) -> None:
        self.rows, self.std, self.seed, self.epoch = rows, std, seed, 0

    def set_epoch(self, epoch: int) -> None:  # the loop calls it before each epoch
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.rows[index]
        with per_sample_rng(self.seed, self.epoch, index):
            return x + self.std * torch.randn_like(x), y


# --------------------------------------------------------------------------- WORKLOAD: model


@dataclass
class MLPSettings(Settings):
    """The model's settings: each one is a flag, a `--config` key and part of the run identity."""

    hidden: int = setting(64, "Width of the MLP's hidden layers.", min=1)
    depth: int = setting(2, "Number of hidden layers.", min=1, max=MAX_BLOCKS)
    init_from: Path | None = setting(
        None,
        "Start from the weights of an export (fine-tuning): this recipe's, or a foreign "
        f"checkpoint converted with `accel-recipes convert CKPT OUT --recipe {RECIPE}`; loaded "
        "strictly, so --hidden and --depth must be its sizes.",
    )
    jitter: float = setting(
        0.0, "Std of Gaussian noise on each training row's features, per row and epoch.", min=0
    )


class MLPRegressor(nn.Module):
    def __init__(self, in_features: int, hidden: int, depth: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = in_features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.SiLU()]
            width = hidden
        layers.append(nn.Linear(width, 1))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def build_model(args: SharedSettings, settings: MLPSettings) -> MLPRegressor:
    """The network for `--dry-run`: as wide as --data's feature columns, read as the run reads
    them (or the example's); a --data this machine lacks leaves it uncounted (DataError)."""
    features = FEATURES
    if args.data is not None:
        features = load_split(existing_data(RECIPE, args.data), "train").tensors[0].shape[1]
    return MLPRegressor(features, settings.hidden, settings.depth)


def build_optimizer(
    args: SharedSettings, settings: MLPSettings, model: nn.Module
) -> torch.optim.Optimizer:
    """The optimizer `train` uses, also built by `--dry-run` to size its state per device;
    `args.make_optimizer` is the class called as usual, fused with --fused-optimizer."""
    return args.make_optimizer(
        torch.optim.AdamW, model.parameters(), lr=args.lr, weight_decay=args.weight_decay
    )


# --------------------------------------------------------------------------- WORKLOAD: quality


@torch.no_grad()
def evaluate(
    accelerator: Accelerator, model: nn.Module, loader: DataLoader, train_mean: float
) -> dict[str, float]:
    """Test MSE against the predict-the-training-mean baseline, over exactly the test set.

    `gather_for_metrics` drops the samples Accelerate repeats to give every process equal batches,
    so the metric covers each test row once whatever the number of processes.
    """
    model.eval()
    predictions, targets = [], []
    for x, y in loader:
        pred, y = accelerator.gather_for_metrics((model(x), y))
        predictions.append(pred.float())
        targets.append(y.float())
    model.train()
    pred, y = torch.cat(predictions), torch.cat(targets)
    mse = F.mse_loss(pred, y).item()
    baseline = F.mse_loss(torch.full_like(y, train_mean), y).item()
    return {"test_mse": mse, "baseline_mse": baseline, "r2": 1.0 - mse / baseline, "n": len(y)}


# --------------------------------------------------------------------------- training


@train_command(
    MLPSettings,
    build_model=build_model,
    build_optimizer=build_optimizer,
    default_bs=64,
    lr=3e-3,
    ref_bs=64,
    epochs=20,
    output_dir=Path("runs/template"),
)
def train(args: SharedSettings, settings: MLPSettings) -> dict[str, float]:
    """Train the template MLP regressor on CSV data (or a generated example)."""
    if settings.init_from is not None:  # before the data is read: not an export is one line
        require_start_export(settings.init_from, RECIPE, None)  # WORKLOAD: your original's name
    accelerator, plan = args.make_accelerator()
    data_dir = resolve_data(accelerator, RECIPE, args.data, write_dataset)
    train_set = load_split(data_dir, "train")  # WORKLOAD
    test_set = load_split(data_dir, "test", columns=train_set.columns)
    train_mean = train_set.tensors[1].mean().item()

    model = MLPRegressor(train_set.tensors[0].shape[1], settings.hidden, settings.depth)
    if settings.init_from is not None:  # fine-tuning: strictly, or one line naming the misfit
        load_exported(settings.init_from, model)
    optimizer = build_optimizer(args, settings, model)  # WORKLOAD: your optimizer
    rows = Jittered(train_set, settings.jitter, args.seed) if settings.jitter else train_set
    train_loader = args.make_train_loader(rows, plan)
    test_loader = DataLoader(test_set, batch_size=plan.per_device_batch_size * 4)
    args.adapt_model(model)  # --sync-batchnorm, --compile: in place, before prepare
    model, optimizer, train_loader, test_loader = accelerator.prepare(
        model, optimizer, train_loader, test_loader
    )
    schedule = args.make_lr_schedule(accelerator, optimizer, plan, len(train_loader))
    # WORKLOAD: what evaluate_export needs besides the settings
    derived = {"target_mean": train_mean, "columns": train_set.columns}
    # WORKLOAD: every file the data readers open
    data_files = named_files([data_dir / "train.csv", data_dir / "test.csv"], data_dir)
    loop = args.make_loop(
        accelerator, plan, train_loader, schedule, model=model,  # model: what --ema-decay averages
        recipe=RECIPE, data_files=data_files, settings=settings, derived=derived,
    )  # fmt: skip
    for _epoch in loop.epochs():
        for x, y in loop.batches():
            with accelerator.accumulate(model):
                loss = F.mse_loss(model(x), y)  # WORKLOAD: forward pass and loss
                accelerator.backward(loss)
                loop.clip_gradients(model)
                optimizer.step()
                optimizer.zero_grad()
            loop.record(loss)
            if loop.eval_due():  # --eval-every N optimizer steps, besides the epoch end
                with loop.ema.applied():
                    loop.log_eval(evaluate(accelerator, model, test_loader, train_mean))
        # with --ema-decay the model holds the EMA of its weights for the block: what is scored
        # (and exported by finish); else the model as it is
        with loop.ema.applied():
            loop.end_epoch(evaluate(accelerator, model, test_loader, train_mean))  # WORKLOAD
    return loop.finish(model)


def evaluate_export(
    model_dir: Path = model_option(RECIPE),
    data: Path = typer.Option(
        Path("data/example/template"), "--data", help="Folder holding the CSV to score."
    ),
    split: str = typer.Option("test", help="Which CSV to score: <data>/<split>.csv."),
) -> None:
    """Load an exported model on one device and score a CSV split against the mean baseline."""
    config = read_recipe_export(model_dir, RECIPE)
    settings = MLPSettings.from_config(config)
    # the training split's columns, so that a CSV with others is named, not a size mismatch
    dataset = load_split(data, split, columns=config.get("columns"))  # None: an older export
    model = MLPRegressor(dataset.tensors[0].shape[1], settings.hidden, settings.depth)
    load_exported(model_dir, model)
    accelerator = Accelerator(cpu=not torch.accelerator.is_available())
    model = accelerator.prepare(model)
    loader = DataLoader(dataset, batch_size=256)
    print(format_metrics(evaluate(accelerator, model, loader, config["target_mean"])))


if __name__ == "__main__":
    run_recipe(train, evaluate=evaluate_export)
