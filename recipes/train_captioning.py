"""Image captioning with mixed precision and gradient accumulation: a ViT encoder, a causal decoder.

The image is cut into patches and encoded by self-attention blocks; a causal transformer decoder
with cross-attention to the image writes the caption one token at a time. The loss is next-token
cross-entropy averaged over the real (non-pad) tokens of the whole global batch, so 1 process and
N processes x accumulation give the same gradients although captions differ in length.

    python recipes/train_captioning.py                                  # built-in example, 1 CPU
    python recipes/train_captioning.py --mixed-precision bf16           # bf16 autocast, CPU or GPU
    accelerate launch --config_file accelerate_configs/8gpu.yaml recipes/train_captioning.py \\
        --data DIR --mixed-precision fp16 --per-device-bs 32 --grad-accum 4 --lr 1e-4 \\
        --image-size 224 --patch 16 --dim 512 --depth 6 --decoder-depth 6 --heads 8
    python recipes/train_captioning.py caption --model runs/captioning/model --images DIR --out FILE

Data (--data DIR, with train/ and test/ (or validation/) folders, or one folder of which every
tenth image is held out): Hugging Face `imagefolder` (images + metadata.jsonl or metadata.csv with
file_name and text), a captions.json manifest {image path: caption}, or the original's images
each with a same-named .txt caption. See accel_common/data/captioning.py.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import datasets
import numpy as np
import torch
import torch.nn.functional as F
import typer
from accelerate import Accelerator
from accelerate.utils import GradScalerKwargs, broadcast_object_list
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
from torch import nn
from torch.utils.data import DataLoader

from accel_common.checkpoint import load_for_inference, read_recipe_export
from accel_common.data import captioning as caption_data
from accel_common.data.cache import cache_key, cache_root
from accel_common.data.images import image_batches, list_images, read_rgb, to_signed_unit
from accel_common.errors import ConfigError, DataError
from accel_common.losses import GlobalItemMean
from accel_common.options import TrainArgs, model_option, train_options
from accel_common.runtime import require_new_file, resolve_data, run_recipe

RECIPE = "captioning"
PAD, UNK, BOS, EOS = "[PAD]", "[UNK]", "[BOS]", "[EOS]"
PAD_ID = 0  # the first special token the trainer adds


# --------------------------------------------------------------------------- WORKLOAD: data


def train_tokenizer(captions: list[str]) -> Tokenizer:
    """A word-level tokenizer of the training captions (lower-cased), with [BOS] ... [EOS]."""
    tokenizer = Tokenizer(models.WordLevel(unk_token=UNK))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=[PAD, UNK, BOS, EOS])
    tokenizer.train_from_iterator(captions, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A {EOS}",
        special_tokens=[(t, tokenizer.token_to_id(t)) for t in (BOS, EOS)],
    )
    tokenizer.enable_padding(pad_id=PAD_ID, pad_token=PAD)
    return tokenizer


def shared_tokenizer(accelerator: Accelerator, captions: list[str]) -> Tokenizer:
    """Trained once on the main process and sent to the others: word ids must agree everywhere,
    and the trainer's order for words of equal frequency is not guaranteed to."""
    payload = [train_tokenizer(captions).to_str() if accelerator.is_main_process else None]
    return Tokenizer.from_str(broadcast_object_list(payload)[0])


def prepare_split(
    folder: Path, records: list[tuple[str, str]], tokenizer: Tokenizer, size: int, max_tokens: int
) -> tuple[datasets.Dataset, float, bool]:
    """Decode, resize and tokenize once; cached as Arrow by `datasets`, keyed by the files (name,
    size, mtime), captions, tokenizer and sizes. Returns (dataset, seconds, was it cached)."""
    stats = [(name, text, *_stat(folder / name)) for name, text in records]
    key = cache_key(str(folder.resolve()), stats, tokenizer.to_str(), size, max_tokens)
    cache = cache_root() / f"captioning-{key}.arrow"
    cached = cache.is_file()
    cache.parent.mkdir(parents=True, exist_ok=True)

    def encode(batch: dict[str, list]) -> dict[str, list]:
        ids = _unpadded([e.ids for e in tokenizer.encode_batch(batch["text"])])
        for name, tokens in zip(batch["file_name"], ids, strict=True):
            if len(tokens) > max_tokens:
                raise DataError(
                    f"{folder / name}: its caption has {len(tokens)} tokens with [BOS]/[EOS], "
                    f"more than --max-tokens {max_tokens}; raise it"
                )
        pixels = [read_rgb(folder / name, size) for name in batch["file_name"]]
        return {"pixels": pixels, "tokens": ids}

    features = datasets.Features(
        {
            "pixels": datasets.Array3D((3, size, size), "uint8"),
            "tokens": datasets.Sequence(datasets.Value("int32")),
        }
    )
    start = time.perf_counter()
    table = datasets.Dataset.from_dict(
        {"file_name": [n for n, _ in records], "text": [t for _, t in records]}
    )
    prepared = table.map(
        encode,
        batched=True,
        remove_columns=["file_name", "text"],
        features=features,
        cache_file_name=str(cache),
        new_fingerprint=key,
        desc=f"decode, resize, tokenize {folder.name}",
    )
    return prepared.with_format("torch"), time.perf_counter() - start, cached


