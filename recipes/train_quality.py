"""Crowd-BT image-quality scorer: learn a quality score per image from noisy pairwise votes.

A Siamese scorer (timm backbone -> MLP head -> one score s) is trained on comparisons "which of
two images looks better" from annotators of unequal reliability. Crowd-BT (Chen et al. 2013)
learns a reliability eta_k per annotator jointly with the scores:

    P(i beats j | annotator k) = eta_k * sigmoid(s_i - s_j) + (1 - eta_k) * sigmoid(s_j - s_i)

eta_k near 1 is a careful annotator, 0.5 a coin-flipper, below 0.5 one who answers in reverse.

    python recipes/train_quality.py                                    # built-in example
    accelerate launch --config_file accelerate_configs/4gpu.yaml recipes/train_quality.py \\
        --data DIR --backbone efficientnet_b3 --image-size 300 --batch-size 32
    python recipes/train_quality.py score --model runs/quality/model --images DIR --out scores.csv
    python recipes/train_quality.py --config recipes/quality/configs/original.yaml --dry-run \\
        --processes 8                           # the original's preset: its plan, nothing run

Data: the original project's folder as it is, one folder per annotator (its S3 prefix
quack_v2_data_user_logs/ synced to disk), images under --image-dir (default DIR/images):

    DIR/<annotator>/comparison_data.json    {"comparisons": [{"img1", "img2", "choice", ...}]}
    python recipes/train_quality.py --data quack_v2_data_user_logs --image-dir data/iter_0

choice: left | right | draw | tie | equal, any case; img1/img2: paths relative to --image-dir
(iter_0/x.png works). A record without them stops the run (--skip-invalid-records drops it, as
the original does). DIR/annotations/<annotator>.json holding a bare list of records is read too.
Optional DIR/truth.json (synthetic data): true quality and reliabilities, for extra metrics.

This file is the training recipe: the settings (QualitySettings: every workload flag, `--config` key
and what --resume checks), set-up, the Crowd-BT loss, loop, evaluation and the `score` command;
recipes/quality/configs/original.yaml is the original's preset. What only it needs lives in
recipes/quality/: the reader of the annotation files, the split and the dataset of pairs (data.py),
the scorer network (model.py), the example set (example.py).
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
import typer
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader

from accel_common.command import model_option, train_command
from accel_common.console import print_names, say
from accel_common.data.fingerprint import named_files
from accel_common.data.images import list_images
from accel_common.data.loaders import existing_data, resolve_data
from accel_common.entry import run_recipe
from accel_common.errors import ConfigError, DataError
from accel_common.export import load_for_inference, read_recipe_export, require_start_export
from accel_common.launch_guard import require_new_file
from accel_common.lr import Decay
from accel_common.options import SharedSettings
from accel_common.outputs import new_file
from accel_common.settings import Settings, setting
from recipes.quality.convert import ORIGINAL
from recipes.quality.data import (
    GOLD_PAIR,
    TRUTH_FILE,
    Comparisons,
    ImageReader,
    Images,
    Pairs,
    gold_reliabilities,
    normalisation,
    quality_rank,
    read_comparisons,
    read_truth,
    split_comparisons,
)
from recipes.quality.example import ANNOTATORS, write_dataset
from recipes.quality.model import (
    RELIABILITY_KEY,
    QualityScorer,
    build_scorer,
    require_known_backbone,
    start_from,
)
from recipes.quality.onnx_export import ONNX_OPSETS, require_onnx, write_onnx

RECIPE = "quality"
# how `accel-recipes check` and the tests run it (recipes/train_template.py): 16 px, no dropout
CHECK_ARGS = ["--bs", "8", "--dropout", "0", "--image-size", "16"]
CHECK_DATA = {"images": 12, "comparisons_per_annotator": 16, "size": 16}
CHECK_COMMAND = ["score", "--model", "{model}", "--images", "{data}/images", "--out", "{out}.csv"]
CHECK_RESUME = ["--dropout", "0.2"]  # the kill-and-resume test: dropout on, as augmentation is
RELIABILITY = ("full", "global", "fixed", "gold")
DRAW_MARGIN = 0.1  # the original's draw margin in its accuracy (loss.py 48, infer.py 115)
CHOICES = {"reliability": RELIABILITY, "head_init": ("kaiming", "torch")}
CHOICES["pair_forward"] = ("joint", "separate")


@dataclass
class QualitySettings(Settings):
    """The workload's settings: each is a flag, a `--config` key and, unless adjustable, part of
    the run's identity that --resume checks."""

    backbone: str = setting(
        "test_efficientnet_gn",
        "timm model name; the default is timm's tiny GroupNorm EfficientNet for CPUs "
        "(original: efficientnet_b3..b5).",
    )
    pretrained: bool = setting(False, "Start from timm's pretrained weights (network).")
    weights: Path | None = setting(
        None, "Local backbone weights (.safetensors/.pt) to start from.", adjustable=True
    )
    init_from: Path | None = setting(
        None,
        "Start from an export's scorer weights (this recipe's, or one converted from the "
        "original with `accel-recipes convert --from crowd-bt`).",
    )
    image_size: int = setting(32, "Images are resized to this square size.", min=8)
    dropout: float = setting(0.2, "Dropout in the MLP head.", min=0.0, max=0.99)
    head_init: str = setting(
        "torch",
        "Head weights at the start: kaiming (the original's _init_head: Kaiming-normal, fan_out) "
        "or torch (nn.Linear's own, which learns faster on the small CPU default).",
    )
    reliability: str = setting(
        "full",
        "full: Crowd-BT, eta per annotator in [0, 1], learned; the original's likelihood "
        "eta s(d) + (1 - eta) / 2 with eta in [0.5, 1]: global (one learned eta, its reduced "
        "form), fixed (--fixed-eta) or gold (each annotator's accuracy on gold_gold pairs, "
        "fixed; annotators under 0.5 left out: its S3 runs).",
    )
    fixed_eta: float = setting(
        0.8,
        "eta for --reliability fixed, in [0.5, 1] (the original's fallback 0.8).",
        min=0.5,
        max=1,
    )
    augment: bool = setting(
        True,
        "The original's training augmentation: flips both ways, rotation up to 15 degrees, "
        "colour jitter (dataset.py 35-43); --no-augment turns it off.",
    )
    draw_weight: float = setting(0.1, "Penalty on |s_i - s_j| for a draw.", min=0.0)
    pair_forward: str = setting(
        "joint",
        "'separate': the i sides, then the j sides, as the original (BatchNorm statistics per "
        "side, running ones updated twice a step); 'joint': one pass over both sides.",
    )
    eta_lr: float = setting(
        2e-2, "Learning rate of the annotator reliabilities (no weight decay).", min=0.0
    )
    held_out: float = setting(
        0.15, "Share of comparisons held out for evaluation.", min=0.01, max=0.9
    )
    image_dir: Path | None = setting(
        None,
        "Folder the records' img1/img2 names are relative to (the original's --image-dir, "
        "e.g. data/iter_0). Default: DATA/images.",
        adjustable=True,
    )
    skip_missing_images: bool = setting(
        False,
        "Drop records naming images that are not under --image-dir, as the original did "
        "silently, instead of stopping with a list of them.",
    )
    skip_invalid_records: bool = setting(
        False,
        "Drop records with a null, empty or unknown choice or without img1/img2, as the "
        "original did silently, instead of stopping at the first one.",
    )

    def validate(self) -> None:
        super().validate()
        for flag, choices in CHOICES.items():
            if getattr(self, flag) not in choices:
                raise ConfigError(f"--{flag.replace('_', '-')} {getattr(self, flag)}: choose "
                                  f"{', '.join(choices[:-1])} or {choices[-1]}")  # fmt: skip
        require_known_backbone(self.backbone)  # here: the dry run refuses it as the run does


