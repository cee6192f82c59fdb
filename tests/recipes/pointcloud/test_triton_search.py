"""recipes/pointcloud/gpu_search.py's Triton kernels against the brute-force references of the
original's CUDA kernels (tests/reference/pointcloud_reference.py) and ops.py's torch path, on the
CPU under Triton's interpreter. TRITON_INTERPRET must be set before triton is imported, so the
kernels run in one subprocess (this file run as a module, with POINTCLOUD_KERNELS=triton) that
saves their outputs; the tests compare them here, with the torch path forced."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from recipes.pointcloud import ops
from tests.reference import pointcloud_reference as ref

REPO = Path(__file__).resolve().parents[3]
HAS_TRITON = importlib.util.find_spec("triton") is not None
pytestmark = pytest.mark.skipif(
    not HAS_TRITON, reason="triton is not installed: its interpreter runs the kernels here"
)
if HAS_TRITON:
    import triton
OPS: dict[str, Callable[..., Any]] = {
    "fps": ops.furthest_point_sample,
    "ball": ops.ball_query,
    "nn": ops.three_nearest_neighbors,
}
CHUNKED_FPS = (
    "fps_tie_512",
    "fps_tie_one_thread",
    "fps_random",
    "fps_grid_ties",
)  # rerun on the chunked path
TINY_CLOUD = dict(batch=2, points=96, centers=20, radius=0.9, neighbors=8, resolution=4, channels=3)


def cloud(batch: int, n: int, seed: int) -> torch.Tensor:
    return torch.randn(batch, 3, n, generator=torch.Generator().manual_seed(seed))


def on_x(xs: list[float]) -> torch.Tensor:
    x = torch.tensor([xs])
    return torch.stack([x, torch.zeros_like(x), torch.zeros_like(x)], dim=1)


def grid(side: int) -> torch.Tensor:
    """(1, 3, side^3) integer points: exact squared distances, so exact ties everywhere."""
    axis = torch.arange(side, dtype=torch.float32)
    return torch.cartesian_prod(axis, axis, axis).T[None].contiguous()


def cases() -> dict[str, tuple[str, tuple]]:
    """Every case's op and arguments; deterministic, so built alike here and in the subprocess."""
    tie = torch.zeros(1, 3, 700)
    tie[0, 0] = torch.linspace(0, 1, 700)
    tie[0, :, 100] = torch.tensor([0.0, 10.0, 0.0])  # tied farthest with 600, whose (k mod 512,
    tie[0, :, 600] = torch.tensor([0.0, -10.0, 0.0])  # k div 512) is smaller: 600 first
    same_thread = tie.clone()  # tied: 100 and 612, both thread 100's: the lower (k div 512)
    same_thread[0, :, 600], same_thread[0, :, 612] = same_thread[0, :, 612], tie[0, :, 600]
    points, centers = cloud(2, 300, seed=1), cloud(2, 40, seed=2) * 0.5
    hand_points, hand_centers = on_x([0.5, 2.0, 0.1, 0.3]), torch.zeros(1, 3, 2)
    hand_centers[0, 0, 1] = 10.0  # nothing within reach: all 0
    near = on_x(torch.linspace(0.099, 0.101, 41).tolist())  # around the radius 0.1
    duplicated = grid(3)[:, :, torch.randperm(27, generator=torch.Generator().manual_seed(7))]
    return {
        "fps_line": ("fps", (on_x([0.0, 1.0, 2.0, 3.0, 4.0]), 4)),
        "fps_tie_512": ("fps", (tie, 3)),
        "fps_tie_one_thread": ("fps", (same_thread, 3)),
        "fps_random": ("fps", (cloud(2, 700, seed=0), 12)),  # N not a multiple of 512
        "fps_grid_ties": ("fps", (grid(9), 10)),  # 729 points
        "fps_more_samples_than_points": ("fps", (cloud(1, 5, seed=3), 8)),
        "fps_one_point": ("fps", (cloud(2, 1, seed=3), 3)),
        "ball_hand_k5": ("ball", (hand_centers, hand_points, 1.0, 5)),
        "ball_hand_k2": ("ball", (hand_centers, hand_points, 1.0, 2)),
        "ball_hand_at_radius": ("ball", (hand_centers, hand_points, 0.5, 3)),
        "ball_random": ("ball", (centers, points, 0.8, 16)),  # M, N not multiples of a block
        "ball_model_k": ("ball", (centers, points, 0.5, 128)),  # the model's K: many short
        "ball_k_over_n": ("ball", (cloud(1, 3, seed=4), cloud(1, 6, seed=5), 1.5, 10)),
        "ball_centres_are_points": ("ball", (points[:, :, :37], points, 0.3, 8)),
        "ball_near_radius": ("ball", (torch.zeros(1, 3, 1), near, 0.1, 64)),
        "nn_hand": ("nn", (torch.zeros(1, 3, 1), on_x([1.0, 10.0, 2.0, 3.0]))),
        "nn_random": ("nn", (cloud(2, 50, seed=4), cloud(2, 20, seed=5))),
        "nn_chunks": ("nn", (cloud(1, 150, seed=6), cloud(1, 150, seed=7))),  # > a block each
        "nn_ties": ("nn", (grid(3) + 0.5 * (grid(3) % 2), torch.cat([duplicated, grid(3)], 2))),
        "nn_one_centre": ("nn", (cloud(2, 10, seed=8), cloud(2, 1, seed=9))),
        "nn_two_centres": ("nn", (cloud(2, 10, seed=8), cloud(2, 2, seed=9))),
    }


