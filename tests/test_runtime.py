import torch
from torch import nn

from accel_common.runtime import grad_norm


def test_grad_norm_never_clips_a_partial_accumulation(accelerator):
    model = accelerator.prepare(nn.Linear(3, 1))
    x = torch.ones(4, 3)
    with accelerator.accumulate(model):  # first of 2 micro-batches: no optimizer step follows
        accelerator.backward(model(x).pow(2).mean() * 100)
        partial = [p.grad.clone() for p in model.parameters()]
        assert not accelerator.sync_gradients
        assert grad_norm(accelerator, model, clip=0.1, measure=True) is None
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), partial, strict=True))
    with accelerator.accumulate(model):  # second: the window closes, clipping applies
        accelerator.backward(model(x).pow(2).mean() * 100)
        norm = grad_norm(accelerator, model, clip=0.1, measure=False)
    assert norm is not None and norm > 0.1
    clipped = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
    assert clipped.item() <= 0.1 + 1e-6


def test_grad_norm_is_skipped_when_not_logged_or_clipped(accelerator):
    model = accelerator.prepare(nn.Linear(3, 1))
    for _ in range(2):
        with accelerator.accumulate(model):
            accelerator.backward(model(torch.ones(2, 3)).sum())
    assert accelerator.sync_gradients
    assert grad_norm(accelerator, model, clip=0.0, measure=False) is None
    assert grad_norm(accelerator, model, clip=0.0, measure=True) > 0
