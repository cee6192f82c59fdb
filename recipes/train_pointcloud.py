"""Point-cloud completion by diffusion (pcdiff on SkullBreak): generate a skull defect's implant.

A conditional DDPM over point clouds. Each sample is a defective skull (conditioning, kept clean)
and the points of its implant (noised); a point-voxel network predicts the noise on the implant
points only. Sampling (DDPM or DDIM) turns random points into an implant that fills the defect.

    python recipes/train_pointcloud.py                                 # built-in example skulls
    accelerate launch --config_file accelerate_configs/8gpu.yaml recipes/train_pointcloud.py \\
        --path datasets/SkullBreak/train.csv --bs 64 --lr 2e-4 --num-points 30720 \\
        --num-nn 3072 --width 256 --resolution 32 --timesteps 1000     # the original's size
    python recipes/train_pointcloud.py evaluate --model runs/pointcloud/model --data DIR
    python recipes/train_pointcloud.py complete --model runs/pointcloud/model \\
        --skull defective_skull/bilateral/070_surf.npy --out implant.npy --png view.png

Data: the SkullBreak layout as the original's preprocessing leaves it (train.csv / test.csv
listing complete_skull/070_surf.npy; each row expands to the five defect types,
defective_skull/<defect>/070_surf.npy and implant/<defect>/070_surf.npy, in the folder before the
row's complete_skull/: the CSV's own, or another tree's). From the downloaded .nrrd volumes:
`python recipes/train_pointcloud.py prepare --raw SkullBreak --out DIR`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import typer
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, Dataset

from accel_common.checkpoint import inference_device, load_exported, read_recipe_export
from accel_common.console import format_metrics
from accel_common.data import pointcloud as skull_data
from accel_common.data.files import read_path_list, require_finite
from accel_common.data.volumes import SPACING_FILE, case_stem, prepare_skullbreak
from accel_common.errors import ConfigError, DataError
from accel_common.lr import Decay
from accel_common.options import TrainArgs, model_option, train_options
from accel_common.runtime import require_new_file, resolve_data, run_recipe
from accel_common.viz import render_point_clouds

RECIPE = "pointcloud"
DEFECTS = skull_data.DEFECTS


# --------------------------------------------------------------------------- WORKLOAD: data


def load_points(path: Path, header_only: bool = False) -> np.ndarray:
    """An M x 3 float point cloud from a .npy file (never unpickled).

    `header_only` maps the file instead of reading it: a cheap check of every file up front, so
    bad data fails before training starts, with the file's name, not inside a loader worker.
    """
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    with path.open("rb") as handle:
        if handle.read(6) != b"\x93NUMPY":  # else np.load calls any other file "pickled data"
            raise DataError(f"{path}: not a .npy file (it lacks NumPy's header)")
    try:
        points = np.load(path, allow_pickle=False, mmap_mode="r" if header_only else None)
    except (ValueError, OSError) as err:
        raise DataError(f"{path}: not a readable .npy array ({err})") from None
    if points.ndim != 2 or points.shape[1] != 3 or len(points) == 0:
        raise DataError(f"{path}: expected an M x 3 point cloud, got shape {points.shape}")
    if header_only:
        return points
    require_finite(points, str(path))  # index [point, coordinate]
    return points.astype(np.float32)


def normalisation(defective: np.ndarray) -> tuple[np.ndarray, float]:
    """The original's normalisation: centre of the bounding box, scale (max extent / 2) / 3."""
    low, high = defective.min(axis=0), defective.max(axis=0)
    return (low + high) / 2, float((high - low).max() / 2 / 3)


SKULL_AND_IMPLANT = ("defective_skull", "implant")


def point_file(root: Path, kind: str, defect: str, stem: str) -> Path:
    """The original's `<kind>/<defect>/070_surf.npy`, or `070.npy` as this project once wrote."""
    original = root / kind / defect / f"{stem}_surf.npy"
    plain = original.with_name(f"{stem}.npy")
    return plain if plain.is_file() and not original.is_file() else original


