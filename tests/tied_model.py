"""A tiny GPT whose output head is its input embedding (`lm_head.weight = wte.weight`, as in
nanoGPT and many vision-language and seq2seq models): the shape the checkpoint, convert, export
and FSDP tests of tied parameters train (tests/scripts/tied_gpt.py)."""

from __future__ import annotations

import torch
from torch import nn

VOCAB, WIDTH, CONTEXT = 64, 32, 8


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class TiedGPT(nn.Module):
    """Embedding, blocks in a ModuleList inside a ModuleDict (nanoGPT's layout), tied head."""

    def __init__(self, vocab: int = VOCAB, width: int = WIDTH, depth: int = 2) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(vocab, width),
                "wpe": nn.Embedding(CONTEXT, width),
                "h": nn.ModuleList(Block(width) for _ in range(depth)),
                "ln_f": nn.LayerNorm(width),
            }
        )
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.transformer["wte"].weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.transformer["wte"](tokens) + self.transformer["wpe"].weight[: tokens.shape[1]]
        for block in self.transformer["h"]:
            x = block(x)
        return self.lm_head(self.transformer["ln_f"](x))
