"""Image captioning with mixed precision and gradient accumulation: a ViT encoder, a causal decoder.

The image is cut into patches and encoded by self-attention blocks; a causal transformer decoder
with cross-attention to the image writes the caption one token at a time. The loss is next-token
cross-entropy averaged over the real (non-pad) tokens of the whole global batch, so 1 process and
N processes x accumulation give the same gradients although captions differ in length.

    python recipes/train_captioning.py                                  # built-in example, 1 CPU
    python recipes/train_captioning.py --mixed-precision bf16           # bf16 autocast, CPU or GPU
    accelerate launch --config_file accelerate_configs/8gpu.yaml recipes/train_captioning.py \\
        --data DIR --mixed-precision fp16 --per-device-bs 32 --grad-accum 4 \\
        --lr 1e-4 --ref-bs 128 --lr-scaling sqrt \\
        --image-size 224 --patch 16 --dim 512 --depth 6 --decoder-depth 6 --heads 8
    # plan: global 1024, per device 32, accumulation 4, lr 0.0002828
    python recipes/train_captioning.py caption --model runs/captioning/model --images DIR --out FILE

`--dry-run` (with `--processes N` for another launch size) prints a command's plan (batch, LR,
parameters) without training; `--config FILE.yaml` sets any flag (flags given still win).

Data (--data DIR, with train/ and test/ (or validation/) folders, or one folder of which every
tenth image is held out): Hugging Face `imagefolder` (images + metadata.jsonl or metadata.csv with
file_name and text), a captions.json manifest {image path: caption}, or the original's images
each with a same-named .txt caption.

This file is the training recipe: set-up, loss, loop, evaluation and the `caption` command. What
only it needs lives in recipes/captioning/: the readers, Arrow cache and batching (data.py), the
tokenizer (tokenizer.py), the network and greedy decoding (model.py), the example set (example.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import typer
from accelerate import Accelerator
from accelerate.utils import GradScalerKwargs
from tokenizers import Tokenizer
from torch import nn
from torch.distributed.fsdp import register_fsdp_forward_method
from torch.utils.data import DataLoader

from accel_common import (
    MAX_BLOCKS,
    CheckpointError,
    ConfigError,
    DataError,
    GlobalItemMean,
    Settings,
    SharedSettings,
    forward_is_collective,
    load_exported,
    load_for_inference,
    model_option,
    new_file,
    read_recipe_export,
    require_new_file,
    require_start_export,
    run_recipe,
    setting,
    train_command,
)
from accel_common.data import existing_data, image_batches, list_images, named_files, resolve_data
from recipes.captioning.data import collate, prepare_split, read_split, split_files
from recipes.captioning.example import write_dataset
from recipes.captioning.model import Captioner, greedy_captions
from recipes.captioning.tokenizer import BOS, EOS, PAD_ID, shared_tokenizer, train_tokenizer

RECIPE = "captioning"
# `accel-recipes check captioning` and the tests that find every recipe run it so (see
# recipes/train_template.py): tiny, on 16-pixel images
CHECK_ARGS = ["--dim", "32", "--depth", "1", "--decoder-depth", "1", "--image-size", "16"]
CHECK_ARGS += ["--bs", "8"]
CHECK_DATA = {"train_images": 32, "test_images": 4, "size": 16}
CHECK_COMMAND = ["caption", "--model", "{model}", "--images", "{data}/test", "--out", "{out}.txt"]
# the kill-and-resume test: 3 micro-batches of 2 per step, 16 an epoch, so windows run across
# epoch ends
CHECK_RESUME = ["--bs", "6", "--grad-accum", "3"]
TOKENIZER_FILE = "tokenizer.json"  # beside the export
EXAMPLE_VOCAB = 20  # the example's 16 words and [PAD] [UNK] [BOS] [EOS]
NETWORK = ("image_size", "patch", "dim", "depth", "decoder_depth", "heads", "max_tokens")


# --------------------------------------------------------------------------- WORKLOAD: settings


@dataclass
class CaptioningSettings(Settings):
    """The workload's settings: each is a flag, a `--config` key and part of the run identity.
    The sizes in parentheses are the original guide's."""

    image_size: int = setting(32, "Images are resized to this square (224).", min=8)
    patch: int = setting(8, "Patch size of the encoder (original-style: 16).", min=1)
    dim: int = setting(64, "Width of encoder and decoder (512).", min=8)
    depth: int = setting(2, "Encoder blocks (6).", min=1, max=MAX_BLOCKS)
    decoder_depth: int = setting(2, "Decoder blocks (6).", min=1, max=MAX_BLOCKS)
    heads: int = setting(4, "Attention heads; must divide --dim.", min=1)
    max_tokens: int = setting(24, "Longest caption in tokens, with BOS/EOS.", min=3)
    init_scale: float = setting(2.0**15, "fp16: initial loss scale (dynamic).")
    growth_interval: int = setting(100, "fp16: steps before the scale grows.", min=1)
    init_from: Path | None = setting(
        None,
        "Start from the weights of an export (fine-tuning), loaded strictly, with the "
        f"{TOKENIZER_FILE} beside it in place of one trained on --data's captions: this "
        "recipe's, or a checkpoint converted with `accel-recipes convert CKPT OUT --recipe "
        f"captioning` and its tokenizer saved as OUT/{TOKENIZER_FILE}.",
    )

    def validate(self) -> None:
        super().validate()
        if self.dim % self.heads or self.image_size % self.patch:
            raise ConfigError("--heads must divide --dim and --patch must divide --image-size")

    def network(self) -> dict[str, int]:
        """The sizes `Captioner` takes besides the vocabulary."""
        return {name: getattr(self, name) for name in NETWORK}