def case_folder(root: Path, listed: str, stem: str) -> Path:
    """The folder a CSV row's case lives in, as the original resolves it: the row's path up to
    complete_skull/, relative to the CSV's folder `root` unless absolute (a row without that
    folder: `root`). If that folder lacks the case and `root` has it, `root`: a data set moved
    after the original's split script wrote absolute paths still loads."""
    parts = Path(listed).parts
    if "complete_skull" not in parts[:-1]:
        return root
    folder = root.joinpath(*parts[: parts.index("complete_skull")])
    probe = SKULL_AND_IMPLANT[0], DEFECTS[0], stem
    if not point_file(folder, *probe).is_file() and point_file(root, *probe).is_file():
        return root
    return folder


def read_spacing(root: Path) -> dict[str, list[float]]:
    """mm per coordinate unit per axis for each point file, as `prepare` records it."""
    path = root / SPACING_FILE
    if not path.is_file():
        return {}
    try:
        return dict(json.loads(path.read_text())["spacing"])
    except (ValueError, KeyError, TypeError) as err:
        raise DataError(f"{path}: not a voxel-spacing file written by prepare ({err})") from None


class SkullBreak(Dataset):
    """Defective skull + implant pairs of one split, five defect types per listed skull.

    Point subsampling, the diffusion timestep and the noise of sample i in epoch e come from a
    generator seeded by (seed, e, i), so they are the same whichever process loads the sample:
    1 and N processes train on identical inputs, and a resumed run on the same ones.
    """

    def __init__(
        self, root: Path, split: str, num_points: int, num_nn: int, timesteps: int, seed: int
    ):
        csv = root / f"{split}.csv"
        recorded: dict[Path, dict[str, list[float]]] = {}  # per case folder: its spacing file
        self.entries, spacings = [], []
        for line, listed in read_path_list(csv, suffixes=(".npy", ".nrrd")):
            stem = case_stem(listed)
            folder = case_folder(root, listed, stem)
            if folder not in recorded:
                recorded[folder] = read_spacing(folder)
            for defect in DEFECTS:
                pair = tuple(point_file(folder, kind, defect, stem) for kind in SKULL_AND_IMPLANT)
                for path in pair:
                    if not path.is_file():
                        raise DataError(
                            f"{path}: file not found (listed by {csv}, line {line}; "
                            f"{stem}.npy is read too). From .nrrd volumes, make the point clouds "
                            "with: python recipes/train_pointcloud.py prepare --raw DIR --out DIR"
                        )
                    load_points(path, header_only=True)
                self.entries.append(pair)
                spacings.append(recorded[folder].get(pair[1].relative_to(folder).as_posix()))
        # distances in mm need every implant's voxel spacing; else they stay in the files' units
        self.unit = "mm" if all(spacings) else "units"
        self.mm_per_unit = [np.asarray(s or (1.0, 1.0, 1.0), dtype=np.float32) for s in spacings]
        self.num_skull_points, self.num_nn = num_points - num_nn, num_nn
        self.timesteps, self.seed, self.epoch = timesteps, seed, 0

    def set_epoch(self, epoch: int) -> None:  # called by the prepared DataLoader's set_epoch
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        defective_path, implant_path = self.entries[index]
        defective, implant = load_points(defective_path), load_points(implant_path)
        center, scale = normalisation(defective)
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + self.epoch) * 1_000_003 + index)
        skull_idx = torch.randint(len(defective), (self.num_skull_points,), generator=g)
        implant_idx = torch.randint(len(implant), (self.num_nn,), generator=g)
        return {
            "skull": torch.from_numpy((defective - center) / scale)[skull_idx],
            "implant": torch.from_numpy((implant - center) / scale)[implant_idx],
            "t": torch.randint(self.timesteps, (), generator=g),
            "noise": torch.randn(self.num_nn, 3, generator=g),
            "center": torch.from_numpy(center),
            "scale": torch.tensor(scale),
            "mm_per_unit": torch.from_numpy(self.mm_per_unit[index]),
        }


