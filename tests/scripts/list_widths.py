"""A recipe with a list setting, for tests/recipe_cli/test_list_settings.py: the template's data
and loss with an MLP whose hidden layers' widths are one flag (`--widths 16,8`), as a ported
UNet's channel widths are. Its export's config records the list, and `--resume` compares it.

    python tests/scripts/list_widths.py --data DIR --output-dir OUT --widths 16,8 --max-steps 2
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from accel_common import Settings, SharedSettings, run_recipe, setting, train_command
from accel_common.data import named_files, resolve_data
from recipes.train_template import evaluate, load_split, write_dataset

RECIPE = "list_widths"


@dataclass
class WidthsSettings(Settings):
    widths: tuple[int, ...] = setting(
        (16, 8), "Width of each hidden layer, first to last ('' for none: linear).", min=1
    )


def build_model(args: SharedSettings, settings: WidthsSettings, features: int = 8) -> nn.Module:
    layers: list[nn.Module] = []
    for width in settings.widths:
        layers += [nn.Linear(features, width), nn.SiLU()]
        features = width
    return nn.Sequential(*layers, nn.Linear(features, 1))


@train_command(
    WidthsSettings,
    build_model=build_model,
    default_bs=32,
    lr=3e-3,
    ref_bs=32,
    epochs=1,
    output_dir=Path("runs/list_widths"),
)
def train(args: SharedSettings, settings: WidthsSettings) -> dict[str, float]:
    """Train an MLP of the given widths on the template's CSV data."""
    accelerator, plan = args.make_accelerator()
    data_dir = resolve_data(accelerator, RECIPE, args.data, write_dataset)
    train_set = load_split(data_dir, "train")
    test_set = load_split(data_dir, "test", columns=train_set.columns)
    train_mean = train_set.tensors[1].mean().item()
    model = build_model(args, settings, train_set.tensors[0].shape[1])
    optimizer = args.make_optimizer(torch.optim.AdamW, model.parameters(), lr=args.lr)
    train_loader = args.make_train_loader(train_set, plan)
    test_loader = DataLoader(test_set, batch_size=plan.per_device_batch_size * 4)
    model, optimizer, train_loader, test_loader = accelerator.prepare(
        model, optimizer, train_loader, test_loader
    )
    schedule = args.make_lr_schedule(accelerator, optimizer, plan, len(train_loader))
    data_files = named_files([data_dir / "train.csv", data_dir / "test.csv"], data_dir)
    loop = args.make_loop(
        accelerator, plan, train_loader, schedule,
        recipe=RECIPE, data_files=data_files, settings=settings,
    )  # fmt: skip
    for _epoch in loop.epochs():
        for x, y in loop.batches():
            with accelerator.accumulate(model):
                loss = F.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            loop.record(loss)
        loop.end_epoch(evaluate(accelerator, model, test_loader, train_mean))
    return loop.finish(model)


if __name__ == "__main__":
    run_recipe(train)
