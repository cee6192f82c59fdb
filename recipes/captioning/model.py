"""The captioning recipe's network: a ViT-style encoder (the image cut into patches, then
self-attention blocks) and a causal transformer decoder with cross-attention to the image, which
writes the caption one token at a time; `greedy_captions` decodes with it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from recipes.captioning.tokenizer import PAD_ID


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
    model: Captioner,
    pixels: torch.Tensor,
    bos: int,
    eos: int,
    max_tokens: int,
    stop_when_done: bool = True,
) -> torch.Tensor:
    """Token ids from [BOS] on, the most likely token each step, padded after [EOS].
    `stop_when_done=False` decodes all `max_tokens` (more padding, the same captions), for
    models whose every forward is a collective (accel_common.forward_is_collective)."""
    image = model.encode(pixels)
    tokens = torch.full((len(pixels), 1), bos, dtype=torch.long, device=pixels.device)
    finished = torch.zeros(len(pixels), dtype=torch.bool, device=pixels.device)
    for _ in range(max_tokens - 1):
        following = model.decode(image, tokens)[:, -1].argmax(dim=-1)
        following = following.masked_fill(finished, PAD_ID)
        tokens = torch.cat([tokens, following[:, None]], dim=1)
        finished |= following == eos
        if stop_when_done and finished.all():
            break
    return tokens
