"""Pointcloud's point ops and PVCNN2 training step on the CPU: this tree's `ops.py` against
another tree's (`--baseline-src`, e.g. a `git worktree` of an older commit), to check that a
change to the ops' dispatch keeps the CPU path no slower (issue 42).

Both ops modules are loaded into one process (the baseline's as a file, so an `import` in it
resolves to this tree) and swapped under this tree's model.py, which must be the baseline's too.
Each round times A (baseline), B (this tree) and A again (A'), in a rotated order, a few calls
each, so that drift of a shared machine hits all alike (on a 2-core machine shared with others,
steps were bimodal, 330 or 540 ms, in blocks of seconds). The model is the recipe's CPU default
(PVCNN2 x0.25, 16/8/4 voxels, 512 points, batch 8, train_pointcloud.py's settings); a step is
forward + backward. Printed per measure: the median over rounds and its spread (min..max), B/A
and A'/A of the medians, and the median of the per-round ratios B/A [A'/A]: a B/A means
something only outside the A/A's distance from 1.

    OMP_NUM_THREADS=1 python benchmarks/bench_pointcloud_ops_cpu.py --baseline-src /tmp/base
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from recipes.pointcloud import model as model_module  # noqa: E402
from recipes.pointcloud import ops as this_ops  # noqa: E402

BATCH, POINTS, NUM_NN = 8, 512, 64


def _median_us(fn, repeats: int) -> float:
    """Median microseconds of one call of fn over `repeats` calls."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def load_baseline(src: Path) -> ModuleType:
    """The baseline's ops.py as a module; its model.py must be this tree's (only ops differ)."""
    ops_file, model_file = src / "recipes/pointcloud/ops.py", src / "recipes/pointcloud/model.py"
    if not ops_file.is_file():
        raise SystemExit(f"--baseline-src {src}: no recipes/pointcloud/ops.py there")
    if model_file.read_text() != Path(model_module.__file__).read_text():
        raise SystemExit(f"--baseline-src {src}: its model.py differs; only ops.py may differ")
    spec = importlib.util.spec_from_file_location("baseline_pointcloud_ops", ops_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measurements(steps: int, op_repeats: int):
    """Functions name -> (ops module -> median time): the step (ms) and each op's call (us)."""
    torch.manual_seed(0)
    model = model_module.PVCNN2(
        num_classes=3, num_points=POINTS, embed_dim=32, use_att=True, dropout=0.0,
        head_dropout=0.0, width_multiplier=0.25, voxel_resolution_multiplier=0.5,
        radius_multiplier=4.0, num_neighbors=32,
    )  # fmt: skip
    skull = torch.rand(BATCH, POINTS - NUM_NN, 3) * 2 - 1
    noisy, noise = torch.randn(BATCH, NUM_NN, 3), torch.randn(BATCH, NUM_NN, 3)
    t = torch.randint(0, 100, (BATCH,))

    def step() -> None:
        model.zero_grad(set_to_none=True)
        pred = model_module.predict_noise(model, skull, noisy, t)
        torch.nn.functional.mse_loss(pred, noise).backward()

    # the ops at the sizes of the model's first stage (512 points -> 170 centres, 32 neighbours)
    ops = this_ops
    coords = torch.rand(BATCH, 3, POINTS) * 2 - 1
    feats = torch.randn(BATCH, 32, POINTS, requires_grad=True)
    centers = ops.gather(coords, ops.furthest_point_sample(coords, POINTS // 3))
    index = ops.ball_query(centers, coords, 0.4, 32)
    nn_index, nn_weights = ops.three_nearest_neighbors(coords, centers)
    center_feats = torch.randn(BATCH, 32, POINTS // 3, requires_grad=True)
    grid_coords = ops.normalize_voxel_coords(coords, 8, False, 0.0)
    grid = torch.randn(BATCH, 32, 8, 8, 8, requires_grad=True)
    calls = {
        "furthest_point_sample": lambda o: o.furthest_point_sample(coords, POINTS // 3),
        "ball_query": lambda o: o.ball_query(centers, coords, 0.4, 32),
        "grouping": lambda o: o.grouping(feats, index),
        "grouping fwd+bwd": lambda o: o.grouping(feats, index).sum().backward(),
        "three_nearest_neighbors": lambda o: o.three_nearest_neighbors(coords, centers),
        "interpolate": lambda o: o.interpolate(center_feats, nn_index, nn_weights),
        "interpolate fwd+bwd": lambda o: (
            o.interpolate(center_feats, nn_index, nn_weights).sum().backward()
        ),
        "avg_voxelize": lambda o: o.avg_voxelize(feats, grid_coords, 8),
        "avg_voxelize fwd+bwd": lambda o: o.avg_voxelize(feats, grid_coords, 8).sum().backward(),
        "trilinear_devoxelize": lambda o: o.trilinear_devoxelize(grid, grid_coords, 8),
        "trilinear_devoxelize fwd+bwd": lambda o: (
            o.trilinear_devoxelize(grid, grid_coords, 8).sum().backward()
        ),
    }

    def timed_step(o: ModuleType) -> float:
        model_module.ops = o
        try:
            return _median_us(step, steps) / 1e3
        finally:
            model_module.ops = this_ops

    measures = {"train step fwd+bwd (ms)": timed_step}
    for name, call in calls.items():
        measures[f"{name} (us)"] = lambda o, call=call: _median_us(lambda: call(o), op_repeats)
    return measures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline-src", type=Path, required=True, help="baseline repo root (A)")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--steps", type=int, default=1, help="timed steps per variant and round")
    parser.add_argument("--op-repeats", type=int, default=5, help="timed calls per op and round")
    args = parser.parse_args()
    variants = {"A": load_baseline(args.baseline_src), "B": this_ops, "A'": None}
    variants["A'"] = variants["A"]
    measures = measurements(args.steps, args.op_repeats)
    for measure in measures.values():  # warm-up round, not counted
        measure(variants["A"]), measure(variants["B"])
    times = {name: {v: [] for v in variants} for name in measures}
    for r in range(args.rounds):
        order = list(variants)[r % 3 :] + list(variants)[: r % 3]  # rotated: A B A', B A' A, ...
        for name, measure in measures.items():
            for variant in order:
                times[name][variant].append(measure(variants[variant]))
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    print(f"{'measure':31} {'A median (min..max)':>26} {'B median (min..max)':>26} "
          f"{'B/A':>6} {'A/A':>6} {'paired B/A [A/A]':>18}")  # fmt: skip
    for name, by_variant in times.items():
        av, bv, a2v = (by_variant[v] for v in variants)
        a, b, a2 = (statistics.median(x) for x in (av, bv, a2v))
        paired = statistics.median(y / x for x, y in zip(av, bv, strict=True))
        paired_aa = statistics.median(y / x for x, y in zip(av, a2v, strict=True))
        print(
            f"{name:31} {a:8.1f} ({min(av):7.1f}..{max(av):7.1f}) "
            f"{b:8.1f} ({min(bv):7.1f}..{max(bv):7.1f}) {b / a:6.3f} {a2 / a:6.3f} "
            f"{paired:8.3f} [{paired_aa:.3f}]"
        )


if __name__ == "__main__":
    main()
