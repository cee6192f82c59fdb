"""Point-cloud completion by diffusion (pcdiff on SkullBreak): generate a skull defect's implant.

A conditional DDPM over point clouds. Each sample is a defective skull (conditioning, kept clean)
and the points of its implant (noised); the original's PVCNN2 predicts the noise on the implant
points only. Sampling (DDPM or DDIM) turns random points into an implant that fills the defect.

    python recipes/train_pointcloud.py                                 # built-in example skulls
    accelerate launch --config_file accelerate_configs/8gpu.yaml recipes/train_pointcloud.py \\
        --config recipes/pointcloud/configs/original.yaml --path datasets/SkullBreak/train.csv \\
        --bs 64                                      # the original's sizes and hyper-parameters
    # plan: global 64, per device 8, accumulation 1, lr 0.0016
    python recipes/train_pointcloud.py evaluate --model runs/pointcloud/model --data DIR
    python recipes/train_pointcloud.py complete --model runs/pointcloud/model \\
        --skull defective_skull/bilateral/070_surf.npy --out implant.npy --png view.png

Data: the SkullBreak layout as the original's preprocessing leaves it (train.csv / test.csv
listing complete_skull/070_surf.npy; each row expands to the five defect types,
defective_skull/<defect>/070_surf.npy and implant/<defect>/070_surf.npy, in the folder before the
row's complete_skull/: the CSV's own, or another tree's). From the downloaded .nrrd volumes:
`python recipes/train_pointcloud.py prepare --raw SkullBreak --out DIR`.

Settings: the workload's are declared once in PointCloudSettings (recipes/pointcloud/settings.py:
flags, `--config FILE.yaml` keys, the export's config, the resume check); `--dry-run
[--processes N]` prints a command's plan.

This file is the recipe: set-up, loss, training loop, evaluation (Chamfer distance against
baselines) and the single-device commands. What only it needs is in recipes/pointcloud/: the
layout's reader (data.py), pcdiff's PVCNN2 (model.py) on its point ops (ops.py), pcdiff
checkpoint conversion (convert.py), the noise schedule and samplers
(diffusion.py), the example skulls (example.py), `prepare` (prepare.py), the PNG view (viz.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import typer
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader

from accel_common import (
    ConfigError,
    DataError,
    Decay,
    SharedSettings,
    export_paths,
    format_metrics,
    inference_device,
    load_exported,
    model_option,
    new_file,
    read_recipe_export,
    require_new_file,
    require_start_export,
    run_recipe,
    train_command,
)
from accel_common.data import make_eval_loader, named_files, resolve_data
from recipes.pointcloud.backend import require_usable_kernels
from recipes.pointcloud.convert import ORIGINAL
from recipes.pointcloud.data import (
    SPACING_FILE,
    SkullBreak,
    load_points,
    normalisation,
    require_disjoint_splits,
)
from recipes.pointcloud.diffusion import Diffusion, checked_sample_steps, checked_sampler
from recipes.pointcloud.example import write_dataset
from recipes.pointcloud.model import PVCNN2, predict_noise
from recipes.pointcloud.prepare import prepare_skullbreak
from recipes.pointcloud.settings import PointCloudSettings, network
from recipes.pointcloud.viz import render_point_clouds

RECIPE = "pointcloud"
# `accel-recipes check pointcloud` and the tests that find every recipe run it so (see
# recipes/train_template.py): PVCNN2 at its narrowest, dropout off, 2 sampling steps; voxel
# grids of 16, 8 and 4: oneDNN's bfloat16 Conv3d backward (torch 2.11-2.14, CPU) returns NaN
# weight gradients in about 1 call of 8 on a 2^3 grid, which 0.125 (4, 2, 1) made
CHECK_ARGS = ["--num-points", "256", "--num-nn", "32", "--vox-res-mult", "0.5"]
CHECK_ARGS += ["--num-neighbors", "8", "--embed-dim", "16", "--dropout", "0", "--head-dropout", "0"]
CHECK_ARGS += ["--sampler", "ddim", "--sample-steps", "2", "--num-ens", "1", "--bs", "4"]
CHECK_ARGS += ["--no-compile"]  # the original's preset compiles (minutes on a CPU)
CHECK_DATA = {"train_skulls": 4, "test_skulls": 1, "points_per_skull": 600}
CHECK_COMMAND = ["evaluate", "--model", "{model}", "--data", "{data}", "--sample-steps", "2"]
# the kill-and-resume test: the EMA of the weights (the export) restored, and an evaluation (which
# samples implants from random points) before the kill
CHECK_RESUME = ["--ema-decay", "0.9", "--eval-every", "1"]


# --------------------------------------------------------------------------- training


def build_model(args: SharedSettings | None, settings: PointCloudSettings) -> PVCNN2:
    """The network these settings describe (for training, `--dry-run` and the export)."""
    return network(settings)


def skullbreak(root: Path, split: str, settings: PointCloudSettings, seed: int) -> SkullBreak:
    """One split of the SkullBreak layout, sampled at these settings' sizes."""
    return SkullBreak(
        root,
        split,
        settings.num_points,
        settings.num_nn,
        settings.timesteps,
        seed=seed,
        train=split == "train",
        augment=settings.augment,
    )


