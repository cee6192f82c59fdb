"""The point-cloud ops one by one, forward and backward, at the sizes PVCNN2 calls them with.

One forward pass of the recipe's network on the benchmark's batch records each op's arguments
(identical calls kept once, with their number). Each distinct call is then timed on the
recipe's Triton kernels (POINTCLOUD_KERNELS=triton), on its plain-PyTorch ops (=torch) and on
pcdiff's own CUDA kernels (PCDIFF_SRC), those this machine has; only ops.py's public functions
are called, so whichever kernels sit behind them are what is timed.

`three_nn_interpolate` is three_nearest_neighbors and one interpolate, once per interpolation,
as the original calls its fused kernel (features and temb apart; the recipe's network finds the
neighbours once for both). Farthest-point sampling and ball query have no backward."""

from __future__ import annotations

import inspect
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from accel_common.monitoring.throughput import synchronize
from benchmarks.gpu.steps import point_kernels
from benchmarks.original_sizes import Workload

OPS = ("furthest_point_sample", "ball_query", "grouping", "avg_voxelize", "trilinear_devoxelize",
       "three_nn_interpolate")  # fmt: skip
BACKENDS = ("torch", "triton", "pcdiff")
RECORDED = (*OPS[:-1], "three_nearest_neighbors", "interpolate")  # ops.py's names

Forward = Callable[[], tuple[torch.Tensor, Any]]  # -> (output, what the backward needs)
Backward = Callable[[Any, torch.Tensor], Any] | None


@dataclass
class Call:
    op: str
    args: tuple
    count: int = 1


def describe(args: tuple) -> str:
    """A call's sizes in a table cell: tensor shapes, then the scalars."""
    return ", ".join(
        "x".join(map(str, a.shape)) if isinstance(a, torch.Tensor) else f"{a:g}" for a in args
    )


def record_calls(model: torch.nn.Module, workload: Workload, device: torch.device) -> list[Call]:
    """One forward (no grad) of `model` on the workload's batch, with each point op's arguments
    kept: ops.py's functions are wrapped for the pass (calls from inside an op are not counted)."""
    from recipes.pointcloud import ops

    calls: dict[tuple, Call] = {}
    neighbours: list[torch.Tensor] = []  # the last three_nearest_neighbors' points and centres
    originals = {name: getattr(ops, name) for name in RECORDED}
    depth = [0]

    def add(op: str, args: tuple) -> None:
        key = (op, *(tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args))
        if key in calls:
            calls[key].count += 1
        else:
            calls[key] = Call(op, args)

    def wrap(name: str) -> Callable:
        function = originals[name]
        signature = inspect.signature(function)

        def recorded(*args: Any, **kwargs: Any) -> Any:
            if depth[0] == 0:
                bound = tuple(signature.bind(*args, **kwargs).arguments.values())
                if name == "three_nearest_neighbors":
                    neighbours[:] = bound[:2]
                elif name == "interpolate":
                    add("three_nn_interpolate", (*neighbours, bound[0]))
                else:
                    add(name, bound)
            depth[0] += 1
            try:
                return function(*args, **kwargs)
            finally:
                depth[0] -= 1

        return recorded

    batch = workload.batch(workload.per_gpu_batch, device)
    try:
        for name in RECORDED:
            setattr(ops, name, wrap(name))
        with torch.no_grad():
            workload.loss(model, batch)
    finally:
        for name, function in originals.items():
            setattr(ops, name, function)
    return list(calls.values())


def recipe_op(op: str, args: tuple) -> tuple[Forward, Backward]:
    """The call through ops.py's public functions; the backward is autograd's."""
    from recipes.pointcloud import ops

    if op in ("furthest_point_sample", "ball_query"):
        return (lambda: (getattr(ops, op)(*args), None)), None

    def forward() -> tuple[torch.Tensor, Any]:
        if op == "three_nn_interpolate":
            points, centers, features = args
            x = features.detach().requires_grad_()
            out = ops.interpolate(x, *ops.three_nearest_neighbors(points, centers))
        else:
            out = getattr(ops, op)(args[0].detach().requires_grad_(), *args[1:])
        return out, out

    return forward, lambda out, grad: out.backward(grad)