# --------------------------------------------------------------------------- WORKLOAD: loss


def reliabilities(
    model: QualityScorer, mode: str, fixed_eta: float, gold: torch.Tensor | None = None
) -> torch.Tensor:
    """eta per annotator: `full` learns each in [0, 1] (crowd_bt_loss); the original's forms
    keep it in [0.5, 1] (original_loss): `global` learns one shared value as the original does,
    0.5 + 0.5 sigmoid(logit) (loss.py 78), `fixed` uses --fixed-eta, `gold` each annotator's
    accuracy on gold pairs (its S3 runs)."""
    logits = model.annotator_logits
    if mode == "full":
        return torch.sigmoid(logits)
    if mode == "global":
        return (0.5 + 0.5 * torch.sigmoid(logits[:1])).expand_as(logits)
    if mode == "gold":
        return gold.to(logits) + 0 * logits
    return fixed_eta + 0 * logits  # still in the graph: DDP expects a gradient for every parameter


def crowd_bt_loss(
    diff: torch.Tensor, choice: torch.Tensor, eta: torch.Tensor, draw_weight: float
) -> torch.Tensor:
    """Mean negative log-likelihood of the votes; a draw costs draw_weight * |s_i - s_j|."""
    log_eta, log_not = torch.log(eta.clamp(1e-6, 1)), torch.log((1 - eta).clamp(1e-6, 1))
    log_left = torch.logaddexp(log_eta + F.logsigmoid(diff), log_not + F.logsigmoid(-diff))
    log_right = torch.logaddexp(log_eta + F.logsigmoid(-diff), log_not + F.logsigmoid(diff))
    nll = torch.where(choice > 0, -log_left, -log_right)
    return torch.where(choice == 0, draw_weight * diff.abs(), nll).mean()


