"""The Crowd-BT quality recipe's model: the head's width, a pair's forward in one call or two."""

from __future__ import annotations

import pytest
import torch

import recipes.train_quality as recipe


@pytest.mark.parametrize("backbone", ["mobilenetv3_small_100", "efficientnet_b0"])
def test_the_head_takes_the_width_the_backbone_returns(backbone):
    """mobilenetv3's conv_head widens its 576 pooled features (timm's num_features) to 1024
    (head_hidden_size): a head sized by num_features crashed at the first batch ('mat1 and mat2
    shapes cannot be multiplied'). Every backbone's output fits its head, and the scorer runs."""
    model = recipe.QualityScorer(backbone, num_annotators=2, dropout=0.0).eval()
    images = torch.zeros(2, 3, 32, 32)
    with torch.no_grad():
        assert model.backbone(images).shape == (2, model.head[0].in_features)
        assert model(images).shape == (2,)


def test_a_pair_scored_separately_is_the_originals_two_forwards_in_one_call():
    """Issue 49: the original scores model(img1), then model(img2) (train.py 107-108), so each
    BatchNorm normalises with one side's statistics and updates its running statistics twice.
    `parts=2` does the same inside one call of the module (what DDP and torch.compile see):
    scores, running statistics and gradients bit-equal to two calls; `parts=1` (joint) is not."""
    torch.manual_seed(0)
    model = recipe.QualityScorer("resnet10t", num_annotators=2, dropout=0.0).train()
    twice = recipe.QualityScorer("resnet10t", num_annotators=2, dropout=0.0).train()
    twice.load_state_dict(model.state_dict())
    image_i, image_j = torch.randn(4, 3, 32, 32), torch.randn(4, 3, 32, 32) + 1.0

    one_call = model(torch.cat([image_i, image_j]), 2)
    two_calls = torch.cat([twice(image_i), twice(image_j)])
    assert torch.equal(one_call, two_calls)
    (one_call[:4] - one_call[4:]).sum().backward()
    (two_calls[:4] - two_calls[4:]).sum().backward()
    for (name, a), b in zip(model.named_parameters(), twice.parameters(), strict=True):
        assert (a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad), name
    for (name, a), b in zip(model.named_buffers(), twice.buffers(), strict=True):
        assert torch.equal(a, b), name

    joint = recipe.QualityScorer("resnet10t", num_annotators=2, dropout=0.0).train()
    joint.load_state_dict(twice.state_dict())
    assert not torch.equal(joint(torch.cat([image_i, image_j])), two_calls)


def test_the_pair_forward_benchmark_runs_and_writes_its_section(tmp_path):
    """`make bench`'s joint-vs-separate timing, at the smoke size: it runs, writes its section."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "BENCHMARKS.md"
    script = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_quality_pairs.py"
    done = subprocess.run(
        [sys.executable, str(script), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(
        r"`separate` \(the original's two passes; its preset\) \| [\d.]+ \| [\d.]+", out.read_text()
    )