def pcdiff_op(kernels: Any, op: str, args: tuple) -> tuple[Forward, Backward]:
    """The same call on pcdiff's compiled backend (its `_backend` interface, as
    tests/reference/pointcloud_kernels.py drives it). Index conversions to its int32 are made
    here, outside the timing: the original's network gets int32 from its own kernels."""
    if op == "furthest_point_sample":
        coords, m = args
        return (lambda: (kernels.furthest_point_sampling(coords.contiguous(), m), None)), None
    if op == "ball_query":
        (centers, points), (radius, k) = (a.contiguous() for a in args[:2]), args[2:]
        return (lambda: (kernels.ball_query(centers, points, radius, k), None)), None
    if op == "grouping":
        features, index = args[0].contiguous(), args[1].int().contiguous()
        n = features.shape[2]
        return (lambda: (kernels.grouping_forward(features, index), None)), (
            lambda _, grad: kernels.grouping_backward(grad, index, n)
        )
    if op == "avg_voxelize":
        features, voxels, r = args[0].contiguous(), torch.round(args[1]).int().contiguous(), args[2]

        def voxelize() -> tuple[torch.Tensor, Any]:
            out, index, counts = kernels.avg_voxelize_forward(features, voxels, r)
            return out, (index, counts)

        return voxelize, lambda saved, grad: kernels.avg_voxelize_backward(grad, *saved)
    if op == "trilinear_devoxelize":
        grid, coords, r = args
        flat, coords = grid.reshape(*grid.shape[:2], -1).contiguous(), coords.contiguous()

        def devoxelize() -> tuple[torch.Tensor, Any]:
            out, corners, weights = kernels.trilinear_devoxelize_forward(r, True, coords, flat)
            return out, (corners, weights)

        return devoxelize, lambda saved, grad: kernels.trilinear_devoxelize_backward(
            grad, *saved, r
        )
    points, centers, features = (a.contiguous() for a in args)

    def interpolate() -> tuple[torch.Tensor, Any]:
        out, index, weights = kernels.three_nearest_neighbors_interpolate_forward(
            points, centers, features
        )
        return out, (index, weights)

    m = centers.shape[2]
    return interpolate, lambda saved, grad: kernels.three_nearest_neighbors_interpolate_backward(
        grad, *saved, m
    )


def time_call(forward: Forward, backward: Backward, repeats: int) -> dict[str, float | None]:
    """Median milliseconds of the forward and of the backward over `repeats`, after one untimed
    run (Triton's compilation, the allocator's first blocks)."""
    times: dict[str, list[float]] = {"forward_ms": [], "backward_ms": []}
    grad = None
    for i in range(repeats + 1):
        synchronize()
        start = time.perf_counter()
        out, saved = forward()
        synchronize()
        middle = time.perf_counter()
        if backward is not None:
            if grad is None:
                grad = torch.randn_like(out)
            backward(saved, grad)
            synchronize()
        if i:
            times["forward_ms"].append(1e3 * (middle - start))
            times["backward_ms"].append(1e3 * (time.perf_counter() - middle))
    backward_ms = statistics.median(times["backward_ms"]) if backward is not None else None
    return {"forward_ms": statistics.median(times["forward_ms"]), "backward_ms": backward_ms}


def run_ops(
    workload: Workload, kernels: Any, reasons: dict[str, str], repeats: int
) -> dict[str, Any]:
    """Every distinct call of one PVCNN2 forward on each backend whose reason (why it cannot
    run here) is empty; pcdiff's through `kernels`. A call that fails on a backend is recorded
    with its error, and the others still run."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    with torch.device(device):
        model = workload.build()
    calls = record_calls(model, workload, device)
    del model
    rows = []
    for call in calls:
        row: dict[str, Any] = {"op": call.op, "sizes": describe(call.args), "calls": call.count}
        for backend in (b for b in BACKENDS if not reasons[b]):
            try:
                if backend == "pcdiff":
                    row[backend] = time_call(*pcdiff_op(kernels, call.op, call.args), repeats)
                else:
                    with point_kernels(backend):
                        row[backend] = time_call(*recipe_op(call.op, call.args), repeats)
            except Exception as error:  # recorded; the other calls still run
                traceback.print_exc()
                row[backend] = {"error": f"{type(error).__name__}: {error}"}
        print(f"op {row}", flush=True)
        rows.append(row)
    return {"backends": reasons, "calls": rows}