# --------------------------------------------------------------------------- WORKLOAD: model


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal embedding of diffusion timesteps, as in DDPM."""
    half = dim // 2
    freqs = torch.exp(-math.log(10_000) * torch.arange(half, device=t.device) / (half - 1))
    angles = t.float()[:, None] * freqs[None]
    return torch.cat([angles.sin(), angles.cos()], dim=1)


def voxelize(features: torch.Tensor, coords: torch.Tensor, resolution: int) -> torch.Tensor:
    """Average point features into a resolution^3 grid (scatter-mean). coords in [-1, 1]."""
    batch, channels, _ = features.shape
    cells = ((coords + 1) / 2 * (resolution - 1)).round().long().clamp(0, resolution - 1)
    flat = (cells[..., 2] * resolution + cells[..., 1]) * resolution + cells[..., 0]  # z, y, x
    grid = features.new_zeros(batch, channels, resolution**3)
    grid.scatter_add_(2, flat[:, None].expand(-1, channels, -1), features)
    count = features.new_zeros(batch, 1, resolution**3)
    count.scatter_add_(2, flat[:, None], torch.ones_like(features[:, :1]))
    grid = grid / count.clamp(min=1)
    return grid.view(batch, channels, resolution, resolution, resolution)


def devoxelize(grid: torch.Tensor, coords: torch.Tensor) -> torch.Tensor:
    """Trilinear interpolation of grid features back at the points: (B, C, N)."""
    sampled = F.grid_sample(grid, coords[:, None, None], mode="bilinear", align_corners=True)
    return sampled[:, :, 0, 0]


class PointVoxelBlock(nn.Module):
    """Voxel branch (Conv3d, GroupNorm(8), Swish) + point MLP branch, with the timestep added."""

    def __init__(self, channels: int, resolution: int, temb_dim: int) -> None:
        super().__init__()
        self.resolution = resolution
        self.temb = nn.Linear(temb_dim, channels)
        self.voxel = nn.Sequential(
            nn.Conv3d(channels, channels, 3, padding=1),
            nn.GroupNorm(8, channels),
            nn.SiLU(),
            nn.Conv3d(channels, channels, 3, padding=1),
            nn.GroupNorm(8, channels),
            nn.SiLU(),
        )
        self.point = nn.Sequential(
            nn.Conv1d(channels, channels, 1), nn.GroupNorm(8, channels), nn.SiLU()
        )
        self.context = nn.Conv1d(2 * channels, channels, 1)  # global (max-pooled) context

    def forward(
        self, x: torch.Tensor, coords: torch.Tensor, temb: torch.Tensor, num_skull: int
    ) -> torch.Tensor:
        x = x + self.temb(temb)[:, :, None]
        # the grid holds the skull only: noised implant points scattered everywhere would fill
        # the very hole the implant points need to find; every point reads the grid back
        grid = voxelize(x[:, :, :num_skull], coords[:, :num_skull], self.resolution)
        voxel = devoxelize(self.voxel(grid), coords)
        fused = voxel + self.point(x)
        pooled = fused.max(dim=2, keepdim=True).values.expand_as(fused)
        return x + self.context(torch.cat([fused, pooled], dim=1))


class PointVoxelDenoiser(nn.Module):
    """Predicts the noise on the implant points, given them noised and the clean skull."""

    def __init__(self, width: int, depth: int, resolution: int, temb_dim: int = 64) -> None:
        super().__init__()
        self.temb_dim = temb_dim
        self.temb_mlp = nn.Sequential(
            nn.Linear(temb_dim, width), nn.SiLU(), nn.Linear(width, temb_dim)
        )
        self.stem = nn.Conv1d(4, width, 1)  # xyz + "is implant point" flag
        self.blocks = nn.ModuleList(
            PointVoxelBlock(width, resolution, temb_dim) for _ in range(depth)
        )
        self.head = nn.Sequential(nn.Conv1d(width, width, 1), nn.SiLU(), nn.Conv1d(width, 3, 1))

    def forward(self, skull: torch.Tensor, noisy: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        points = torch.cat([skull, noisy], dim=1)  # (B, N, 3)
        flag = torch.cat([torch.zeros_like(skull[..., :1]), torch.ones_like(noisy[..., :1])], 1)
        x = self.stem(torch.cat([points, flag], dim=2).transpose(1, 2))
        coords = (points / 4.0).clamp(-1, 1)  # normalised skulls span about [-3, 3]
        temb = self.temb_mlp(timestep_embedding(t, self.temb_dim))
        for block in self.blocks:
            x = block(x, coords, temb, skull.shape[1])
        return self.head(x)[:, :, skull.shape[1] :].transpose(1, 2)


# --------------------------------------------------------------------------- WORKLOAD: diffusion


class Diffusion:
    """Linear beta schedule 1e-4 -> 0.02 over T = 1000 steps (scaled by 1000/T for fewer steps,
    so the last step is as noisy as the original's); epsilon prediction; DDPM and DDIM samplers."""

    def __init__(self, timesteps: int, device: torch.device | str = "cpu") -> None:
        scale = 1000 / timesteps
        betas = torch.linspace(1e-4 * scale, 0.02 * scale, timesteps, dtype=torch.float64)
        self.timesteps = timesteps
        self.betas = betas.clamp(max=0.999).float().to(device)
        self.alphas_cumprod = torch.cumprod(1 - betas.clamp(max=0.999), 0).float().to(device)

    def q_sample(self, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        a = self.alphas_cumprod[t][:, None, None]
        return a.sqrt() * x0 + (1 - a).sqrt() * noise

    @torch.no_grad()
    def sample(
        self,
        model: nn.Module,
        skull: torch.Tensor,
        num_nn: int,
        steps: int,
        generator: torch.Generator,
        sampler: str = "ddim",
    ) -> torch.Tensor:
        """Implant points for each skull: DDIM (eta 0) over `steps` steps, or full DDPM."""
        shape = (skull.shape[0], num_nn, 3)
        x = torch.randn(shape, generator=generator).to(skull.device)
        if sampler == "ddpm":
            for t in reversed(range(self.timesteps)):
                tt = torch.full((shape[0],), t, device=skull.device, dtype=torch.long)
                eps = model(skull, x, tt)
                a_bar, beta = self.alphas_cumprod[t], self.betas[t]
                mean = (x - beta / (1 - a_bar).sqrt() * eps) / (1 - beta).sqrt()
                noise = torch.randn(shape, generator=generator).to(skull.device) if t else 0
                x = mean + beta.sqrt() * noise
            return x
        ts = torch.linspace(self.timesteps - 1, 0, steps).round().long().tolist()
        for t, t_next in zip(ts, [*ts[1:], -1], strict=True):
            tt = torch.full((shape[0],), t, device=skull.device, dtype=torch.long)
            eps = model(skull, x, tt)
            a_bar = self.alphas_cumprod[t]
            x0 = ((x - (1 - a_bar).sqrt() * eps) / a_bar.sqrt()).clamp(-4, 4)
            a_next = self.alphas_cumprod[t_next] if t_next >= 0 else torch.ones_like(a_bar)
            x = a_next.sqrt() * x0 + (1 - a_next).sqrt() * eps
        return x


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
    seed: int,
    pool: torch.Tensor,
    unit: str,
) -> dict[str, float]:
    """Chamfer distance of sampled implants to the true ones, against baselines, in `unit`.

    Distances are in mm when the data records its voxel spacing (`unit` "mm"), else in the
    point files' own units. The trivial baseline ignores the skull: points drawn from all
    training implants (`pool`). Two stronger ones know where the true implant is: its centroid,
    and uniform points in its bounding box.
    """
    model.eval()
    generator = torch.Generator().manual_seed(seed + accelerator.process_index)
    scores = []
    for batch in loader:
        skull, implant = batch["skull"], batch["implant"]
        generated = diffusion.sample(model, skull, implant.shape[1], sample_steps, generator)
        to_unit = batch["scale"][:, None, None] * batch["mm_per_unit"][:, None, :]
        true, generated = implant * to_unit, generated * to_unit
        low, high = true.min(dim=1, keepdim=True).values, true.max(dim=1, keepdim=True).values
        box = low + (high - low) * torch.rand(true.shape, generator=generator).to(low.device)
        centroid = true.mean(dim=1, keepdim=True).expand_as(true)
        drawn = torch.randint(len(pool), true.shape[:2], generator=generator)
        skull_agnostic = pool[drawn].to(true.device) * to_unit
        baselines = (skull_agnostic, centroid, box)
        per_sample = torch.stack(
            [chamfer(generated, true), *(chamfer(b, true) for b in baselines)], 1
        )
        scores.append(accelerator.gather_for_metrics(per_sample))
    model.train()
    scores = torch.cat(scores)
    names = ("chamfer", "baseline_skull_agnostic", "oracle_centroid", "oracle_bbox")
    mean = scores.mean(dim=0).tolist()
    metrics = {f"{name}_{unit}": value for name, value in zip(names, mean, strict=True)}
    return metrics | {"n": len(scores)}


# --------------------------------------------------------------------------- training


@train_options(
    default_bs=8,
    lr=3e-3,  # the original's 2e-4 (at batch 8) learns too slowly for the CPU-sized example
    ref_bs=8,
    epochs=45,
    schedule=Decay.cosine,  # the original decays exponentially; cosine to 0 suits a short run
    warmup_steps=10,
    output_dir=Path("runs/pointcloud"),
    aliases={"data": ["--path"], "epochs": ["--niter"]},
)
def train(
    args: TrainArgs,
    dataset: str = typer.Option("SkullBreak", help="Data set layout; SkullBreak is supported."),
    num_points: int = typer.Option(
        512, min=2, help="Points per sample, skull + implant (original: 30720)."
    ),
    num_nn: int = typer.Option(64, min=1, help="Implant points among them (original: 3072)."),
    width: int = typer.Option(
        16, min=8, help="Channels of the point-voxel blocks, a multiple of 8 (original: 256)."
    ),
    depth: int = typer.Option(2, min=1, help="Point-voxel blocks."),
    resolution: int = typer.Option(16, min=2, help="Voxel grid resolution (original: 32)."),
    timesteps: int = typer.Option(100, min=2, help="Diffusion steps T (original: 1000)."),
    sample_steps: int = typer.Option(20, min=1, help="DDIM steps when sampling for evaluation."),
    eval_every: int = typer.Option(15, min=1, help="Evaluate (sample and score) every N epochs."),
    ema_decay: float = typer.Option(
        0.0, min=0.0, max=0.9999, help="EMA of the weights (e.g. 0.999; 0 = off)."
    ),
) -> dict[str, float]:
    """Train the conditional point-cloud diffusion model on SkullBreak-layout data."""
    if dataset != "SkullBreak":
        raise ConfigError(f"--dataset {dataset}: only the SkullBreak layout is supported")
    if width % 8:
        raise ConfigError(f"--width must be a multiple of 8 (GroupNorm in 8 groups), got {width}")
    if not 0 < num_nn < num_points:
        raise ConfigError(f"--num-nn must be between 1 and --num-points - 1, got {num_nn}")
    if args.data is not None and args.data.suffix == ".csv":  # the original passes train.csv
        args.data = args.data.parent
    accelerator, plan = args.make_accelerator()
    data_dir = resolve_data(accelerator, RECIPE, args.data, skull_data.write_dataset)
    sizes = {"num_points": num_points, "num_nn": num_nn, "timesteps": timesteps}
    train_set = SkullBreak(data_dir, "train", **sizes, seed=args.seed)
    test_set = SkullBreak(data_dir, "test", **sizes, seed=args.seed + 1)
    pool = implant_pool(train_set)
    if test_set.unit != "mm":
        accelerator.print(
            f"note: {data_dir / SPACING_FILE} does not give every implant's voxel spacing, so "
            "distances are in the point files' units, not mm (prepare records it)"
        )

    model = PointVoxelDenoiser(width, depth, resolution)
    ema = (
        torch.optim.swa_utils.AveragedModel(
            model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(ema_decay)
        )
        if ema_decay
        else None
    )
    optimizer = torch.optim.Adam(
        model.parameters(), lr=args.lr, betas=(0.5, 0.999), weight_decay=args.weight_decay
    )
    train_loader = args.make_train_loader(train_set, plan)
    test_loader = DataLoader(
        test_set, batch_size=plan.per_device_batch_size, num_workers=args.workers
    )
    model, optimizer, train_loader, test_loader = accelerator.prepare(
        model, optimizer, train_loader, test_loader
    )
    diffusion = Diffusion(timesteps, accelerator.device)
    schedule = args.make_lr_schedule(accelerator, optimizer, plan, len(train_loader))
    if ema is not None:
        ema.to(accelerator.device)
        accelerator.register_for_checkpointing(ema)
    config = {"width": width, "depth": depth, "resolution": resolution, **sizes}
    config |= {"sample_steps": sample_steps, "ema_decay": ema_decay}
    loop = args.make_loop(accelerator, plan, train_loader, schedule, recipe=RECIPE, config=config)

    def score() -> dict[str, float]:
        scored = accelerator.unwrap_model(model) if ema is None else ema.module
        steps, unit = sample_steps, test_set.unit
        return evaluate(accelerator, scored, test_loader, diffusion, steps, args.seed, pool, unit)

    for epoch in loop.epochs():
        for batch in loop.batches():
            with accelerator.accumulate(model):
                noisy = diffusion.q_sample(batch["implant"], batch["t"], batch["noise"])
                loss = F.mse_loss(model(batch["skull"], noisy, batch["t"]), batch["noise"])
                accelerator.backward(loss)
                loop.clip_gradients(model)
                optimizer.step()
                optimizer.zero_grad()
                if ema is not None and accelerator.sync_gradients:
                    ema.update_parameters(accelerator.unwrap_model(model))
            loop.record(loss)
        if epoch % eval_every == 0 or loop.done:
            loop.end_epoch(score())
    return loop.finish(model if ema is None else ema.module)


# --------------------------------------------------------------------------- single-device use


def load_model(model_dir: Path, device: torch.device) -> tuple[PointVoxelDenoiser, dict]:
    config = read_recipe_export(model_dir, RECIPE)
    model = PointVoxelDenoiser(config["width"], config["depth"], config["resolution"])
    load_exported(model_dir, model, device="cpu")
    return model.to(device).eval(), config


ModelOption = model_option(RECIPE)


def evaluate_export(
    model_dir: Path = ModelOption,
    data: Path = typer.Option(
        Path("data/example/pointcloud"), "--data", help="SkullBreak-layout folder."
    ),
    split: str = typer.Option("test", help="Which split to score: <data>/<split>.csv."),
    sample_steps: int = typer.Option(None, help="DDIM steps (default: as in training)."),
    seed: int = typer.Option(0, help="Seed of the sampling noise."),
) -> None:
    """Sample implants for a split with an exported model on one device; print Chamfer distances."""
    accelerator = Accelerator(cpu=not torch.accelerator.is_available())
    model, config = load_model(model_dir, accelerator.device)
    sizes = {k: config[k] for k in ("num_points", "num_nn", "timesteps")}
    dataset = SkullBreak(data, split, **sizes, seed=seed)
    pool = implant_pool(SkullBreak(data, "train", **sizes, seed=seed))
    loader = accelerator.prepare(DataLoader(dataset, batch_size=8))
    diffusion = Diffusion(config["timesteps"], accelerator.device)
    steps = sample_steps or config["sample_steps"]
    metrics = evaluate(accelerator, model, loader, diffusion, steps, seed, pool, dataset.unit)
    print(format_metrics(metrics))


def complete(
    model_dir: Path = ModelOption,
    skull: Path = typer.Option(..., help="Defective skull .npy (M x 3 points)."),
    out: Path = typer.Option(..., help="Where to write the generated implant .npy."),
    png: Path = typer.Option(None, help="Also write a picture of skull + implant."),
    sample_steps: int = typer.Option(50, help="DDIM steps (more: finer; 0 = full DDPM)."),
    seed: int = typer.Option(0, help="Seed of the sampling noise."),
) -> None:
    """Generate the implant for one defective skull with an exported model, on one device."""
    require_new_file(out)
    device = inference_device()
    model, config = load_model(model_dir, device)
    points = load_points(skull)
    center, scale = normalisation(points)
    generator = torch.Generator().manual_seed(seed)
    chosen = torch.randint(
        len(points), (config["num_points"] - config["num_nn"],), generator=generator
    )
    condition = torch.from_numpy((points - center) / scale)[chosen][None].to(device)
    diffusion = Diffusion(config["timesteps"], device)
    sampler = "ddpm" if sample_steps == 0 else "ddim"
    generated = diffusion.sample(
        model, condition, config["num_nn"], sample_steps, generator, sampler
    )
    implant = generated[0].cpu().numpy() * scale + center
    out.parent.mkdir(parents=True, exist_ok=True)
    np.save(out, implant.astype(np.float32))
    print(f"wrote {out}: {len(implant)} implant points")
    if png is not None:
        render_point_clouds(png, [(points, (170, 170, 170)), (implant, (220, 60, 40))])
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