def _stat(path: Path) -> tuple[int, int]:
    info = path.stat()
    return info.st_size, info.st_mtime_ns


def _unpadded(ids: list[list[int]]) -> list[list[int]]:
    """encode_batch pads to the longest caption; the collate function pads per batch instead."""
    return [[t for t in seq if t != PAD_ID] for seq in ids]


def collate(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    pixels = to_signed_unit(torch.stack([r["pixels"] for r in rows]))
    tokens = nn.utils.rnn.pad_sequence(
        [r["tokens"].long() for r in rows], batch_first=True, padding_value=PAD_ID
    )
    return {"pixels": pixels, "tokens": tokens}


# --------------------------------------------------------------------------- WORKLOAD: model


class Attention(nn.Module):
    """Multi-head attention through `scaled_dot_product_attention` (fused kernels where there
    are some); self-attention when `context` is None."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.query, self.value, self.out = (nn.Linear(dim, dim) for _ in range(3))
        # no key bias: it adds the same q.b to every score of a query, which softmax ignores, so
        # its gradient is only float noise, which Adam would scale up into real updates
        self.key = nn.Linear(dim, dim, bias=False)

    def forward(
        self, x: torch.Tensor, context: torch.Tensor | None = None, causal: bool = False
    ) -> torch.Tensor:
        context = x if context is None else context
        (b, t, d), h = x.shape, self.heads
        q, k, v = (
            proj(inp).view(b, -1, h, d // h).transpose(1, 2)
            for proj, inp in ((self.query, x), (self.key, context), (self.value, context))
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Pre-norm transformer block; with `cross`, it also attends to the image."""

    def __init__(self, dim: int, heads: int, cross: bool = False) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim) if cross else None
        self.cross = Attention(dim, heads) if cross else None
        self.norm3 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, image: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), causal=self.cross is not None)
        if self.cross is not None:
            x = x + self.cross(self.norm2(x), context=image)
        return x + self.mlp(self.norm3(x))


