"""Cricket score prediction with lyndonkl/cricketmodel's heterogeneous graph neural network
(Cricsheet match JSON).

Every delivery after the first of a T20 innings becomes the original's graph of the state before
it is bowled (21 node types: entities, match state, actor state, dynamics, one node per earlier
delivery, a query node; 166 edge types), and its `CricketHeteroGNN` (or, with --model,
`CricketHeteroGNNFull`) predicts the runs from that delivery to an over boundary, trained with
SmoothL1 on raw runs as the original (`--target next-balls`: the runs in the next 5 overs of
legal balls instead).

    python recipes/train_cricket.py                                  # simulated example
    python recipes/train_cricket.py --data t20s_male_json/ --split-by-date
    accelerate launch --config_file accelerate_configs/8gpu.yaml recipes/train_cricket.py \\
        --data t20s_male_json/ --per-device-bs 64 --epochs 100 --patience 10
    python recipes/train_cricket.py predict --model runs/cricket/model --match 1001349.json \\
        --out 1001349.csv
    python recipes/train_cricket.py --config recipes/cricket/configs/original.yaml --dry-run

The workload's settings are declared once in `CricketSettings` (recipes/cricket/settings.py:
flags, `--config` keys, the export's config and the resume check);
recipes/cricket/configs/original.yaml is the original project's run, and `--dry-run
[--processes N]` prints a run's plan without starting it.

Parsing and features are computed once and cached as Arrow with Hugging Face `datasets`, keyed
by the files' bytes and the settings; graphs are assembled from the cached arrays per sample.
The reader is recipes/cricket/parsing.py, the features of an innings innings.py, the cache
loading.py (with split.py and vocab.py), the samples and graphs samples.py and graphs.py, the
original's features and edges features.py and schema.py, the network recipes/cricket/model.py,
its checkpoints in and out convert.py, the match simulator behind the example data
recipes/cricket/example.py; this file is the training: loss, loop, evaluation and `predict`.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch
import torch.nn.functional as F
import typer
from accelerate import Accelerator, DistributedDataParallelKwargs
from torch import nn
from torch.utils.data import DataLoader

from accel_common import (
    BatchPlan,
    ConfigError,
    DataError,
    Decay,
    SharedSettings,
    load_for_inference,
    model_option,
    new_file,
    read_export_weights,
    read_recipe_export,
    require_new_file,
    require_same_tensors,
    require_start_export,
    run_recipe,
    say,
    train_command,
)
from accel_common.data import existing_data, list_column, named_files, require_regular, resolve_data
from recipes.cricket.baseline import PhaseBaseline
from recipes.cricket.convert import ORIGINAL, read_vocabulary
from recipes.cricket.example import write_dataset
from recipes.cricket.graphs import CricketGraphs
from recipes.cricket.innings import innings_features
from recipes.cricket.loading import FEATURES, SKIPPED, load_innings
from recipes.cricket.parsing import NotAMatch, match_registries, parse_match
from recipes.cricket.samples import Deliveries
from recipes.cricket.settings import CricketSettings, network
from recipes.cricket.vocab import VOCAB_FILE, keyed_by_registry, vocab_sizes

RECIPE = "cricket"
# `accel-recipes check cricket` and the tests that find every recipe run it so (see
# recipes/train_template.py): tiny, every 8th delivery, dropout off
CHECK_ARGS = ["--hidden", "16", "--heads", "2", "--layers", "2", "--history", "6", "--bs", "8"]
CHECK_ARGS += ["--dropout", "0", "--sample-every", "8", "--val-ratio", "0.2", "--test-ratio", "0.2"]
CHECK_DATA = {"matches": 12}
CHECK_COMMAND = ["predict", "--model", "{model}", "--match", "{data}/1000001.json"]
CHECK_COMMAND += ["--out", "{out}.csv"]
# the kill-and-resume test: dropout on (its default), 13 steps an epoch
CHECK_RESUME = ["--dropout", "0.1", "--bs", "16"]


def start_files(export: Path) -> tuple[Path, Path]:
    """--init-from's weights file and the vocabulary beside it."""
    weights = export / "model.safetensors" if export.is_dir() else export
    return weights, weights.parent / VOCAB_FILE


