"""The Crowd-BT scorer: a timm backbone and an MLP head giving one quality score per image, and
one reliability logit per annotator, learned with the network."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from accel_common.checkpoint import read_state_dict
from accel_common.errors import ConfigError


class QualityScorer(nn.Module):
    """timm backbone -> MLP head (F -> 512 -> 256 -> 1) -> score; plus one logit per annotator."""

    def __init__(
        self, backbone: str, num_annotators: int, dropout: float, pretrained: bool = False
    ) -> None:
        super().__init__()
        # imported here, as scipy in the recipe's evaluation: timm (torchvision behind it) takes
        # ~6 s to import, and a run with bad data or flags is refused before any model is built
        import timm

        self.backbone = timm.create_model(backbone, pretrained=pretrained, num_classes=0)
        self.head = nn.Sequential(
            nn.Linear(self.backbone.num_features, 512),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(512, 256),
            nn.ReLU(),
            nn.Dropout(dropout),
            # no bias: the loss sees only score differences, so a bias would get no gradient but
            # float noise, which Adam turns into a random walk
            nn.Linear(256, 1, bias=False),
        )
        # start every annotator at eta = 0.8: "mostly right" breaks the symmetry between a
        # reliable crowd and a reversed one with reversed scores
        self.annotator_logits = nn.Parameter(torch.full((num_annotators,), math.log(4.0)))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(images)).squeeze(1)


def build_scorer(
    backbone: str, num_annotators: int, dropout: float, pretrained: bool, weights: Path | None
) -> QualityScorer:
    """The scorer, with a clear error when pretrained weights cannot be had."""
    try:
        model = QualityScorer(backbone, num_annotators, dropout, pretrained=pretrained)
    except RuntimeError as err:  # timm: unknown model
        raise ConfigError(f"--backbone {backbone}: {err}") from None
    except OSError as err:  # no network for the hub download
        raise ConfigError(
            f"--pretrained: could not fetch {backbone}'s weights ({err}); without network access "
            "pass --weights FILE with a local copy, or drop --pretrained"
        ) from None
    if weights is not None:
        state = read_state_dict(weights)
        _, unexpected = model.backbone.load_state_dict(state, strict=False)
        if unexpected:
            raise ConfigError(f"--weights {weights}: keys that {backbone} lacks: {unexpected[:5]}")
    return model