def csv_folder(data: Path, flag: str, split: str) -> Path:
    """The SkullBreak folder `data` names: itself, or the folder of its <split>.csv (the original
    passes its train.csv). Another CSV is refused: the split read is always <split>.csv beside it,
    so the file given would be silently replaced."""
    if data.suffix != ".csv":
        return data
    if data.name != f"{split}.csv":
        raise ConfigError(
            f"{flag} {data}: the recipe reads train.csv and test.csv in one SkullBreak folder; "
            f"give that folder, or name the file {split}.csv"
        )
    return data.parent


@train_command(
    PointCloudSettings,
    build_model=build_model,
    default_bs=8,
    lr=3e-3,  # the original's 2e-4 (at batch 8) learns too slowly for the CPU-sized example
    ref_bs=8,
    epochs=45,
    schedule=Decay.cosine,  # the original's is constant after warmup; cosine to 0 suits a short run
    warmup_steps=10,
    warmup_start=0.01,  # the original's --lr-warmup-start-factor 0.01: torch's LinearLR
    output_dir=Path("runs/pointcloud"),
    aliases={"data": ["--path"], "epochs": ["--niter"]},
    replaces=("eval_every",),  # its own: epochs, as the original's --vizIter (not steps)
)
def train(args: SharedSettings, settings: PointCloudSettings) -> dict[str, float]:
    """Train the conditional point-cloud diffusion model on SkullBreak-layout data."""
    if settings.init_from:  # before the data is read
        require_start_export(Path(settings.init_from), RECIPE, ORIGINAL)
    if args.data is not None:  # the original passes train.csv
        args.data = csv_folder(args.data, "--data/--path", "train")
    accelerator, plan = args.make_accelerator()
    require_usable_kernels(accelerator.device.type == "cuda")  # --cpu on a GPU machine
    data_dir = resolve_data(accelerator, RECIPE, args.data, write_dataset)
    require_disjoint_splits(data_dir)
    train_set = skullbreak(data_dir, "train", settings, seed=args.seed)
    test_set = skullbreak(data_dir, "test", settings, seed=args.seed + 1)
    pool = implant_pool(train_set)
    if test_set.unit != "mm":
        accelerator.print(
            f"note: {data_dir / SPACING_FILE} does not give every implant's voxel spacing, so "
            "distances are in the point files' units, not mm (prepare records it)"
        )

    model = build_model(args, settings)
    if settings.init_from:  # before the optimizer and the EMA (make_loop) see the weights
        recorded = initialise_from(model, Path(settings.init_from))
        accelerator.print(
            f"initialised from {settings.init_from}{unshaped_differences(recorded, settings)}"
        )
    optimizer = args.make_optimizer(
        torch.optim.Adam,
        model.parameters(),
        lr=args.lr,
        betas=(0.5, 0.999),
        weight_decay=args.weight_decay,
    )
    train_loader = args.make_train_loader(train_set, plan)
    test_loader = make_eval_loader(test_set, plan.per_device_batch_size, workers=args.workers)
    args.adapt_model(model)  # --sync-batchnorm, --compile: in place, before prepare
    model, optimizer, train_loader, test_loader = accelerator.prepare(
        model, optimizer, train_loader, test_loader
    )
    diffusion = Diffusion(settings.timesteps, accelerator.device)
    schedule = args.make_lr_schedule(accelerator, optimizer, plan, len(train_loader))
    data_files = named_files([*train_set.files, *test_set.files], data_dir)
    loop = args.make_loop(
        accelerator, plan, train_loader, schedule, model=model,  # model: what --ema-decay averages
        recipe=RECIPE, data_files=data_files, settings=settings,
    )  # fmt: skip

    def score() -> dict[str, float]:
        scored = accelerator.unwrap_model(model)
        steps, unit = settings.sample_steps, test_set.unit
        noise = loop.eval_generator()  # depends only on the step evaluated: resumes report alike
        return evaluate(
            accelerator, scored, test_loader, diffusion, steps, noise, pool, unit,
            sampler=settings.sampler, num_ens=settings.num_ens,
        )  # fmt: skip

    for epoch in loop.epochs():
        for batch in loop.batches():
            with accelerator.accumulate(model):
                noisy = diffusion.q_sample(batch["implant"], batch["t"], batch["noise"])
                eps = predict_noise(model, batch["skull"], noisy, batch["t"])
                loss = F.mse_loss(eps, batch["noise"])
                accelerator.backward(loss)
                loop.clip_gradients(model)
                optimizer.step()
                optimizer.zero_grad()
            loop.record(loss)
        if epoch % settings.eval_every == 0 or loop.done:
            with loop.ema.applied():  # --ema-decay: the EMA of the weights is scored (exported)
                loop.end_epoch(score())
    return loop.finish(model)


