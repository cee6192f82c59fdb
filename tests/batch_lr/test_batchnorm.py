"""--sync-batchnorm: BatchNorm over the global batch on any backend
(accel_common.batch_lr.batchnorm)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from accel_common.batch_lr.batchnorm import GlobalBatchNorm, sync_batchnorm
from accel_common.recipe_cli.options import SharedSettings

SHAPES = {nn.BatchNorm1d: (8, 3), nn.BatchNorm2d: (8, 3, 5, 4), nn.BatchNorm3d: (4, 3, 2, 3, 4)}


@pytest.mark.parametrize("kind", list(SHAPES), ids=lambda k: k.__name__)
def test_one_process_normalises_as_torchs_batchnorm(kind):
    """In one process GlobalBatchNorm is torch's BatchNorm of any dimension (float32 rounding
    apart): outputs, input gradients, running statistics, and evaluation."""
    torch.manual_seed(0)
    plain = kind(3)
    converted = sync_batchnorm(nn.Sequential(kind(3)), torch.device("cpu"))[0]
    converted.load_state_dict(plain.state_dict())
    assert isinstance(converted, GlobalBatchNorm)
    x = torch.randn(*SHAPES[kind]) * 3 + 1
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_a, out_b = plain(a), converted(b)
    (out_a * torch.arange(out_a.numel()).view_as(out_a)).sum().backward()
    (out_b * torch.arange(out_b.numel()).view_as(out_b)).sum().backward()
    torch.testing.assert_close(out_b, out_a, rtol=0, atol=1e-6)
    torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-5)
    for name, buffer in plain.named_buffers():
        torch.testing.assert_close(dict(converted.named_buffers())[name], buffer, atol=1e-6, rtol=0)
    plain.eval(), converted.eval()
    torch.testing.assert_close(converted(x), plain(x))


def test_the_flag_converts_plain_batchnorms_and_leaves_a_recipes_own():
    class Own(nn.BatchNorm1d):
        """A recipe's own BatchNorm (crystal's syncs itself): not replaced."""

    model = nn.Sequential(nn.Conv2d(1, 2, 1), nn.BatchNorm2d(2), nn.Sequential(Own(2)))
    args = SharedSettings(sync_batchnorm=True)
    args.adapt_model(model)
    assert isinstance(model[1], GlobalBatchNorm) and type(model[2][0]) is Own
    untouched = nn.Sequential(nn.BatchNorm2d(2))
    SharedSettings().adapt_model(untouched)
    assert type(untouched[0]) is nn.BatchNorm2d