def original_loss(
    diff: torch.Tensor, choice: torch.Tensor, eta: torch.Tensor, draw_weight: float
) -> torch.Tensor:
    """The original's likelihood, as it computes it (loss.py 114-168, every weight 1): a vote
    for the left image has P = eta sigmoid(d) + (1 - eta) / 2 with eta in [0.5, 1], cost
    -log(P + 1e-8); a draw costs draw_weight * |d| (the original's 0.5); the sum over the batch
    divided by its size + 1e-8."""
    eta = eta.clamp(0.5, 1.0)
    p = eta * torch.sigmoid(torch.where(choice < 0, -diff, diff)) + (1 - eta) * 0.5
    cost = torch.where(choice == 0, draw_weight * diff.abs(), -torch.log(p + 1e-8))
    return cost.sum() / (choice.numel() + 1e-8)


def likelihood(mode: str):
    """The loss of a --reliability mode: Crowd-BT for full, the original's for its own modes."""
    return crowd_bt_loss if mode == "full" else original_loss


# --------------------------------------------------------------------------- WORKLOAD: quality


def rank_correlations(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """Spearman's rho and Kendall's tau-b, both with ties handled (scipy): tied scores share
    their average rank, so the result does not depend on the order of the rows. The win-rate
    baseline ties often; breaking its ties arbitrarily would understate it."""
    from scipy.stats import kendalltau, spearmanr

    x, y = a.double().numpy(), b.double().numpy()
    return float(spearmanr(x, y).statistic), float(kendalltau(x, y, variant="b").statistic)


def win_rates(records: list, index: dict) -> torch.Tensor:
    """The baseline: each image's share of wins (draws count half) in the training votes."""
    wins, seen = torch.zeros(len(index)), torch.zeros(len(index))
    for a, b, choice, *_ in records:
        wins[index[a]] += (1 + choice) / 2
        wins[index[b]] += (1 - choice) / 2
        seen[index[a]] += 1
        seen[index[b]] += 1
    return wins / seen.clamp(min=1)


def pairwise_accuracy(scores: torch.Tensor, records: list, index: dict) -> float:
    """Share of held-out non-draw votes whose winner has the higher score (the original's
    evaluate.py, by pair type)."""
    decided = [(index[a], index[b], c) for a, b, c, *_ in records if c != 0]
    hits = [(scores[i] - scores[j]).sign().item() == c for i, j, c in decided]
    return sum(hits) / max(1, len(hits))


def margin_accuracy(scores: torch.Tensor, records: list, index: dict, margin: float) -> float:
    """The original's accuracy (loss.py 161-169), draws included: a difference within the
    margin (0.1) predicts a draw, beyond it the higher score's image."""
    if not records:
        return 0.0
    i = torch.tensor([index[r[0]] for r in records])
    j = torch.tensor([index[r[1]] for r in records])
    diff = scores[i] - scores[j]
    predicted = (diff > margin).long() - (diff < -margin).long()
    return (predicted == torch.tensor([r[2] for r in records])).float().mean().item()


def linear_ndcg(truth: torch.Tensor, scores: torch.Tensor) -> float:
    """The original's global NDCG (compute_ndcg.py 27-47): relevance = the true value, images
    ranked by score, gain rel / log2(rank + 1), divided by the ideal order's."""
    discount = torch.log2(torch.arange(2, len(truth) + 2, dtype=torch.float64))
    gain = truth.double()
    ideal = (gain.sort(descending=True).values / discount).sum()
    actual = (gain[scores.double().argsort(descending=True)] / discount).sum()
    return (actual / ideal).item() if ideal > 0 else 0.0


def against(metrics: dict, name: str, scores, baseline, measure) -> None:
    """metrics[name] for the model and metrics[baseline_name] for the win-rate baseline."""
    metrics[name], metrics[f"baseline_{name}"] = measure(scores), measure(baseline)


@torch.no_grad()
def image_scores(accelerator: Accelerator, model: nn.Module, loader: DataLoader) -> torch.Tensor:
    """Scores of all images in order (a prepared, unshuffled loader), computed in parallel and
    gathered exactly once each."""
    model.eval()
    scores = torch.cat([accelerator.gather_for_metrics(model(x)) for x in loader])
    model.train()
    return scores.float().cpu()


def evaluate(
    scores: torch.Tensor,
    train_records: list,
    held_out: list,
    index: dict,
    truth: dict | None,
    names: list[str],
    categories: dict[str, str] | None = None,
) -> dict[str, float]:
    """Held-out pairwise accuracy (non-draw votes; with the original's 0.1 draw margin, draws
    included; by pair type, gold_gold among them, where records name one), the rank correlation
    and NDCG against gold images' category ranks (where records name categories) and against
    true quality (truth.json), each next to the win-rate baseline."""
    baseline = win_rates(train_records, index)
    metrics: dict[str, float] = {}
    against(metrics, "pair_acc", scores, baseline, lambda s: pairwise_accuracy(s, held_out, index))
    margin = partial(margin_accuracy, records=held_out, index=index, margin=DRAW_MARGIN)
    against(metrics, "pair_acc_margin", scores, baseline, margin)
    for kind in sorted({r.pair_type for r in held_out} - {""}):
        votes = [r for r in held_out if r.pair_type == kind]
        measure = partial(pairwise_accuracy, records=votes, index=index)
        against(metrics, f"pair_acc_{kind}", scores, baseline, measure)
    ranked = [(index[n], quality_rank(c)) for n, c in (categories or {}).items() if n in index]
    ranked = [(i, rank) for i, rank in ranked if rank >= 0]
    if len(ranked) > 1:  # the gold ranking: the categories' ranks
        at = torch.tensor([i for i, _ in ranked])
        gold = torch.tensor([float(rank) for _, rank in ranked])
        for key, measure in correlations_and_ndcg(gold).items():
            against(metrics, f"{key}_gold", scores[at], baseline[at], measure)
    if truth is not None:
        true_quality = torch.tensor([truth["quality"][name] for name in names])
        for key, measure in correlations_and_ndcg(true_quality).items():
            against(metrics, key, scores, baseline, measure)
    return metrics


def correlations_and_ndcg(truth: torch.Tensor) -> dict:
    """Spearman, Kendall and linear NDCG of scores against `truth`, by name."""
    return {
        "spearman": lambda s: rank_correlations(s, truth)[0],
        "kendall": lambda s: rank_correlations(s, truth)[1],
        "ndcg": lambda s: linear_ndcg(truth, s),
    }


# --------------------------------------------------------------------------- training


def gold_votes(
    accelerator: Accelerator, records: list, categories: dict, annotators: list[str]
) -> tuple[list, torch.Tensor]:
    """--reliability gold, as the original's S3 runs (train.py 288-305): each annotator's eta
    fixed at their accuracy on gold_gold pairs; annotators below 0.5 left out."""
    etas = gold_reliabilities(records, categories)
    if not any(r.pair_type == GOLD_PAIR for r in records):
        raise DataError(
            f"--reliability gold: no {GOLD_PAIR} pairs (records with pair_type {GOLD_PAIR} and "
            "img1_category / img2_category) to measure the annotators on"
        )
    shown = ", ".join(f"{who} {eta:.3f}" for who, eta in sorted(etas.items()))
    say(accelerator, f"gold-pair reliabilities (fixed eta): {shown}")
    low = {who for who, eta in etas.items() if eta < 0.5}
    if low:
        say(accelerator, f"left out, gold-pair accuracy under 0.5: {', '.join(sorted(low))}")
        records = [r for r in records if r.annotator not in low]
    if not records:
        raise DataError("--reliability gold: every annotator is under 0.5 on the gold pairs")
    return records, torch.tensor([etas[who] for who in annotators])


def read_data(data_dir: Path, settings: QualitySettings) -> Comparisons:
    """The records the run trains on (and their annotators, one reliability each)."""
    return read_comparisons(
        data_dir,
        settings.image_dir or data_dir / "images",
        skip_missing_images=settings.skip_missing_images,
        skip_invalid_records=settings.skip_invalid_records,
    )


def build_model(args: SharedSettings, settings: QualitySettings) -> QualityScorer:
    """The network for --dry-run: one reliability per annotator the run reads from --data (its
    records read as the run reads them: a flat layout's name their annotators), else per
    annotator of the example; a --data this machine lacks leaves it uncounted (DataError)."""
    annotators = len(ANNOTATORS)
    if args.data is not None:
        data_dir = existing_data(RECIPE, args.data)
        annotators = len(read_data(data_dir, settings).annotators)
    return QualityScorer(settings.backbone, annotators, settings.dropout)


@train_command(
    QualitySettings,
    build_model=build_model,
    default_per_device_bs=32,
    lr=1e-3,
    ref_bs=32,
    epochs=20,
    weight_decay=1e-5,
    schedule=Decay.cosine,
    min_lr_ratio=0.01,
    output_dir=Path("runs/quality"),
    aliases={"per_device_bs": ["--batch-size"]},
)
def train(args: SharedSettings, settings: QualitySettings) -> dict[str, float]:
    """Train the Crowd-BT quality scorer on pairwise comparisons (or a generated example).

    --data takes the original project's folder as it is: DATA/<annotator>/comparison_data.json
    (its quack_v2_data_user_logs/, synced from S3), or DATA/annotations/<annotator>.json; the
    images are under --image-dir. See docs/recipes/quality.md."""
    if settings.init_from is not None:  # before the data is read
        require_start_export(settings.init_from, RECIPE, ORIGINAL)
    accelerator, plan = args.make_accelerator()
    data_dir = resolve_data(accelerator, RECIPE, args.data, write_dataset)
    image_dir = settings.image_dir or data_dir / "images"
    data = read_data(data_dir, settings)
    records, annotators, names = data.records, data.annotators, data.images
    truth = read_truth(data_dir / TRUTH_FILE, names, annotators)
    draws = sum(r[2] == 0 for r in records)
    found = f"{len(records)} comparisons ({draws} draws) by {len(annotators)} annotators"
    say(accelerator, f"read {found} of {len(names)} images in {image_dir} ({data.layout})")
    if data.invalid:
        reasons = ", ".join(f"{count} {reason}" for reason, count in data.invalid.items())
        invalid = f"{sum(data.invalid.values())} invalid records ({reasons})"
        say(accelerator, f"--skip-invalid-records: dropped {invalid}")
    if data.dropped:
        dropped = f"{data.dropped} records naming images that are not under {image_dir}"
        say(accelerator, f"--skip-missing-images: dropped {dropped}")
    if truth is None:
        skipped = "the rank correlations with true quality and eta_corr are skipped"
        say(accelerator, f"no truth.json in {data_dir} (real data): {skipped}")
    gold = None
    if settings.reliability == "gold":
        records, gold = gold_votes(accelerator, records, data.categories, annotators)
    index = {name: i for i, name in enumerate(names)}
    train_records, held_records = split_comparisons(records, settings.held_out, args.seed)

    model = build_scorer(
        settings.backbone,
        len(annotators),
        settings.dropout,
        settings.pretrained,
        settings.weights,
        settings.head_init,
    )
    if settings.init_from is not None:
        start_from(model, settings.init_from)
    mode, fixed_eta = settings.reliability, settings.fixed_eta
    if mode == "global":  # the original's eta_init 0.8: logit(2 * 0.8 - 1) (loss.py 68-73)
        model.annotator_logits.data.fill_(math.log(0.6 / 0.4))
    mean, std = normalisation(model.backbone.backbone)
    size = settings.image_size
    train_images = ImageReader(image_dir, size, mean, std, augment=settings.augment)
    network = [
        p for name, p in model.named_parameters() if name != RELIABILITY_KEY and p.requires_grad
    ]
    eta_scale = settings.eta_lr / args.lr  # --eta-lr, following --lr's scaling and schedule
    groups = [
        {"params": network, "weight_decay": args.weight_decay},
        # a few scalars that must travel far (0.8 -> 0.1 for a reversed annotator)
        {"params": [model.annotator_logits], "weight_decay": 0.0, "lr_scale": eta_scale},
    ]
    optimizer = args.make_optimizer(torch.optim.AdamW, groups, lr=args.lr)
    pairs = Pairs(train_records, train_images, annotators, seed=args.seed)
    train_loader = args.make_train_loader(pairs, plan)
    every_image = Images(names, ImageReader(image_dir, size, mean, std))  # scored each epoch
    image_loader = DataLoader(every_image, batch_size=64, num_workers=args.workers)
    args.adapt_model(model)  # --sync-batchnorm, --compile: in place, before prepare
    model, optimizer, train_loader, image_loader = accelerator.prepare(
        model, optimizer, train_loader, image_loader
    )
    schedule = args.make_lr_schedule(accelerator, optimizer, plan, len(train_loader))
    derived = {"annotators": annotators}  # the score command builds the model from these too
    read = [*data.files, *([data_dir / TRUTH_FILE] if truth is not None else [])]
    data_files = named_files(read, data_dir)
    data_files |= named_files([image_dir / n for n in names], image_dir, "--image-dir/")
    loop = args.make_loop(
        accelerator, plan, train_loader, schedule,
        recipe=RECIPE, data_files=data_files, settings=settings, derived=derived,
    )  # fmt: skip
    loss_of = likelihood(mode)

    def score() -> dict[str, float]:
        scores = image_scores(accelerator, model, image_loader)
        metrics = evaluate(
            scores, train_records, held_records, index, truth, names, data.categories
        )
        eta = reliabilities(accelerator.unwrap_model(model), mode, fixed_eta, gold).detach()
        metrics |= {f"eta_{who}": eta[k].item() for k, who in enumerate(annotators)}
        if truth is not None and mode == "full":
            true_eta = torch.tensor([truth["reliability"][who] for who in annotators])
            metrics["eta_corr"] = torch.corrcoef(torch.stack([eta.cpu(), true_eta]))[0, 1].item()
        return metrics

    for _epoch in loop.epochs():
        for image_i, image_j, choice, annotator in loop.batches():
            with accelerator.accumulate(model):
                parts = 2 if settings.pair_forward == "separate" else 1
                s_i, s_j = model(torch.cat([image_i, image_j]), parts).chunk(2)
                eta = reliabilities(accelerator.unwrap_model(model), mode, fixed_eta, gold)
                loss = loss_of(s_i - s_j, choice, eta[annotator], settings.draw_weight)
                accelerator.backward(loss)
                loop.clip_gradients(model)
                optimizer.step()
                optimizer.zero_grad()
            loop.record(loss)
        loop.end_epoch(score())
    return loop.finish(model)


# --------------------------------------------------------------------------- single-device use


def load_scorer(model_dir: Path) -> tuple[QualityScorer, ImageReader, torch.device]:
    """An export (trained here or converted from the original) on one device, in eval mode,
    with the evaluation preprocessing its backbone takes."""
    config = read_recipe_export(model_dir, RECIPE)
    settings = QualitySettings.from_config(config)
    model = QualityScorer(settings.backbone, len(config["annotators"]), settings.dropout)
    device = load_for_inference(model_dir, model)
    mean, std = normalisation(model.backbone.backbone)
    return model, ImageReader(Path("."), settings.image_size, mean, std), device


def compare(
    model_dir: Path = model_option(RECIPE),
    images: list[Path] = typer.Argument(..., help="One image to score, or two to compare."),
    margin: float = typer.Option(
        0.1, min=0.0, help="Score difference under which two images are a draw (the original's)."
    ),
) -> None:
    """Score one image, or compare two: which is better, and the probability that it is
    (Bradley-Terry: sigmoid of the score difference), as the original's infer.py does."""
    if len(images) not in (1, 2):
        raise ConfigError(f"give one image to score or two to compare, not {len(images)}")
    model, read, device = load_scorer(model_dir)
    with torch.no_grad():
        scores = model(torch.stack([read(str(path)) for path in images]).to(device)).tolist()
    lines = [f"{image}: score {score:.6f}" for image, score in zip(images, scores, strict=True)]
    if len(images) == 2:
        diff = scores[0] - scores[1]
        p_first = torch.sigmoid(torch.tensor(diff)).item()
        better = images[0] if diff > 0 else images[1]
        lines.append(
            f"draw (|difference| {abs(diff):.4f} <= {margin})"
            if abs(diff) <= margin
            else f"{better} is better, probability {max(p_first, 1 - p_first):.4f}"
        )
    print_names("\n".join(lines))


def export_onnx(
    model_dir: Path = model_option(RECIPE),
    out: Path = typer.Option(..., help="ONNX file to write (scores images N x 3 x S x S)."),
    opset: int = typer.Option(
        17,
        min=ONNX_OPSETS[0],
        max=ONNX_OPSETS[1],
        help=f"ONNX opset version, {ONNX_OPSETS[0]} to {ONNX_OPSETS[1]}: what the exporter writes.",
    ),
) -> None:
    """Export the scorer to ONNX, as the original's export.py offers: input `image` (N x 3 x S x
    S, normalised as the backbone's data config says), output `score` (N x 1); dynamic batch."""
    require_new_file(out)
    model, read, _ = load_scorer(model_dir)  # a wrong --model first: installing onnx won't help
    require_onnx()
    write_onnx(model, read.size, out, opset)
    print(f"wrote {out}")


def score_folder(
    model_dir: Path = model_option(RECIPE),
    images: Path = typer.Option(..., help="Folder of images to rate (subfolders too)."),
    out: Path = typer.Option(..., help="CSV to write: image,score (higher is better)."),
    bs: int = typer.Option(64, min=1, help="Images per forward pass (memory grows with it)."),
) -> None:
    """Rate every image in a folder with an exported model, on one device, best first."""
    require_new_file(out)
    model, read, device = load_scorer(model_dir)
    read.folder = images
    names = list_images(images)
    loader = DataLoader(Images(names, read), batch_size=bs)
    with torch.no_grad():
        values = torch.cat([model(pixels.to(device)).cpu() for pixels in loader])
    scores = dict(zip(names, values.tolist(), strict=True))
    # a file name's own bytes (b"\xff.png" is no UTF-8): the CSV names the file as it is on disk
    with (
        new_file(out) as partial,
        partial.open("w", newline="", encoding="utf-8", errors="surrogateescape") as handle,
    ):
        writer = csv.writer(handle)
        writer.writerow(["image", "score"])
        ranked = sorted(scores.items(), key=lambda row: -row[1])
        writer.writerows((name, f"{value:.6f}") for name, value in ranked)
    print(f"wrote {out}: {len(scores)} images")


if __name__ == "__main__":
    run_recipe(train, score=score_folder, compare=compare, **{"export-onnx": export_onnx})