def initialise_from(model: PVCNN2, source: Path) -> dict[str, Any]:
    """`--init-from`: an export's weights, loaded strictly; returns its JSON. A pcdiff checkpoint
    or a missing path is one line naming the flag and what to do (not a safetensors parse
    error)."""
    require_start_export(source, RECIPE, ORIGINAL)
    return load_exported(source, model, device="cpu")


# settings that change what PVCNN2 computes but no tensor's shape: a strict load cannot see them
UNSHAPED = ("num_points", "vox_res_mult", "radius_mult", "num_neighbors")


def unshaped_differences(recorded: dict[str, Any], settings: PointCloudSettings) -> str:
    """A note naming the UNSHAPED settings this run changes from the export it starts from
    (empty if none): fine-tuning at other voxel grids or neighbourhoods is allowed, not silent."""
    config = recorded.get("config") or {}
    changed = [
        f"--{name.replace('_', '-')} {config[name]} (this run: {getattr(settings, name)})"
        for name in UNSHAPED
        if name in config and config[name] != getattr(settings, name)
    ]
    if not changed:
        return ""
    return (
        f"; note: it was trained with {', '.join(changed)}: these change no weight's shape, "
        "but what the network computes"
    )


# --------------------------------------------------------------------------- WORKLOAD: quality