def run_kernels(out: Path) -> None:
    """In the subprocess: every case through ops.py (dispatching to the kernels), farthest-point
    sampling again on its chunked path, half-precision inputs, and the GPU suite's harness."""
    from recipes.pointcloud import gpu_search
    from tests.reference.pointcloud_kernels import ReferenceKernels, compare_ops

    interpreted = gpu_search.triton.runtime.interpreter.InterpretedFunction
    assert isinstance(gpu_search._fps_kernel, interpreted), "TRITON_INTERPRET=1 is not in effect"
    results: dict[str, Any] = {name: OPS[op](*args) for name, (op, args) in cases().items()}
    results["fps_bf16"] = ops.furthest_point_sample(cloud(2, 100, seed=10).bfloat16(), 10)
    results["ball_fp16"] = ops.ball_query(cloud(1, 9, 11).half(), cloud(1, 90, 12).half(), 1.0, 8)
    results["harness"] = compare_ops(ReferenceKernels(), "cpu", **TINY_CLOUD)
    gpu_search.FPS_RESIDENT, gpu_search.FPS_CHUNK = 0, 512  # distances in the scratch buffer
    for name in CHUNKED_FPS:
        results[f"chunked_{name}"] = OPS["fps"](*cases()[name][1])
    torch.save(results, out)