class Captioner(nn.Module):
    def __init__(
        self,
        vocab_size: int,
        image_size: int,
        patch: int,
        dim: int,
        depth: int,
        decoder_depth: int,
        heads: int,
        max_tokens: int,
    ) -> None:
        super().__init__()
        self.patches = nn.Conv2d(3, dim, kernel_size=patch, stride=patch)
        self.image_position = nn.Parameter(torch.randn(1, (image_size // patch) ** 2, dim) * 0.02)
        self.encoder = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.embed = nn.Embedding(vocab_size, dim)
        self.text_position = nn.Parameter(torch.randn(1, max_tokens, dim) * 0.02)
        self.decoder = nn.ModuleList(Block(dim, heads, cross=True) for _ in range(decoder_depth))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab_size)

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patches(pixels).flatten(2).transpose(1, 2) + self.image_position
        for block in self.encoder:
            x = block(x)
        return x

    def decode(self, image: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.text_position[:, : tokens.shape[1]]
        for block in self.decoder:
            x = block(x, image)
        return self.head(self.norm(x))

    def forward(self, pixels: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token logits for every position of `tokens` (teacher forcing)."""
        return self.decode(self.encode(pixels), tokens)


@torch.no_grad()
def greedy_captions(
    model: Captioner, pixels: torch.Tensor, bos: int, eos: int, max_tokens: int
) -> torch.Tensor:
    """Token ids from [BOS] on, the most likely token each step, padded after [EOS]."""
    image = model.encode(pixels)
    tokens = torch.full((len(pixels), 1), bos, dtype=torch.long, device=pixels.device)
    finished = torch.zeros(len(pixels), dtype=torch.bool, device=pixels.device)
    for _ in range(max_tokens - 1):
        following = model.decode(image, tokens)[:, -1].argmax(dim=-1)
        following = following.masked_fill(finished, PAD_ID)
        tokens = torch.cat([tokens, following[:, None]], dim=1)
        finished |= following == eos
        if finished.all():
            break
    return tokens


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
    accelerator: Accelerator, model: nn.Module, loader: DataLoader, majority: int, config: dict
) -> dict[str, float]:
    """Token accuracy and per-token cross-entropy on held-out images, against the majority-token
    (always the most frequent training token) and uniform baselines, and the share of images
    whose greedy caption is exactly right. Sums are gathered per image, so each counts once."""
    model.eval()
    plain = accelerator.unwrap_model(model)
    rows = []
    for batch in loader:
        pixels, tokens = batch["pixels"], batch["tokens"]
        logits = model(pixels, tokens)[:, :-1].float()
        labels = tokens[:, 1:]
        real = labels != PAD_ID
        nll = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none") * real
        correct = (logits.argmax(-1) == labels) & real
        generated = greedy_captions(plain, pixels, config["bos"], config["eos"], tokens.shape[1])
        generated = F.pad(generated, (0, tokens.shape[1] - generated.shape[1]), value=PAD_ID)
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
        "baseline_uniform_cross_entropy": math.log(config["vocab_size"]),
        "exact_caption_share": exact / len(rows),
        "n": len(rows),
    }


# --------------------------------------------------------------------------- training


@train_options(
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
def train(
    args: TrainArgs,
    image_size: int = typer.Option(32, min=8, help="Images are resized to this square (224)."),
    patch: int = typer.Option(8, min=1, help="Patch size of the encoder (original-style: 16)."),
    dim: int = typer.Option(64, min=8, help="Width of encoder and decoder (512)."),
    depth: int = typer.Option(2, min=1, help="Encoder blocks (6)."),
    decoder_depth: int = typer.Option(2, min=1, help="Decoder blocks (6)."),
    heads: int = typer.Option(4, min=1, help="Attention heads; must divide --dim."),
    max_tokens: int = typer.Option(24, min=3, help="Longest caption in tokens, with BOS/EOS."),
    init_scale: float = typer.Option(2.0**15, help="fp16: initial loss scale (dynamic)."),
    growth_interval: int = typer.Option(100, min=1, help="fp16: steps before the scale grows."),
) -> dict[str, float]:
    """Train the image captioner (ViT encoder, causal decoder) on captioned images."""
    if dim % heads or image_size % patch:
        raise ConfigError("--heads must divide --dim and --patch must divide --image-size")
    scaler = GradScalerKwargs(init_scale=init_scale, growth_interval=growth_interval)
    accelerator, plan = args.make_accelerator(kwargs_handlers=[scaler])
    data_dir = resolve_data(accelerator, RECIPE, args.data, caption_data.write_dataset)
    train_folder, train_records = caption_data.read_split(data_dir, "train")
    test_folder, test_records = caption_data.read_split(data_dir, "test")
    tokenizer = shared_tokenizer(accelerator, [text for _, text in train_records])
    with accelerator.main_process_first():  # the main process decodes; the others read its cache
        train_set, seconds, cached = prepare_split(
            train_folder, train_records, tokenizer, image_size, max_tokens
        )
        test_set, *_ = prepare_split(test_folder, test_records, tokenizer, image_size, max_tokens)
    how = "read from the cache" if cached else "decoded and cached"
    accelerator.print(f"{len(train_set)} training images {how} in {seconds:.2f}s")
    counts = np.bincount(np.concatenate([t[1:].numpy() for t in train_set["tokens"]]))
    majority = int(counts.argmax())

    vocab_size = tokenizer.get_vocab_size()
    sizes = {"image_size": image_size, "patch": patch, "dim": dim, "depth": depth}
    sizes |= {"decoder_depth": decoder_depth, "heads": heads, "max_tokens": max_tokens}
    model = Captioner(vocab_size, **sizes)
    # Adam with L2 weight decay, as the original (not AdamW's decoupled decay)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    train_loader = args.make_train_loader(train_set, plan, collate_fn=collate)
    test_loader = DataLoader(test_set, batch_size=plan.per_device_batch_size, collate_fn=collate)
    model, optimizer, train_loader, test_loader = accelerator.prepare(
        model, optimizer, train_loader, test_loader
    )
    schedule = args.make_lr_schedule(accelerator, optimizer, plan, len(train_loader))
    ids = {t.lower()[1:-1]: tokenizer.token_to_id(t) for t in (BOS, EOS)}
    config = {"vocab_size": vocab_size, **sizes, **ids, "init_scale": init_scale}
    config |= {"growth_interval": growth_interval}
    loop = args.make_loop(accelerator, plan, train_loader, schedule, recipe=RECIPE, config=config)
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
            loop.record(summed.detach() / n_tokens)
        loop.end_epoch(evaluate(accelerator, model, test_loader, majority, config))
    metrics = loop.finish(model)
    if accelerator.is_main_process:
        tokenizer.save(str(args.output_dir / "model" / "tokenizer.json"))
    return metrics


# --------------------------------------------------------------------------- single-device use


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
    if max_tokens is not None and max_tokens > config["max_tokens"]:
        raise ConfigError(
            f"--max-tokens {max_tokens}: the model was trained for at most "
            f"{config['max_tokens']} tokens (its position table ends there)"
        )
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    keys = ("image_size", "patch", "dim", "depth", "decoder_depth", "heads", "max_tokens")
    model = Captioner(config["vocab_size"], **{k: config[k] for k in keys})
    device = load_for_inference(model_dir, model)
    longest = max_tokens or config["max_tokens"]
    lines = []
    for names, pixels in image_batches(images, list_images(images), config["image_size"], bs):
        ids = greedy_captions(model, pixels.to(device), config["bos"], config["eos"], longest)
        for name, row in zip(names, ids.tolist(), strict=True):
            lines.append(f"{name}\t{tokenizer.decode(row, skip_special_tokens=True)}\n")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(lines))
    print(f"wrote {out}: {len(lines)} captions")


if __name__ == "__main__":
    run_recipe(train, caption=caption)
