"""Crystal property prediction with a graph transformer (ComFormer on periodic k-NN graphs).

Each structure of an extended XYZ file becomes the original ComFormer's graph: atoms are nodes,
each linked both ways to its `--max-neighbors` nearest neighbours (ties kept; periodic images
included) and to its own images along three lattice vectors. The network is the original's
iComformer layer for layer (recipes/crystal/model.py): CGCNN atom features, graph-transformer
convolutions (query/key/value/edge projections, BatchNorm-gated messages), one edge update
attending over the lattice vectors after the first, mean pooling and an MLP to one number per
structure; `--model eComformer` is its equivariant variant (e3nn tensor products of the nodes
with the edge vectors' spherical harmonics in place of the edge update). `accel-recipes convert
--from comformer best_model.pt OUT` imports the original's checkpoints of either
(recipes/crystal/convert.py).

    python recipes/train_crystal.py                                   # EMT-labelled example
    python recipes/train_crystal.py --data structures.extxyz --target formation_energy_per_atom
    python recipes/train_crystal.py predict --model runs/crystal/model --data new.extxyz --out p.csv

The original's run (its network sizes, graphs, split and optimiser: recipes/crystal/configs/),
on 8 GPUs; `--dry-run` prints the plan of any command without running it:

    accelerate launch --config_file accelerate_configs/8gpu.yaml recipes/train_crystal.py \\
        --config recipes/crystal/configs/original.yaml --data mp.extxyz \\
        --target formation_energy_per_atom --bs 512 --lr-scaling sqrt
    # plan: global 512, per device 64, accumulation 1, lr 0.002828

From Python, as the original's API (here or with num_processes=N through Accelerate's launcher):

    from recipes.crystal_api import train_from_extxyz
    metrics, model_dir = train_from_extxyz("structures.extxyz", "energy_per_atom", n_epochs=50)

Graphs are built once (matscipy neighbour search, vectorised k-nearest selection, the original's
rules) and cached as Arrow with Hugging Face `datasets`, keyed by the file's bytes and the graph
settings.
The reader, graphs, their cache and the dataset are in recipes/crystal/data.py, the network in
recipes/crystal/model.py, the example-data generator in recipes/crystal/example.py, its settings
(`CrystalSettings`) in recipes/crystal/settings.py, and the original's Python API, which runs this
script, beside it in recipes/crystal_api.py; this file is the training: loss, loop, evaluation
and `predict`.
"""

from __future__ import annotations

import csv
import math
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import typer
from accelerate import Accelerator, DistributedDataParallelKwargs
from torch import nn
from torch.utils.data import DataLoader

with warnings.catch_warnings():  # PyG's import trips torch's own torch.jit deprecation warning
    warnings.simplefilter("ignore", FutureWarning)
    from torch_geometric.loader.dataloader import Collater

from accel_common import (
    ConfigError,
    DataError,
    Decay,
    SharedSettings,
    load_exported,
    load_for_inference,
    model_option,
    new_file,
    read_recipe_export,
    require_new_file,
    require_start_export,
    run_recipe,
    sync_batchnorm,
    total_optimizer_steps,
    train_command,
)
from accel_common.data import cache_key, list_lengths, named_files, resolve_data
from recipes.crystal.convert import ORIGINAL
from recipes.crystal.data import (
    CrystalGraphs,
    build_graph,
    check_periodic,
    extxyz_file,
    load_graphs,
    read_frames,
    require_lattice,
    require_lattices,
    split_indices,
    structures_table,
    target_value,
)
from recipes.crystal.example import write_dataset
from recipes.crystal.model import (
    Comformer,
    EComformer,
    build_network,
    synchronise_batchnorm,
)
from recipes.crystal.settings import CrystalSettings

RECIPE = "crystal"
# `accel-recipes check crystal` and the tests that find every recipe run it so (see
# recipes/train_template.py): tiny, on 48 structures
CHECK_ARGS = ["--width", "16", "--layers", "2", "--max-neighbors", "8", "--rbf-bins", "16"]
CHECK_ARGS += ["--angle-bins", "16", "--fc-features", "16", "--bs", "8"]
CHECK_DATA = {"structures": 48}
# the biases right before a BatchNorm (which cancels them) get a gradient of rounding noise that
# AdamW turns into steps of about the LR, and the running means track them: N vs 1 process
# differs there by design (tests/recipes/crystal/test_training.py measured up to 10%); the
# attention BatchNorms' own biases, the smallest tensors (~4e-3), end 9e-8 apart (2e-5 of their
# size, a few ulps of the weights' scale: no batch split, which shows at 1e-2)
CHECK_NOISE = ("lin_concate.bias", ".bn.running_mean", ".bn_att.bias")
CHECK_COMMAND = ["predict", "--model", "{model}", "--data", "{data}/structures.extxyz"]
CHECK_COMMAND += ["--out", "{out}.csv"]


# --------------------------------------------------------------------------- WORKLOAD: quality


