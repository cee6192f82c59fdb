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

This file is the training recipe: its command, set-up, loop and the scoring of every image each
epoch; recipes/quality/configs/original.yaml is the original's preset. What only it needs lives in
recipes/quality/: the settings (settings.py: QualitySettings, every workload flag, `--config` key
and what --resume checks), the reader of the annotation files, the split and the dataset of pairs
(data.py), the scorer network (model.py), the Crowd-BT and the original's likelihoods with each
--reliability mode's eta (loss.py), the metrics against the win-rate baseline (metrics.py), the
`score`, `compare` and `export-onnx` commands (commands.py), the example set (example.py).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader

from accel_common import (
    DataError,
    Decay,
    SharedSettings,
    require_start_export,
    run_recipe,
    say,
    train_command,
)
from accel_common.data import cache_key, existing_data, named_files, resolve_data
from recipes.quality.commands import compare, export_onnx, score_folder
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
    read_comparisons,
    read_truth,
    split_comparisons,
)
from recipes.quality.example import ANNOTATORS, write_dataset
from recipes.quality.loss import likelihood, reliabilities
from recipes.quality.metrics import evaluate
from recipes.quality.model import RELIABILITY_KEY, QualityScorer, build_scorer, start_from
from recipes.quality.settings import RECIPE, QualitySettings

# how `accel-recipes check` and the tests run it (recipes/train_template.py): 16 px, no dropout
CHECK_ARGS = ["--bs", "8", "--dropout", "0", "--image-size", "16"]
CHECK_DATA = {"images": 12, "comparisons_per_annotator": 16, "size": 16}
CHECK_COMMAND = ["score", "--model", "{model}", "--images", "{data}/images", "--out", "{out}.csv"]
CHECK_RESUME = ["--dropout", "0.2"]  # the kill-and-resume test: dropout on, as augmentation is


# --------------------------------------------------------------------------- WORKLOAD: quality


@torch.no_grad()
def image_scores(accelerator: Accelerator, model: nn.Module, loader: DataLoader) -> torch.Tensor:
    """Scores of all images in order (a prepared, unshuffled loader), computed in parallel and
    gathered exactly once each."""
    model.eval()
    scores = torch.cat([accelerator.gather_for_metrics(model(x)) for x in loader])
    model.train()
    return scores.float().cpu()


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
    stratified = settings.split == "stratified"
    train_records, held_records = split_comparisons(
        records, settings.held_out, args.seed, stratified
    )
    held = f"{len(held_records)} held out ({settings.split} split, seed {args.seed})"
    say(accelerator, f"split: {len(train_records)} comparisons to train on, {held}")

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
    # the members of each side, digested: a resume on other members (a checkpoint from before
    # the original's split) is refused
    derived["split_members"] = cache_key(
        [[list(v) for v in part] for part in (train_records, held_records)]
    )
    read = [*data.files, *([data_dir / TRUTH_FILE] if truth is not None else [])]
    data_files = named_files(read, data_dir)
    data_files |= named_files([image_dir / n for n in names], image_dir, "--image-dir/")
    loop = args.make_loop(
        accelerator, plan, train_loader, schedule, model=model,  # model: what --ema-decay averages
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
        with loop.ema.applied():  # --ema-decay: the EMA's weights are scored (and exported)
            loop.end_epoch(score())
    return loop.finish(model)


if __name__ == "__main__":
    run_recipe(train, score=score_folder, compare=compare, **{"export-onnx": export_onnx})
