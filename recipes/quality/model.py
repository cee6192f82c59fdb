"""The Crowd-BT scorer, the original's network layer for layer (hituldesai03/crowd-bt model.py,
backbones.py): a timm backbone (num_classes=0) inside a wrapper, so the state-dict keys read
`backbone.backbone.*` as in the original's checkpoints, and the head F -> 512 -> 256 -> 1 with
ReLU, dropout and a bias on every layer (`head.0`, `head.3`, `head.6`). Beside the scorer, one
reliability logit per annotator, learned with it; the dry run counts them apart."""

from __future__ import annotations

import math
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from accel_common import MODEL_FILE, ConfigError, read_export_weights, read_state_dict

HIDDEN = 512  # model.py 28: hidden_dim; the second layer is hidden_dim // 2
RELIABILITY_KEY = "annotator_logits"


class Backbone(nn.Module):
    """The original's BackboneWrapper: the timm model under `.backbone`."""

    def __init__(self, name: str, pretrained: bool = False) -> None:
        super().__init__()
        # imported here, as scipy in the recipe's evaluation: timm (torchvision behind it) takes
        # ~6 s to import, and a run with bad data or flags is refused before any model is built
        import timm

        self.backbone = timm.create_model(name, pretrained=pretrained, num_classes=0)
        # the width of what forward() returns: timm's head_hidden_size (after the head's own
        # layers: mobilenetv3's conv_head makes 576 pooled features 1024), not num_features
        # (the pooled width); older timm has no head_hidden_size and no such head layers
        self.output_dim = getattr(self.backbone, "head_hidden_size", self.backbone.num_features)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.backbone(images)


class QualityScorer(nn.Module):
    """timm backbone -> MLP head (F -> 512 -> 256 -> 1, biases) -> score; plus one reliability
    logit per annotator (`annotator_logits`, not part of the original's scorer)."""

    # what --dry-run shows on its own line, apart from the scorer's parameter count
    COUNTED_APART: ClassVar[dict[str, str]] = {"annotator reliabilities": RELIABILITY_KEY}

    def __init__(
        self,
        backbone: str,
        num_annotators: int,
        dropout: float,
        pretrained: bool = False,
        head_init: str = "kaiming",
    ) -> None:
        super().__init__()
        self.backbone = Backbone(backbone, pretrained)
        self.head = nn.Sequential(
            nn.Linear(self.backbone.output_dim, HIDDEN),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(HIDDEN, HIDDEN // 2),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(HIDDEN // 2, 1),
        )
        for layer in self.head:  # model.py _init_head; "torch" keeps nn.Linear's own
            if head_init == "kaiming" and isinstance(layer, nn.Linear):
                nn.init.kaiming_normal_(layer.weight, mode="fan_out", nonlinearity="relu")
                nn.init.zeros_(layer.bias)
        # The last bias is kept (the original has it, its checkpoints carry it) but not trained:
        # the loss sees only score differences, so it gets no gradient but float noise, which
        # Adam would turn into a random walk.
        self.head[-1].bias.requires_grad_(False)
        # start every annotator at eta = 0.8: "mostly right" breaks the symmetry between a
        # reliable crowd and a reversed one with reversed scores
        self.annotator_logits = nn.Parameter(torch.full((num_annotators,), math.log(4.0)))

    def forward(self, images: torch.Tensor, parts: int = 1) -> torch.Tensor:
        """Scores of `images`, computed in `parts` equal chunks one after another (2: a pair's
        two sides as the original scores them, model(image_i) then model(image_j), so each
        BatchNorm normalises with one side's statistics and updates its running ones twice),
        inside one forward of the module: DDP, FSDP and torch.compile see one call per step."""
        return torch.cat(
            [self.head(self.backbone(part)).squeeze(1) for part in images.chunk(parts)]
        )

    def scorer_state_dict(self) -> dict[str, torch.Tensor]:
        """The original's QualityScorer keys only (backbone.backbone.*, head.*)."""
        return {k: v for k, v in self.state_dict().items() if k != RELIABILITY_KEY}


def is_timm_model(backbone: str) -> bool:
    """Whether timm builds `backbone`: checked before any data or weights are read, since timm's
    own error comes from deep in the network's construction (a hub name, `hf-hub:...`, is left
    to the download)."""
    from timm.models import is_model, parse_model_name  # imported late, as in BackboneWrapper

    source, name = parse_model_name(backbone)
    return source is not None or is_model(name)


def require_known_backbone(backbone: str) -> None:
    """--backbone names a model timm has, or the run (and its dry run) stops in one line."""
    if not is_timm_model(backbone):
        raise ConfigError(
            f"--backbone {backbone}: not a timm model name; give one that timm.list_models() "
            "lists, e.g. efficientnet_b3"
        )


def build_scorer(
    backbone: str,
    num_annotators: int,
    dropout: float,
    pretrained: bool,
    weights: Path | None,
    head_init: str = "kaiming",
) -> QualityScorer:
    """The scorer, with a clear error when pretrained weights cannot be had."""
    require_known_backbone(backbone)
    try:
        model = QualityScorer(backbone, num_annotators, dropout, pretrained, head_init)
    except RuntimeError as err:  # timm: unknown model
        raise ConfigError(f"--backbone {backbone}: {err}") from None
    except OSError as err:  # no network for the hub download
        raise ConfigError(
            f"--pretrained: could not fetch {backbone}'s weights ({err}); without network access "
            "pass --weights FILE with a local copy, or drop --pretrained"
        ) from None
    if weights is not None:
        state = read_state_dict(weights)
        _, unexpected = model.backbone.backbone.load_state_dict(state, strict=False)
        if unexpected:
            raise ConfigError(f"--weights {weights}: keys that {backbone} lacks: {unexpected[:5]}")
    return model


def start_from(model: QualityScorer, export: Path) -> None:
    """--init-from: the scorer's weights of an export (trained here, or converted from the
    original with `convert --from crowd-bt`), strictly; its reliabilities too where it has one
    per annotator of this run, else they start afresh."""
    path = export / MODEL_FILE if export.is_dir() else export
    if not path.is_file():
        raise ConfigError(f"--init-from {export}: no exported model at {path}")
    state = read_export_weights(path)  # a damaged file: one line naming it
    logits = state.get(RELIABILITY_KEY)
    if logits is None or logits.shape != model.annotator_logits.shape:
        state[RELIABILITY_KEY] = model.annotator_logits.detach().clone()
    try:
        model.load_state_dict(state)
    except RuntimeError as err:
        first = str(err).splitlines()[1:2] or [str(err)]
        raise ConfigError(f"--init-from {export}: not this scorer ({first[0].strip()})") from None