@torch.no_grad()
def evaluate(
    accelerator: Accelerator, model: nn.Module, loader: DataLoader, mean: float, std: float
) -> dict[str, float]:
    """MAE in the target's units against the predict-the-training-mean baseline."""
    model.eval()
    predictions, targets = [], []
    for graph in loader:
        pred, y = accelerator.gather_for_metrics((model(graph) * std + mean, graph.y))
        predictions.append(pred.float())
        targets.append(y.float())
    model.train()
    pred, y = torch.cat(predictions), torch.cat(targets)
    return {
        "mae": (pred - y).abs().mean().item(),
        "baseline_mae": (y - mean).abs().mean().item(),
        "n": len(y),
    }


# --------------------------------------------------------------------------- training


def build_model(args: SharedSettings | None, settings: CrystalSettings) -> Comformer | EComformer:
    """The network the settings describe; it needs no data, so --dry-run builds the same one."""
    network = build_network(
        settings.model,
        settings.width,
        settings.layers,
        settings.heads,
        settings.rbf_bins,
        settings.angle_bins,
        settings.fc_features,
        settings.batchnorm,
    )
    synchronise_batchnorm(network, settings.sync_batchnorm)
    return network


def parameter_groups(model: nn.Module) -> list[dict]:
    """AdamW's groups as the original's (train.py 105-118): no weight decay on biases and batch
    norms."""
    plain = {n for n, _ in model.named_parameters() if any(k in n for k in ("bias", "bn", "norm"))}
    decayed = [p for name, p in model.named_parameters() if name not in plain]
    kept = [p for name, p in model.named_parameters() if name in plain]
    return [{"params": decayed}, {"params": kept, "weight_decay": 0.0}]


@train_command(
    CrystalSettings,
    build_model=build_model,
    default_bs=64,
    lr=1e-2,  # the original's 1e-3 (500 epochs) learns too slowly for the CPU-sized example
    ref_bs=64,
    epochs=20,  # the original trains 500 epochs
    schedule=Decay.onecycle,
    weight_decay=1e-5,
    output_dir=Path("runs/crystal"),
    aliases={"data": ["--extxyz"]},
    replaces=("sync_batchnorm",),  # its own (on by default): its BatchNorms sync themselves
)
def train(args: SharedSettings, settings: CrystalSettings) -> dict[str, float]:
    """Train the crystal graph transformer on an extended XYZ file (or a generated example)."""
    if settings.init_from is not None:  # before the data is read
        require_start_export(settings.init_from, RECIPE, ORIGINAL)
    # synchronised BatchNorms keep their running statistics equal on every process (and the
    # other buffers are constants): DDP's broadcast of them before every forward would be one
    # more collective per step for nothing. Per-process BatchNorms keep it: evaluation and the
    # export then use the first process's statistics, as plain DDP does.
    ddp = DistributedDataParallelKwargs(broadcast_buffers=not settings.sync_batchnorm)
    accelerator, plan = args.make_accelerator(kwargs_handlers=[ddp])
    if accelerator.num_processes > 1 and not settings.sync_batchnorm:
        accelerator.print(
            "BatchNorm: each process's own statistics (--no-sync-batchnorm): this run does not "
            "take the steps of one process"
        )
    path = args.data
    if path is None or path.is_dir():
        path = extxyz_file(resolve_data(accelerator, RECIPE, path, write_dataset))
    with accelerator.main_process_first():  # the main process builds; the others read its cache
        rows, seconds, cached = load_graphs(
            path, index=settings.index, target=settings.target, per_atom=settings.per_atom,
            cutoff=settings.cutoff, max_neighbors=settings.max_neighbors,
            non_periodic=settings.non_periodic, workers=args.workers,
            cache=settings.cache_graphs, cache_dir=settings.graph_cache_dir,
        )  # fmt: skip
    if settings.non_periodic:
        require_lattices(rows, settings.model, path)
    accelerator.print(
        f"{len(rows)} graphs {'read from the cache' if cached else 'built'} in {seconds:.2f}s"
    )
    ratios = (settings.train_ratio, settings.val_ratio, settings.test_ratio)
    parts = split_indices(len(rows), ratios, settings.split_seed)
    train_set, val_set, test_set = (CrystalGraphs(rows.select(p)) for p in parts)
    y_train = np.asarray(rows.select(parts[0])["y"], dtype=np.float64)
    mean, std = float(y_train.mean()), float(y_train.std() or 1.0)

    model = build_model(args, settings)
    if settings.init_from is not None:  # fine-tuning: strictly, or a CheckpointError naming why
        load_exported(settings.init_from, model)
    if settings.batchnorm == "torch" and settings.sync_batchnorm and accelerator.num_processes > 1:
        # torch's BatchNorm1d over the global batch: SyncBatchNorm on GPUs, elsewhere the
        # float64 formula (torch's SyncBatchNorm refuses CPU tensors); one process: the
        # original's. New modules: before the optimizer takes the parameters
        sync_batchnorm(model, accelerator.device)
    optimizer = args.make_optimizer(
        torch.optim.AdamW, parameter_groups(model), lr=args.lr, weight_decay=args.weight_decay
    )
    collate = Collater(train_set)
    # each step's structures spread over the processes by their edge count (the convolutions'
    # work), so that no process waits for one holding the largest structures
    edges = list_lengths(rows.select(parts[0]), "source")
    train_loader = args.make_train_loader(train_set, plan, collate_fn=collate, costs=edges)
    val_loader, test_loader = (
        DataLoader(s, batch_size=plan.per_device_batch_size, collate_fn=collate)
        for s in (val_set, test_set)
    )
    args.adapt_model(model)  # --compile: in place, before prepare
    model, optimizer, train_loader, val_loader, test_loader = accelerator.prepare(
        model, optimizer, train_loader, val_loader, test_loader
    )
    if total_optimizer_steps(len(train_loader), max(args.epochs, 1), plan.grad_accum_steps) < 1:
        n_train = len(train_set)
        raise ConfigError(
            f"the training split ({n_train} structures) is smaller than the global batch "
            f"({plan.global_batch_size}): not one optimizer step to take; pass a smaller --bs "
            f"(batch_size= from Python), at most {n_train}, or more data"
        )
    schedule = args.make_lr_schedule(accelerator, optimizer, plan, len(train_loader))
    derived = {"mean": mean, "std": std}  # the target's scale, which predict needs too
    # the members of each split, digested: a resume on other members (another version's split)
    # is refused
    derived["split_members"] = cache_key([part.tolist() for part in parts])
    loop = args.make_loop(
        accelerator, plan, train_loader, schedule, model=model,  # model: what --ema-decay averages
        recipe=RECIPE, data_files=named_files([path], path.parent), settings=settings,
        derived=derived,
    )  # fmt: skip

    for _epoch in loop.epochs():
        for graph in loop.batches():
            with accelerator.accumulate(model):
                loss = F.mse_loss(model(graph), (graph.y - mean) / std)  # mean over structures
                accelerator.backward(loss)
                loop.clip_gradients(model)
                optimizer.step()
                optimizer.zero_grad()
            loop.record(loss)
        with loop.ema.applied():  # --ema-decay: the EMA's weights are scored (and exported)
            val = evaluate(accelerator, model, val_loader, mean, std)
            test = evaluate(accelerator, model, test_loader, mean, std)
            loop.end_epoch({"val_mae": val["mae"], **{f"test_{k}": v for k, v in test.items()}})
    return loop.finish(model)