@pytest.fixture(scope="module")
def kernels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 7):
        # measured with torch 2.11's triton 3.6 (make test-oldest): its interpreter stops in the
        # sampling kernel ("only 0-dimensional arrays can be converted to Python scalars"); the
        # kernels still compile for sm_90 under it (the compile test below runs there)
        pytest.skip("triton < 3.7: its interpreter cannot run the search kernels")
    out = tmp_path_factory.mktemp("triton") / "results.pt"
    env = dict(os.environ, TRITON_INTERPRET="1", POINTCLOUD_KERNELS="triton", PYTHONPATH=str(REPO))
    done = subprocess.run(
        [sys.executable, "-m", "tests.recipes.pointcloud.test_triton_search", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out)


@pytest.fixture
def torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POINTCLOUD_KERNELS", "torch")


def reference(op: str, args: tuple) -> Any:
    numpy_args = [a.numpy() if isinstance(a, torch.Tensor) else a for a in args]
    if op == "fps":
        return ref.furthest_point_sample(*numpy_args)
    if op == "ball":
        centers, points, radius, k = numpy_args
        return ref.ball_query(centers, points, radius, k)
    points, centers = numpy_args
    _, index, weights = ref.three_nn_interpolate(points, centers, centers[:, :1] * 0)
    return index, weights


@pytest.mark.parametrize("name", list(cases()))
def test_kernel_equals_the_reference_and_the_torch_path(kernels, torch_path, name):
    op, args = cases()[name]
    got, expected, torch_ops = kernels[name], reference(op, args), OPS[op](*args)
    if op == "nn":
        assert got[0].tolist() == expected[0].tolist() == torch_ops[0].tolist()
        assert got[1].dtype == torch.float32
        assert torch.equal(got[1], torch.from_numpy(expected[1]))
        assert torch.equal(got[1], torch_ops[1])
    else:
        assert got.dtype == torch.long
        assert got.tolist() == expected.tolist() == torch_ops.tolist()


def test_the_hand_worked_cases_hold(kernels):
    """What test_ops.py pins, read from the kernels' outputs directly."""
    assert kernels["fps_line"].tolist() == [[0, 4, 2, 1]]
    assert kernels["fps_tie_512"].tolist() == [[0, 600, 100]]
    assert kernels["chunked_fps_tie_one_thread"].tolist() == [[0, 100, 612]]
    assert kernels["ball_hand_k5"].tolist() == [[[0, 2, 3, 0, 0], [0, 0, 0, 0, 0]]]
    assert kernels["ball_hand_at_radius"].tolist()[0][0] == [2, 3, 2]
    assert kernels["nn_hand"][0][0, :, 0].tolist() == [0, 2, 3]
    assert kernels["nn_one_centre"][0].eq(0).all()


@pytest.mark.parametrize("name", CHUNKED_FPS)
def test_sampling_above_the_register_size_keeps_the_tie_order(kernels, torch_path, name):
    args = cases()[name][1]
    expected = reference("fps", args).tolist()
    assert (
        kernels[f"chunked_{name}"].tolist() == expected == ops.furthest_point_sample(*args).tolist()
    )


def test_half_precision_inputs_are_read_as_float32(kernels, torch_path):
    bf16 = cloud(2, 100, seed=10).bfloat16()
    assert torch.equal(kernels["fps_bf16"], ops.furthest_point_sample(bf16.float(), 10))
    centers, points = cloud(1, 9, 11).half(), cloud(1, 90, 12).half()
    assert torch.equal(kernels["ball_fp16"], ops.ball_query(centers.float(), points.float(), 1, 8))


def test_the_gpu_suites_harness_passes_on_the_kernels(kernels):
    assert kernels["harness"]["fps_identical_samples"] == TINY_CLOUD["centers"]
    assert kernels["harness"]["ball_query_lists_differing"] == 0
    assert kernels["harness"]["three_nn_points_differing"] == 0


def test_the_kernels_compile_for_an_h100_without_fused_multiply_adds():
    """Compiled to PTX for sm_90 here, with no GPU: catches what the interpreter does not (the
    compiler's typing of loops and masks), and that distances keep ops.py's rounding (no fma)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from recipes.pointcloud import gpu_search as g

    i32 = dict.fromkeys(["p_sb", "p_sc", "p_sn", "c_sb", "c_sc", "c_sn"], "i32")
    fps = dict(coords="*fp32", scratch="*fp32", out="*i64", n="i32", m="i32", stride_b="i32")
    fps |= dict(stride_c="i32", stride_n="i32", rows="i32")
    fps_consts = dict(THREADS=g.FPS_THREADS, NONE=g.NO_INDEX)
    ball = dict(centers="*fp32", points="*fp32", out="*i64", n="i32", m="i32", r2="fp32", K="i32")
    nn = dict(points="*fp32", centers="*fp32", index="*i64", weights="*fp32", n="i32", m="i32")
    bq_consts = dict(BLOCK_M=g.BQ_CENTERS, BLOCK_N=g.BQ_POINTS, BLOCK_K=g.BQ_SLOTS)
    nn_consts = dict(BLOCK_N=g.NN_POINTS, BLOCK_M=g.NN_CENTERS, NONE=g.NO_INDEX)
    kernels = [
        (g._fps_kernel, fps, dict(BLOCK=g.FPS_RESIDENT, RESIDENT=True, **fps_consts), g.FPS_WARPS),
        (g._fps_kernel, fps, dict(BLOCK=g.FPS_CHUNK, RESIDENT=False, **fps_consts), g.FPS_WARPS),
        (g._ball_query_kernel, ball | i32, bq_consts, g.BQ_WARPS),
        (g._three_nn_kernel, nn | i32, nn_consts, g.NN_WARPS),
    ]
    for kernel, signature, constants, warps in kernels:
        source = ASTSource(kernel, signature | dict.fromkeys(constants, "constexpr"), constants)
        options = dict(num_warps=warps, **g.LAUNCH)
        ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
        assert "fma.rn.f32" not in ptx, kernel.__name__


def test_torch_compile_traces_the_kernels_as_one_graph(monkeypatch):
    """Dynamo sees the three ops as opaque custom ops (torch.library.triton_op): one graph, no
    break. Only traced: running a compiled kernel needs a GPU."""
    monkeypatch.setenv("POINTCLOUD_KERNELS", "triton")
    graphs = []

    def capture(gm: torch.fx.GraphModule, _inputs: list) -> Callable[..., Any]:
        graphs.append(gm)
        outputs = len(next(n for n in gm.graph.nodes if n.op == "output").args[0])
        return lambda *args: [None] * outputs  # running a kernel needs a GPU

    def search(coords: torch.Tensor) -> tuple[torch.Tensor, ...]:
        centers = ops.gather(coords, ops.furthest_point_sample(coords, 8))
        return ops.ball_query(centers, coords, 0.8, 16), *ops.three_nearest_neighbors(
            coords, centers
        )

    torch._dynamo.reset()
    torch.compile(search, backend=capture, fullgraph=True)(cloud(2, 100, seed=0))
    calls = {str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"}
    assert {
        "pointcloud.furthest_point_sample.default",
        "pointcloud.ball_query.default",
        "pointcloud.three_nearest_neighbors.default",
    } <= calls


if __name__ == "__main__":
    run_kernels(Path(sys.argv[1]))