def read_start(export: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """--init-from: an export's weights and the vocabulary its embeddings were trained with."""
    weights = require_start_export(export, RECIPE, ORIGINAL)
    vocab_path = weights.parent / VOCAB_FILE
    if not vocab_path.is_file():
        raise ConfigError(
            f"--init-from {export}: no {VOCAB_FILE} beside it (the vocabulary its embeddings "
            "were trained with); convert cricketmodel's checkpoint with its entity_mapper.pkl "
            "beside it, or use an export of train"
        )
    return read_export_weights(weights), read_vocabulary(vocab_path)


def require_start_fits(model: nn.Module, state: dict[str, torch.Tensor], export: Path) -> None:
    """Stop with one line naming the first tensor of `state` that `model` has not."""
    where = (
        f"--init-from {export}: not this network (--model, --hidden, --layers and --heads must "
        "be the export's)"
    )
    require_same_tensors(state, model.state_dict(), where)


def innings_options(args: SharedSettings, settings: CricketSettings) -> dict[str, Any]:
    """`load_innings`' settings: the run and its --dry-run read the same vocabulary."""
    return {
        "match_types": [t for t in settings.match_types.split(",") if t],
        "strict": settings.strict,
        # rounded: 1 - 0.15 - 0.05 is 0.7999999999999999, whose int(n x ratio) the original's
        # 0.8 would not give
        "ratios": (round(1 - settings.val_ratio - settings.test_ratio, 12), settings.val_ratio),
        "split_seed": args.seed if settings.split_seed is None else settings.split_seed,
        "split_by_date": settings.split_by_date,
        "min_matches": settings.min_matches,
        "workers": args.workers,
        "cache_dir": settings.graph_cache_dir,
        "retired_is_wicket": settings.retired_is_wicket,
    }


def build_model(args: SharedSettings, settings: CricketSettings) -> nn.Module:
    """The network for `--dry-run`, sized as the run sizes it: by --init-from's vocabulary (and
    checked against its weights, as the run checks them), else by the training split's
    vocabulary of --data or the example, read as the run reads it (its cache then serves the
    run). Embedding tables are most of the parameters; a guessed vocabulary missed them."""
    if settings.init_from is not None:
        if not settings.init_from.exists():  # planned on another machine than the run's
            raise DataError(f"--init-from {settings.init_from}: not on this machine")
        state, vocab = read_start(settings.init_from)
        model = network(settings, vocab_sizes(vocab))
        require_start_fits(model, state, settings.init_from)
        return model
    folder = existing_data(RECIPE, args.data)
    shown = not datasets.utils.are_progress_bars_disabled()
    datasets.disable_progress_bars()  # the plan is the dry run's output
    try:
        _, info = load_innings(folder, **innings_options(args, settings))
    finally:
        if shown:
            datasets.enable_progress_bars()
    return network(settings, vocab_sizes(info["vocab"]))


def keeps_last_batch(settings: CricketSettings, plan: BatchPlan) -> bool:
    """Whether the run trains on each epoch's last incomplete batch: with --keep-last-batch, as
    cricketmodel on one GPU, where one process takes one batch per step; on several processes
    (or with accumulation) it is dropped, as cricketmodel drops it under DDP, so that N
    processes still take one process's steps (make_train_loader)."""
    return settings.keep_last_batch and plan.num_processes * plan.grad_accum_steps == 1


# --------------------------------------------------------------------------- WORKLOAD: quality


def regression_metrics(pred: torch.Tensor, y: torch.Tensor, prefix: str = "") -> dict[str, float]:
    """MAE and RMSE (runs) and R^2 of `pred` against `y`, R^2 as scikit-learn and torchmetrics
    define it (constant targets: 1 if predicted exactly, else 0). Written out because each is one
    line and torchmetrics would add ~2 CPU-s of import (and a torch.jit warning) to each process."""
    pred, y = pred.double(), y.double()
    residual, spread = ((pred - y) ** 2).sum(), ((y - y.mean()) ** 2).sum()
    r2 = 1 - residual / spread if spread > 0 else float(residual == 0)
    return {
        f"{prefix}mae": (pred - y).abs().mean().item(),
        f"{prefix}rmse": ((pred - y) ** 2).mean().sqrt().item(),  # the original reports it too
        f"{prefix}r2": float(r2),
    }


@torch.no_grad()
def evaluate(
    accelerator: Accelerator, model: nn.Module, loader: DataLoader, mean: float
) -> dict[str, float]:
    """MAE and R^2 in runs against the training mean and the phase-aware baseline."""
    model.eval()
    predictions, targets, baselines = [], [], []
    for graph in loader:
        pred, y, base = accelerator.gather_for_metrics((model(graph), graph.y, graph.baseline))
        predictions.append(pred.float())
        targets.append(y.float())
        baselines.append(base.float())
    model.train()
    pred, y, base = torch.cat(predictions), torch.cat(targets), torch.cat(baselines)
    return {
        **regression_metrics(pred, y),
        **regression_metrics(torch.full_like(y, mean), y, "mean_"),
        **regression_metrics(base, y, "phase_"),
        "n": len(y),
    }


# --------------------------------------------------------------------------- training


def prepare_data(
    accelerator: Accelerator,
    args: SharedSettings,
    settings: CricketSettings,
    vocab: dict[str, Any] | None = None,
) -> tuple[datasets.Dataset, dict[str, Any]]:
    """The innings table, built by the main process first (the others read its cache), and a
    one-line summary of what was read and skipped. `vocab`: a model's to fine-tune, instead of
    the training split's."""
    folder = resolve_data(accelerator, RECIPE, args.data, write_dataset)
    with accelerator.main_process_first():
        rows, info = load_innings(folder, **innings_options(args, settings), vocab=vocab)
    info["data_files"] = named_files(info["files"], folder)
    if vocab is not None:  # the given vocabulary decides the features as much as the matches
        vocab_path = start_files(settings.init_from)[1]
        info["data_files"] |= named_files([vocab_path], vocab_path.parent, "--init-from/")
    for file, note in info["not_matches"]:
        say(accelerator, f"warning: skipped {folder / file}: {note} (--strict stops instead)")
    summary = info["summary"]
    skipped = ", ".join(f"{summary[k]} {text}" for k, text in SKIPPED.items() if summary[k])
    say(
        accelerator,
        f"{summary['files']} files: {summary['matches']} matches, {summary['innings']} innings"
        f" used; {summary['super_over_innings']} super-over innings excluded"
        + (f"; skipped {skipped}" if skipped else "")
        + f" ({'read from the cache' if info['cached'] else 'built'} in {info['seconds']:.1f}s)",
    )
    return rows, info


@train_command(
    CricketSettings,
    build_model=build_model,
    default_per_device_bs=64,
    lr=1e-3,
    ref_bs=64,
    epochs=8,  # the original trains up to 100 with early stopping
    schedule=Decay.cosine,
    warmup_steps=100,  # a short ramp; the original holds its first 5 epochs at the peak LR
    weight_decay=0.01,
    clip_grad=1.0,
    output_dir=Path("runs/cricket"),
)
def train(args: SharedSettings, settings: CricketSettings) -> dict[str, float]:
    """Train the heterogeneous GNN on Cricsheet match JSON (or a simulated example)."""
    # the original's network updates every node type in every block but reads out only the query
    # (and, in the Full model, the actors): the last block's other convolutions get no gradient,
    # which DDP must be told (the original sets the same)
    accelerator, plan = args.make_accelerator(
        [DistributedDataParallelKwargs(find_unused_parameters=True)]
    )
    start = read_start(settings.init_from) if settings.init_from is not None else None
    rows, info = prepare_data(accelerator, args, settings, start[1] if start else None)
    deliveries = Deliveries(rows, target=settings.target)
    used = deliveries.rank % settings.sample_every == 0
    train = used & (deliveries.split == 0)
    y_train = deliveries.y[train]
    baseline = PhaseBaseline.fit(deliveries.over[train], deliveries.wickets[train], y_train)
    train_set, val_set, test_set = (
        CricketGraphs(
            deliveries,
            used & (deliveries.split == k),
            settings.history,
            baseline,
            settings.unknown_player_team,
        )
        for k in range(3)
    )
    # a fine-tuned model keeps its own vocabulary (build_model sizes the dry run's alike)
    sizes = vocab_sizes(start[1] if start else info["vocab"])
    std = float(y_train.std() or 1.0)
    model = network(settings, sizes, baseline.mean)
    if start is not None:  # fine-tuning: before the optimizer and DDP see the weights
        require_start_fits(model, start[0], settings.init_from)
        model.load_state_dict(start[0], strict=True)
    optimizer = args.make_optimizer(
        torch.optim.AdamW, model.parameters(), lr=args.lr, weight_decay=args.weight_decay
    )
    # each step's deliveries spread over the processes by the nodes of their graphs (the
    # history's ball nodes vary, one node of every other type)
    nodes = np.minimum(deliveries.pos[train_set.index], settings.history)
    nodes += len(train_set.graph(0).node_types) - 1
    keep_last = keeps_last_batch(settings, plan)
    if settings.keep_last_batch and not keep_last:
        say(
            accelerator,
            f"--keep-last-batch: dropped on {plan.describe()}; kept on one process without "
            "accumulation only (as cricketmodel drops it under DDP)",
        )
    loaders = [
        args.make_train_loader(
            train_set, plan, train_set.collate, costs=nodes, drop_last=not keep_last
        )
    ]
    loaders += [
        DataLoader(s, plan.per_device_batch_size, collate_fn=s.collate) for s in (val_set, test_set)
    ]
    args.adapt_model(model)  # --sync-batchnorm, --compile: in place, before prepare
    model, optimizer, train_loader, val_loader, test_loader = accelerator.prepare(
        model, optimizer, *loaders
    )
    schedule = args.make_lr_schedule(accelerator, optimizer, plan, len(train_loader))
    # what predict needs besides the settings: vocabulary sizes, target statistics, baseline
    derived = {"vocab_sizes": sizes, "mean": baseline.mean, "std": std}
    derived["baseline"] = baseline.table.tolist()
    derived["split_members"] = info["split_members"]  # a resume on other members is refused
    loop = args.make_loop(
        accelerator, plan, train_loader, schedule, model=model,  # model: what --ema-decay averages
        recipe=RECIPE, settings=settings, data_files=info["data_files"], derived=derived,
        monitor="val_mae",
        patience=settings.patience, min_epochs=settings.min_epochs,
        min_delta=settings.min_delta,
    )  # fmt: skip

    for _epoch in loop.epochs():
        for graph in loop.batches():
            with accelerator.accumulate(model):
                loss = F.smooth_l1_loss(model(graph), graph.y, beta=settings.huber_delta)
                accelerator.backward(loss)
                loop.clip_gradients(model)
                optimizer.step()
                optimizer.zero_grad()
            loop.record(loss)
        with loop.ema.applied():  # --ema-decay: the EMA's weights are scored (and exported)
            val = evaluate(accelerator, model, val_loader, baseline.mean)
            test = evaluate(accelerator, model, test_loader, baseline.mean)
            metrics = {f"val_{k}": v for k, v in val.items()} | {
                f"test_{k}": v for k, v in test.items()
            }
            loop.end_epoch(metrics, model)
    metrics = loop.finish(model)
    if accelerator.is_main_process:  # predict maps names with the training vocabulary
        vocab = start[1] if start else info["vocab"]  # a fine-tuned model keeps its own
        (args.output_dir / "model" / VOCAB_FILE).write_text(json.dumps(vocab))
    return metrics


# --------------------------------------------------------------------------- single-device use


def predict(
    match: Path = typer.Option(..., help="One Cricsheet match JSON file."),
    out: Path = typer.Option(..., help="CSV to write, one row per sample (delivery)."),
    model_dir: Path = model_option(RECIPE),
) -> None:
    """Predict the model's target (--target) before every sample delivery of one match."""
    require_new_file(out)
    require_regular(match, "--match ", "; give one Cricsheet match .json file")
    config = read_recipe_export(model_dir, RECIPE)
    settings = CricketSettings.from_config(config)
    # an export is a folder, or a .safetensors whose vocabulary lies beside it (convert's OUT)
    vocab_path = (model_dir if model_dir.is_dir() else model_dir.parent) / VOCAB_FILE
    if not vocab_path.is_file():
        raise DataError(
            f"--model {model_dir}: no {VOCAB_FILE} beside it ({vocab_path}); export the model "
            "again with train, or convert the original's checkpoint with its entity_mapper.pkl "
            "beside it"
        )
    vocab = read_vocabulary(vocab_path)
    model = network(settings, config["vocab_sizes"])
    device = load_for_inference(model_dir, model)
    try:
        _, records = parse_match(match, tuple(settings.match_types.split(",")))
    except NotAMatch as err:
        raise DataError(f"{match}: {err}") from None
    records = [r for r in records if r["status"] == "ok"]
    if not records:
        raise DataError(f"{match}: no innings to predict (other match type, or no result)")
    # a converted original's vocabulary names players; this recipe keys them by registry id
    vocab = keyed_by_registry(vocab, match_registries([match]))
    table = datasets.Dataset.from_list([
        {"file": match.name, "innings": r["innings"], "split": 0}
        | innings_features(r, vocab, settings.retired_is_wicket) for r in records
    ], features=FEATURES)  # fmt: skip
    deliveries = Deliveries(table, target=settings.target)
    baseline = PhaseBaseline(config["baseline"], config["mean"])
    everything = np.ones(len(deliveries.row), dtype=bool)
    graphs = CricketGraphs(
        deliveries, everything, settings.history, baseline, settings.unknown_player_team
    )
    loader = DataLoader(graphs, batch_size=256, collate_fn=graphs.collate)
    predictions = []
    with torch.no_grad():
        for graph in loader:
            predictions += model(graph.to(device)).tolist()
    legal = list_column(table, "legal_before")[0][deliveries.flat]
    score = list_column(table, "score")[0][deliveries.flat]
    with new_file(out) as partial, partial.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["innings", "over_ball", "score", "predicted", "actual"])
        for k, pred in enumerate(predictions):
            innings, balls = records[deliveries.row[k]]["innings"], int(legal[k])
            over_ball = f"{balls // 6}.{balls % 6 + 1}"
            writer.writerow([innings, over_ball, score[k], f"{pred:.4f}", f"{deliveries.y[k]:g}"])
    print(f"wrote {out}: {len(predictions)} deliveries")


if __name__ == "__main__":
    run_recipe(train, predict=predict)
