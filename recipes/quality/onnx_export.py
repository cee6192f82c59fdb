"""quality's `export-onnx`: the scorer alone (no annotator reliabilities) as an ONNX file that
loads where it will be served, as the original's export.py writes it."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from accel_common import ConfigError, new_file
from recipes.quality.model import QualityScorer

# the opsets torch.onnx's TorchScript exporter (dynamo=False) supports, ONNX_MIN_OPSET to
# ONNX_TORCHSCRIPT_EXPORTER_MAX_OPSET (torch.onnx._constants). Below them it still writes a file:
# at opset 5 and 6 one onnxruntime refuses to load (measured; 7 to 21 load and score as PyTorch)
ONNX_OPSETS = (7, 20)


def require_onnx() -> None:
    """torch.onnx.export writes through the onnx package: refuse before any work without it."""
    try:
        import onnx  # noqa: F401
    except ImportError:
        raise ConfigError("export-onnx needs onnx: pip install 'accel-recipes[onnx]'") from None


def write_onnx(model: QualityScorer, size: int, out: Path, opset: int) -> None:
    """`model`'s scorer as ONNX at `opset` (input `image` N x 3 x size x size, output `score`
    N x 1, dynamic batch), checked to load (`check_onnx`)."""
    with new_file(out) as partial:  # never over a file another process wrote meanwhile
        torch.onnx.export(
            OnnxScorer(model).cpu().eval(),
            (torch.zeros(1, 3, size, size),),
            str(partial),
            input_names=["image"],
            output_names=["score"],
            dynamic_axes={"image": {0: "batch"}, "score": {0: "batch"}},
            opset_version=opset,
            dynamo=False,
        )
        check_onnx(partial, out)


def check_onnx(path: Path, named: Path) -> None:
    """Load the written file once, as serving would (onnxruntime where installed, else onnx's
    checker): one that cannot be loaded is removed and refused (naming `named`, the --out it
    was written for), never reported as written."""
    try:
        try:
            import onnxruntime
        except ImportError:
            import onnx

            onnx.checker.check_model(str(path), full_check=True)
        else:
            onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    except Exception as err:  # any failure to load is the refusal
        path.unlink(missing_ok=True)
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"--out {named}: the ONNX file written does not load ({first})") from None


class OnnxScorer(nn.Module):
    """The original's QualityScorer alone (no reliabilities), its output N x 1 as the original's."""

    def __init__(self, model: QualityScorer) -> None:
        super().__init__()
        self.backbone, self.head = model.backbone, model.head

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(image))
