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


def test_an_optimizer_built_before_the_conversion_trains_the_converted_layers():
    """The template builds its optimizer, then calls `adapt_model` (--sync-batchnorm): the
    converted layer must hold the optimizer's parameter objects (and the same buffers, and its
    mode), or its weight and bias get gradients that no optimizer applies and stay 1 and 0 (the
    ResNet port of issue 57 trained every BatchNorm so; torch's convert_sync_batchnorm keeps
    them, so only gloo runs were hit)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.BatchNorm1d(2).eval())
    original, frozen = model[1], model[2]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sync_batchnorm(model, torch.device("cpu"))
    converted = model[1]
    assert isinstance(converted, GlobalBatchNorm) and converted is not original
    assert converted.weight is original.weight and converted.bias is original.bias
    assert converted.running_mean is original.running_mean
    assert not model[2].training and model[2] is not frozen
    out = model[:2](torch.randn(4, 2, 5, 5))
    (out * torch.arange(out.numel()).view_as(out)).sum().backward()
    optimizer.step()
    assert not torch.equal(converted.weight, torch.ones(3))
    assert not torch.equal(converted.bias, torch.zeros(3))