def chamfer(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-sample Chamfer distance: mean nearest-neighbour distance a->b plus b->a."""
    d = torch.cdist(a, b)
    return d.min(dim=2).values.mean(dim=1) + d.min(dim=1).values.mean(dim=1)


@torch.no_grad()
def implant_pool(dataset: SkullBreak) -> torch.Tensor:
    """Every training implant's points, normalised: what a model that ignores the skull draws."""
    return torch.cat([dataset[i]["implant"] for i in range(len(dataset))])


def evaluate(
    accelerator: Accelerator,
    model: nn.Module,
    loader: DataLoader,
    diffusion: Diffusion,
    sample_steps: int,
    generator: torch.Generator,
    pool: torch.Tensor,
    unit: str,
    sampler: str = "ddim",
    num_ens: int = 1,
) -> dict[str, float]:
    """Chamfer distance of sampled implants to the true ones, against baselines, in `unit`.

    With `num_ens` > 1, each skull gets that many implants (the original's ensemble): each
    member's Chamfer is reported (`chamfer_ens<k>`) and `chamfer` is their mean. (The original
    combines the members by a majority vote of their voxelisations in its second-stage network,
    which this recipe does not build.)

    Distances are in mm when the data records its voxel spacing (`unit` "mm"), else in the
    point files' own units. The trivial baseline ignores the skull: points drawn from all
    training implants (`pool`). Two stronger ones know where the true implant is: its centroid,
    and uniform points in its bounding box.

    Every random draw comes from `generator` (in training `loop.eval_generator()`, seeded by the
    step evaluated), and the test points are the test set's epoch 0 at every evaluation: a
    prepared loader would otherwise advance the epoch once per pass, so an evaluation's points
    would depend on how many evaluations this process ran before it (a resumed run fewer).
    """
    model.eval()
    if hasattr(loader, "set_epoch"):
        loader.set_epoch(0)
    scores = []
    for batch in loader:
        skull, implant = batch["skull"], batch["implant"]
        members = [
            diffusion.sample(model, skull, implant.shape[1], sample_steps, generator, sampler)
            for _ in range(num_ens)
        ]
        to_unit = batch["scale"][:, None, None] * batch["mm_per_unit"][:, None, :]
        true = implant * to_unit
        member_scores = torch.stack([chamfer(m * to_unit, true) for m in members], 1)
        low, high = true.min(dim=1, keepdim=True).values, true.max(dim=1, keepdim=True).values
        box = low + (high - low) * torch.rand(true.shape, generator=generator).to(low.device)
        centroid = true.mean(dim=1, keepdim=True).expand_as(true)
        drawn = torch.randint(len(pool), true.shape[:2], generator=generator)
        skull_agnostic = pool[drawn].to(true.device) * to_unit
        baselines = (skull_agnostic, centroid, box)
        per_sample = torch.stack(
            [member_scores.mean(dim=1), *(chamfer(b, true) for b in baselines)], 1
        )
        if num_ens > 1:
            per_sample = torch.cat([per_sample, member_scores], 1)
        scores.append(accelerator.gather_for_metrics(per_sample))
    model.train()
    scores = torch.cat(scores)
    names = ["chamfer", "baseline_skull_agnostic", "oracle_centroid", "oracle_bbox"]
    names += [f"chamfer_ens{k}" for k in range(num_ens)] if num_ens > 1 else []
    mean = scores.mean(dim=0).tolist()
    metrics = {f"{name}_{unit}": value for name, value in zip(names, mean, strict=True)}
    return metrics | {"n": len(scores)}


# --------------------------------------------------------------------------- single-device use


def load_model(model_dir: Path, device: torch.device) -> tuple[PVCNN2, PointCloudSettings]:
    """An exported model on `device`, and the settings it was trained with."""
    settings = PointCloudSettings.from_config(read_recipe_export(model_dir, RECIPE))
    try:  # a model.json edited by hand would fail deep inside the network
        settings.validate()
    except ConfigError as err:
        raise ConfigError(f"{export_paths(model_dir)[1]}: {err}") from None
    model = network(settings)
    load_exported(model_dir, model, device="cpu")
    return model.to(device).eval(), settings


ModelOption = model_option(RECIPE)


def evaluate_export(
    model_dir: Path = ModelOption,
    data: Path = typer.Option(
        Path("data/example/pointcloud"), "--data", help="SkullBreak-layout folder."
    ),
    split: str = typer.Option("test", help="Which split to score: <data>/<split>.csv."),
    sample_steps: int = typer.Option(None, min=1, help="DDIM steps (default: as in training)."),
    sampler: str = typer.Option(None, help="ddpm or ddim (default: as in training)."),
    num_ens: int = typer.Option(None, min=1, help="Implants per skull (default: as in training)."),
    seed: int = typer.Option(0, help="Seed of the sampling noise."),
) -> None:
    """Sample implants for a split with an exported model on one device; print Chamfer distances."""
    require_usable_kernels(torch.cuda.is_available())  # before the export is read
    data = csv_folder(data, "--data", split)
    accelerator = Accelerator(cpu=not torch.accelerator.is_available())
    model, settings = load_model(model_dir, accelerator.device)
    dataset = skullbreak(data, split, settings, seed=seed)
    pool = implant_pool(skullbreak(data, "train", settings, seed=seed))
    loader = accelerator.prepare(make_eval_loader(dataset, 8))
    diffusion = Diffusion(settings.timesteps, accelerator.device)
    sampler = checked_sampler(sampler or settings.sampler)
    steps = checked_sample_steps(
        sample_steps or settings.sample_steps, sampler, settings.timesteps, sample_steps is not None
    )
    metrics = evaluate(
        accelerator, model, loader, diffusion, steps, torch.Generator().manual_seed(seed), pool,
        dataset.unit, sampler=sampler, num_ens=num_ens or settings.num_ens,
    )  # fmt: skip
    print(format_metrics(metrics))


def skull_condition(
    points: np.ndarray, num_skull_points: int, generator: torch.Generator
) -> tuple[torch.Tensor, np.ndarray, float]:
    """The network's condition for one defective skull, as the original's test-time loader makes
    it (skullbreak_data.py with eval=True): `num_skull_points` points drawn with replacement,
    normalised by the bounding box of the drawn points. Returns (points (1, S, 3), centre,
    scale): an implant generated in that frame maps back by x * scale + centre."""
    chosen = torch.randint(len(points), (num_skull_points,), generator=generator).numpy()
    drawn = points[chosen]
    center, scale = normalisation(drawn)
    return torch.from_numpy((drawn - center) / scale).float()[None], center, scale


def complete(
    model_dir: Path = ModelOption,
    skull: Path = typer.Option(..., help="Defective skull .npy (M x 3 points)."),
    out: Path = typer.Option(..., help="Where to write the generated implant .npy."),
    png: Path = typer.Option(None, help="Also write a picture of skull + implant."),
    sampler: str = typer.Option(None, help="ddpm (all T steps) or ddim (default: the export's)."),
    sample_steps: int = typer.Option(None, min=1, help="DDIM steps (default: the export's)."),
    seed: int = typer.Option(0, help="Seed of the sampling noise."),
) -> None:
    """Generate the implant for one defective skull with an exported model, on one device."""
    require_usable_kernels(inference_device().type == "cuda")  # before the export is read
    if out.suffix != ".npy":  # np.save would write OUT.npy, past the check that OUT is new
        raise DataError(f"--out {out}: give a file name ending in .npy")
    if png is not None and png.resolve() == out.resolve():
        raise DataError(f"--png: give another file than --out {out} (the picture would replace it)")
    for path, flag in ((out, "--out"), (png, "--png")):  # before sampling, not after it
        if path is not None:
            require_new_file(path, flag)
    device = inference_device()
    model, settings = load_model(model_dir, device)
    sampler = checked_sampler(sampler or settings.sampler)
    steps = checked_sample_steps(
        sample_steps or settings.sample_steps, sampler, settings.timesteps, sample_steps is not None
    )
    points = load_points(skull)
    if np.ptp(points, axis=0).max() == 0:  # normalising by its extent would divide by zero
        raise DataError(f"--skull {skull}: its points all coincide; give a skull's surface points")
    generator = torch.Generator().manual_seed(seed)
    num_skull_points = settings.num_points - settings.num_nn
    condition, center, scale = skull_condition(points, num_skull_points, generator)
    diffusion = Diffusion(settings.timesteps, device)
    generated = diffusion.sample(
        model, condition.to(device), settings.num_nn, steps, generator, sampler
    )
    implant = generated[0].cpu().numpy() * scale + center
    with new_file(out) as partial:
        np.save(partial, implant.astype(np.float32))
    print(f"wrote {out}: {len(implant)} implant points")
    if png is not None:
        with new_file(png, "--png") as partial:
            render_point_clouds(partial, [(points, (170, 170, 170)), (implant, (220, 60, 40))])
        print(f"wrote {png}")


def prepare(
    raw: Path = typer.Option(
        ..., help="SkullBreak folder of .nrrd volumes: complete_skull/, defective_skull/, implant/."
    ),
    out: Path = typer.Option(
        None, help="Where to write the point clouds, same layout (default: beside the volumes)."
    ),
    points: int = typer.Option(400_000, min=1, help="Surface points per volume (original's)."),
    workers: int = typer.Option(1, min=1, help="Volumes prepared in parallel (processes)."),
    overwrite: bool = typer.Option(False, help="Redo point clouds that already exist."),
) -> None:
    """Make the training layout from downloaded SkullBreak volumes, as the original's preprocessing.

    Marching cubes on each volume, then surface points, written as <stem>_surf.npy in voxel
    units, with each file's voxel spacing in voxel_spacing.json (so distances can be reported in
    mm) and train.csv / test.csv (kept from --raw if it has them; if it has one, the other lists
    the remaining cases; else the original's split).
    Resumable: finished files are checked and skipped. Run it on a folder the original already
    preprocessed to add the spacing alone.
    """
    out = out or raw
    counts = prepare_skullbreak(raw, out, points=points, workers=workers, overwrite=overwrite)
    print(f"{out}: {counts['written']} point clouds written, {counts['skipped']} already there")


if __name__ == "__main__":
    run_recipe(train, evaluate=evaluate_export, complete=complete, prepare=prepare)