def build_model(args: SharedSettings, settings: CaptioningSettings) -> Captioner:
    """The network for `--dry-run`: its vocabulary counted from --data's training captions (a
    tokenizer trained on them, as the run does), or the example's; a --data this machine lacks
    leaves it uncounted (DataError)."""
    vocab_size = EXAMPLE_VOCAB
    if settings.init_from is not None:  # its tokenizer, as the run's
        if not settings.init_from.exists():  # planned on another machine than the run's
            raise DataError(f"--init-from {settings.init_from}: not on this machine")
        vocab_size = read_tokenizer(settings.init_from, "--init-from").get_vocab_size()
    elif args.data is not None:
        captions = [text for _, text in read_split(existing_data(RECIPE, args.data), "train")[1]]
        vocab_size = train_tokenizer(captions).get_vocab_size()
    return Captioner(vocab_size, **settings.network())


# --------------------------------------------------------------------------- WORKLOAD: quality


def next_token_loss(
    logits: torch.Tensor, tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy over the real next tokens, and their count (pads are ignored)."""
    labels = tokens[:, 1:]
    summed = F.cross_entropy(
        logits[:, :-1].float().flatten(0, 1), labels.flatten(), ignore_index=PAD_ID, reduction="sum"
    )
    return summed, (labels != PAD_ID).sum()


@torch.no_grad()
def evaluate(
    accelerator: Accelerator, model: nn.Module, loader: DataLoader, majority: int, derived: dict
) -> dict[str, float]:
    """Token accuracy and per-token cross-entropy on held-out images, against the majority-token
    (always the most frequent training token) and uniform baselines, and the share of images
    whose greedy caption is exactly right. Sums are gathered per image, so each counts once."""
    model.eval()
    plain = accelerator.unwrap_model(model)
    early = not forward_is_collective(accelerator)
    rows = []
    for batch in loader:
        pixels, tokens = batch["pixels"], batch["tokens"]
        logits = model(pixels, tokens)[:, :-1].float()
        labels = tokens[:, 1:]
        real = labels != PAD_ID
        nll = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none") * real
        correct = (logits.argmax(-1) == labels) & real
        length = tokens.shape[1]
        # sharded weights: every process decodes as many tokens as the longest batch's captions
        steps = length if early else accelerator.gather(tokens.new_tensor([length])).max().item()
        generated = greedy_captions(
            plain, pixels, derived["bos"], derived["eos"], steps, stop_when_done=early
        )[:, :length]
        generated = F.pad(generated, (0, length - generated.shape[1]), value=PAD_ID)
        exact = (generated == tokens).all(dim=1)
        per_image = [nll.sum(1), real.sum(1), correct.sum(1), ((labels == majority) & real).sum(1)]
        per_image = torch.stack([*per_image, exact], dim=1).double()
        rows.append(accelerator.gather_for_metrics(per_image))
    model.train()
    rows = torch.cat(rows)
    nll, count, correct, majority_hits, exact = rows.sum(0).tolist()
    return {
        "token_accuracy": correct / count,
        "baseline_majority_token_accuracy": majority_hits / count,
        "cross_entropy": nll / count,
        "baseline_uniform_cross_entropy": math.log(derived["vocab_size"]),
        "exact_caption_share": exact / len(rows),
        "n": len(rows),
    }


# --------------------------------------------------------------------------- training


@train_command(
    CaptioningSettings,
    build_model=build_model,
    default_bs=64,
    grad_accum=4,  # the original's accumulation; the banner shows the global batch
    lr=1e-3,  # the original's 1e-4 (batch 32 x 4 per GPU) learns too slowly for the CPU example
    ref_bs=64,
    epochs=20,
    warmup_steps=20,
    min_lr_ratio=0.1,  # cosine to 0.1 x lr, as the original
    weight_decay=1e-5,
    output_dir=Path("runs/captioning"),
)
def train(args: SharedSettings, settings: CaptioningSettings) -> dict[str, float]:
    """Train the image captioner (ViT encoder, causal decoder) on captioned images."""
    scaler = GradScalerKwargs(
        init_scale=settings.init_scale, growth_interval=settings.growth_interval
    )
    start = None
    if settings.init_from is not None:  # before the data is read: its weights and tokenizer
        require_start_export(settings.init_from, RECIPE, None)
        start = read_tokenizer(settings.init_from, "--init-from")
    accelerator, plan = args.make_accelerator(kwargs_handlers=[scaler])
    data_dir = resolve_data(accelerator, RECIPE, args.data, write_dataset)
    train_folder, train_records = read_split(data_dir, "train")
    test_folder, test_records = read_split(data_dir, "test")
    tokenizer = start or shared_tokenizer(accelerator, [text for _, text in train_records])
    size, max_tokens = settings.image_size, settings.max_tokens
    with accelerator.main_process_first():  # the main process decodes; the others read its cache
        train_set, seconds, cached = prepare_split(
            train_folder, train_records, tokenizer, size, max_tokens
        )
        test_set, *_ = prepare_split(test_folder, test_records, tokenizer, size, max_tokens)
    how = "read from the cache" if cached else "decoded and cached"
    accelerator.print(f"{len(train_set)} training images {how} in {seconds:.2f}s")
    captions = train_set["tokens"]
    counts = np.bincount(np.concatenate([t[1:].numpy() for t in captions]))
    majority = int(counts.argmax())

    # what `caption` needs besides the settings: the vocabulary's size and its [BOS]/[EOS] ids
    derived = {"vocab_size": tokenizer.get_vocab_size()}
    derived |= {t.lower()[1:-1]: tokenizer.token_to_id(t) for t in (BOS, EOS)}
    model = Captioner(derived["vocab_size"], **settings.network())
    if settings.init_from is not None:  # fine-tuning: strictly, or one line naming the misfit
        load_exported(settings.init_from, model)
    # Adam with L2 weight decay, as the original (not AdamW's decoupled decay)
    optimizer = args.make_optimizer(
        torch.optim.Adam, model.parameters(), lr=args.lr, weight_decay=args.weight_decay
    )
    # each step's captions spread over the processes by their token count
    tokens = [len(t) for t in captions]
    train_loader = args.make_train_loader(train_set, plan, collate_fn=collate, costs=tokens)
    test_loader = DataLoader(test_set, batch_size=plan.per_device_batch_size, collate_fn=collate)
    args.adapt_model(model)  # --sync-batchnorm, --compile: in place, before prepare
    model, optimizer, train_loader, test_loader = accelerator.prepare(
        model, optimizer, train_loader, test_loader
    )
    for method in ("encode", "decode"):  # greedy decoding's calls gather FSDP's shards too
        register_fsdp_forward_method(accelerator.unwrap_model(model), method)  # else a no-op
    schedule = args.make_lr_schedule(accelerator, optimizer, plan, len(train_loader))
    read = [*split_files(train_folder, train_records), *split_files(test_folder, test_records)]
    data_files = named_files(read, data_dir)
    if settings.init_from is not None:  # the tokenizer read is data: a changed one is another run
        path = tokenizer_path(settings.init_from)
        data_files |= named_files([path], path.parent, "--init-from/")
    loop = args.make_loop(
        accelerator, plan, train_loader, schedule, model=model,  # model: what --ema-decay averages
        recipe=RECIPE, data_files=data_files, settings=settings, derived=derived,
    )  # fmt: skip
    token_mean = GlobalItemMean(accelerator, plan)  # exact over varying caption lengths

    for _epoch in loop.epochs():
        for batch in loop.batches():
            with accelerator.accumulate(model):
                logits = model(batch["pixels"], batch["tokens"])
                summed, n_tokens = next_token_loss(logits, batch["tokens"])
                accelerator.backward(token_mean.loss(summed, n_tokens))
                token_mean.normalize_gradients(model)
                loop.clip_gradients(model)
                optimizer.step()
                optimizer.zero_grad()
            loop.record(summed.detach() / n_tokens, items=n_tokens)  # logged: per token
        with loop.ema.applied():  # --ema-decay: the EMA's weights are scored (and exported)
            loop.end_epoch(evaluate(accelerator, model, test_loader, majority, derived))
    metrics = loop.finish(model)
    if accelerator.is_main_process:
        tokenizer.save(str(args.output_dir / "model" / TOKENIZER_FILE))
    return metrics


# --------------------------------------------------------------------------- single-device use


def tokenizer_path(model_dir: Path) -> Path:
    """Where training saves the tokenizer: beside the export (a folder, or its .safetensors)."""
    return (model_dir if model_dir.is_dir() else model_dir.parent) / TOKENIZER_FILE


def read_tokenizer(model_dir: Path, flag: str = "--model") -> Tokenizer:
    """The tokenizer training saved beside the export (`model_dir` a folder, or the
    .safetensors in one); missing or unreadable, one line naming it."""
    path = tokenizer_path(model_dir)
    if not path.is_file():
        raise CheckpointError(
            f"{flag} {model_dir}: no {TOKENIZER_FILE} beside the export ({path}); training "
            f"saves it there: copy it with the model"
        )
    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # the tokenizers library raises a bare Exception
        raise CheckpointError(f"{path}: not a tokenizer file ({err})") from None


def caption(
    model_dir: Path = model_option(RECIPE),
    images: Path = typer.Option(..., help="Folder of images to caption (searched recursively)."),
    out: Path = typer.Option(..., help="Where to write 'file<TAB>caption' lines."),
    max_tokens: int = typer.Option(
        None, min=2, help="Longest caption, [BOS]/[EOS] included (default and most: training's)."
    ),
    bs: int = typer.Option(64, min=1, help="Images per forward pass (memory grows with it)."),
) -> None:
    """Write greedy captions for a folder of images with an exported model, on one device."""
    require_new_file(out)
    config = read_recipe_export(model_dir, RECIPE)
    settings = CaptioningSettings.from_config(config)
    if max_tokens is not None and max_tokens > settings.max_tokens:
        raise ConfigError(
            f"--max-tokens {max_tokens}: the model was trained for at most "
            f"{settings.max_tokens} tokens (its position table ends there)"
        )
    tokenizer = read_tokenizer(model_dir)
    model = Captioner(config["vocab_size"], **settings.network())
    device = load_for_inference(model_dir, model)
    longest = max_tokens or settings.max_tokens
    lines = []
    for names, pixels in image_batches(images, list_images(images), settings.image_size, bs):
        ids = greedy_captions(model, pixels.to(device), config["bos"], config["eos"], longest)
        for name, row in zip(names, ids.tolist(), strict=True):
            lines.append(f"{name}\t{tokenizer.decode(row, skip_special_tokens=True)}\n")
    # a file name's own bytes (b"\xff.png" is no UTF-8): the TSV names the file as it is on disk
    with new_file(out) as partial:
        partial.write_text("".join(lines), encoding="utf-8", errors="surrogateescape")
    print(f"wrote {out}: {len(lines)} captions")


if __name__ == "__main__":
    run_recipe(train, caption=caption)