# --------------------------------------------------------------------------- single-device use


def predict(
    model_dir: Path = model_option(RECIPE),
    data: Path = typer.Option(
        ...,
        help="Extended XYZ file of the structures to predict, or a folder holding "
        "structures.extxyz (as training reads --data).",
    ),
    out: Path = typer.Option(..., help="CSV to write: index, formula, prediction[, target]."),
    index: str = typer.Option(":", help="Frames to read, as ASE takes it."),
) -> None:
    """Predict the target for every frame of an extxyz file with an exported model, one device."""
    require_new_file(out)
    config = read_recipe_export(model_dir, RECIPE)
    settings = CrystalSettings.from_config(config)
    model = build_model(None, settings)
    device = load_for_inference(model_dir, model)
    data = extxyz_file(data)
    frames = read_frames(data, index)
    targets = []
    for i, atoms in enumerate(frames):
        check_periodic(atoms, f"{data}, frame {i}", settings.non_periodic)
        if not atoms.pbc.all():
            require_lattice(settings.model, f"{data}, frame {i}")
        try:
            where = f"{data}, frame {i}"
            targets.append(target_value(atoms, settings.target, where, settings.per_atom))
        except DataError:
            targets.append(None)
    table = structures_table(frames, None).add_column("index", list(range(len(frames))))
    graph_settings = {"cutoff": settings.cutoff, "max_neighbors": settings.max_neighbors}
    rows = table.map(build_graph, fn_kwargs=graph_settings)
    rows = rows.add_column("y", [math.nan] * len(frames))
    graphs = CrystalGraphs(rows)
    loader = DataLoader(graphs, batch_size=64, collate_fn=Collater(graphs))
    predictions = []
    with torch.no_grad():
        for graph in loader:
            predictions += (model(graph.to(device)) * config["std"] + config["mean"]).tolist()
    with new_file(out) as partial, partial.open("w", newline="") as handle:
        writer = csv.writer(handle)
        has_target = any(t is not None for t in targets)
        writer.writerow(["index", "formula", "prediction"] + [settings.target] * has_target)
        for i, (atoms, p, t) in enumerate(zip(frames, predictions, targets, strict=True)):
            # repr: the shortest text that reads back as the same float, every digit kept
            writer.writerow(
                [i, atoms.get_chemical_formula(), repr(float(p))]
                + ["" if t is None else repr(float(t))] * has_target
            )
    print(f"wrote {out}: {len(predictions)} predictions")


if __name__ == "__main__":
    run_recipe(train, predict=predict)
