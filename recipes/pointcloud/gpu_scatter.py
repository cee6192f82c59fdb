"""Triton kernels for the gather / scatter point ops of ops.py (grouping, average voxelisation,
trilinear devoxelisation, 3-nearest-neighbour interpolation), forward and backward, as
`torch.library.triton_op`s with registered autograd, so that `torch.compile` sees the kernels.

Why hand-written: on a GPU the plain-PyTorch ops are chains of gather / scatter_add / multiply /
add over (B, C, N)-sized temporaries (trilinear devoxelisation: 8 gathers, 8 products, 7 sums and
their index arithmetic; its backward as many scatters), each a kernel launch and a round trip
through GPU memory. Each kernel here does one op in one pass: it computes its indices and weights
in registers and reads or writes each feature once. pcdiff's CUDA kernels do the same; these keep
ops.py's semantics (voxel at round-half-to-even, x-major index, 1/count per point; the upper
corner only where the fraction is > 0, the 8 terms in the order 000, 001, ..., 111; the 3
interpolation terms in order) and need no compiler on the user's machine.

How work maps to programs: each kernel runs a grid of (point blocks, channel blocks, batch).
A program takes BLOCK_P points (or grouped neighbour slots) of one sample: it loads their indices
(and coordinates / weights) once, then gathers or scatters a [BLOCK_C, BLOCK_P] tile of features,
channels along rows, points along columns. Average voxelisation first counts each voxel's points
(one program per point block and sample, int32 atomics: exact). Forward passes of grouping,
devoxelisation and interpolation, and average voxelisation's backward (each point reads its
voxel's gradient times 1/count), gather and store each output once: deterministic. Average
voxelisation's forward and the other backward passes scatter-add with atomics: the sums run in
the order programs arrive, so they differ from the plain-PyTorch ops in their last bits and from
run to run. Under `--deterministic` ops.py does not call these (see ops._scatter_kernels).

Kernels accumulate and write float32 (float64 for float64 inputs); half-precision inputs (what
autocast hands over from convolutions) are read as they are. torch casts the result once to the
dtype the plain-PyTorch op gives (the promotion of features and weights), in round-to-nearest
everywhere (Triton's interpreter truncates its own float32 -> bfloat16 casts). Preconditions as
pcdiff's kernels: indices in range, grid coordinates in [0, R - 1]; ops.py's callers produce both
(ball query, 3-NN search, normalize_voxel_coords).
"""

import torch
import triton
import triton.language as tl
from torch.library import triton_op

from recipes.pointcloud.backend import launchable

BLOCK_P = 128  # points per program: one index load, coalesced stores along points
BLOCK_C = 16  # channels per program: BLOCK_C x BLOCK_P = 2048 elements per tile


def _acc(*dtypes: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float64 if any input is, else float32."""
    return torch.float64 if torch.float64 in dtypes else torch.float32


def _grid(points: int, channels: int, batch: int):
    return (triton.cdiv(points, BLOCK_P), triton.cdiv(channels, BLOCK_C), batch)


# ---------------------------------------------------------------------------------- kernels


@triton.jit
def _tile(C, P, BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr):
    """This program's sample, channels (int64) and points, and their masks."""
    p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    c = (tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    pm = p < P
    return b, c, p, pm, (c < C)[:, None] & pm[None, :]


@triton.jit
def _grouping_fwd(
    feat, idx, out, C, N, P, sfb, sfc, sfn, sib, sip, BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr
):
    b, c, p, pm, m = _tile(C, P, BLOCK_C, BLOCK_P)
    n = tl.load(idx + b * sib + p * sip, mask=pm, other=0).to(tl.int64)
    v = tl.load(feat + b * sfb + c[:, None] * sfc + n[None, :] * sfn, mask=m)
    tl.store(out + (b * C + c[:, None]) * P + p[None, :], v, mask=m)


@triton.jit
def _grouping_bwd(
    grad, idx, acc, C, N, P, sgb, sgc, sgp, sib, sip, BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr
):
    b, c, p, pm, m = _tile(C, P, BLOCK_C, BLOCK_P)
    n = tl.load(idx + b * sib + p * sip, mask=pm, other=0).to(tl.int64)
    g = tl.load(grad + b * sgb + c[:, None] * sgc + p[None, :] * sgp, mask=m)
    tl.atomic_add(acc + (b * C + c[:, None]) * N + n[None, :], g.to(acc.dtype.element_ty), mask=m)


@triton.jit
def _round_half_even(x):
    """torch.round of x >= 0 (half to even), as int32."""
    f = tl.floor(x)
    d = x - f
    i = f.to(tl.int32)
    return tl.where(d > 0.5, i + 1, tl.where(d < 0.5, i, i + (i & 1)))


@triton.jit
def _voxel_index(coords, vox, counts, N, R, scb, sca, scn, BLOCK_P: tl.constexpr):
    n = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    b = tl.program_id(1).to(tl.int64)
    m = n < N
    base = coords + b * scb + n * scn
    x = _round_half_even(tl.load(base, mask=m, other=0))
    y = _round_half_even(tl.load(base + sca, mask=m, other=0))
    z = _round_half_even(tl.load(base + 2 * sca, mask=m, other=0))
    flat = (x * R + y) * R + z
    tl.store(vox + b * N + n, flat, mask=m)
    tl.atomic_add(counts + b * R * R * R + flat, tl.full([BLOCK_P], 1, tl.int32), mask=m)


@triton.jit
def _avg_voxelize_fwd(
    feat, vox, counts, acc, C, N, R3, sfb, sfc, sfn, BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr
):
    b, c, n, pm, m = _tile(C, N, BLOCK_C, BLOCK_P)
    flat = tl.load(vox + b * N + n, mask=pm, other=0).to(tl.int64)
    count = tl.load(counts + b * R3 + flat, mask=pm, other=1)
    inv = (1.0 / count.to(tl.float64)).to(acc.dtype.element_ty)  # as ops.py: 1 / count in double
    f = tl.load(feat + b * sfb + c[:, None] * sfc + n[None, :] * sfn, mask=m)
    tl.atomic_add(
        acc + (b * C + c[:, None]) * R3 + flat[None, :],
        f.to(acc.dtype.element_ty) * inv[None, :],
        mask=m,
    )


@triton.jit
def _avg_voxelize_bwd(
    grad,
    vox,
    counts,
    out,
    C,
    N,
    R3,
    sgb,
    sgc,
    sgv,
    BLOCK_C: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    b, c, n, pm, m = _tile(C, N, BLOCK_C, BLOCK_P)
    ACC = out.dtype.element_ty  # float32 / float64: cast by the caller
    flat = tl.load(vox + b * N + n, mask=pm, other=0).to(tl.int64)
    count = tl.load(counts + b * R3 + flat, mask=pm, other=1)
    inv = (1.0 / count.to(tl.float64)).to(ACC)
    g = tl.load(grad + b * sgb + c[:, None] * sgc + flat[None, :] * sgv, mask=m).to(ACC)
    tl.store(
        out + (b * C + c[:, None]) * N + n[None, :],
        g * inv[None, :],
        mask=m,
    )


@triton.jit
def _pick(a0, a1, BIT: tl.constexpr):
    if BIT:
        return a1
    else:
        return a0


@triton.jit
def _corners(coords, b, n, pm, R, scb, sca, scn):
    """Lower-corner flat index, per-axis index steps (0 where the fraction is 0) and the
    fractions frac0 = 1 - frac1, frac1, as ops.trilinear_devoxelize, in the coordinates' dtype."""
    base = coords + b * scb + n * scn
    x = tl.load(base, mask=pm, other=0)
    y = tl.load(base + sca, mask=pm, other=0)
    z = tl.load(base + 2 * sca, mask=pm, other=0)
    lx, ly, lz = tl.floor(x), tl.floor(y), tl.floor(z)
    x1, y1, z1 = x - lx, y - ly, z - lz
    lo = (lx.to(tl.int64) * R + ly.to(tl.int64)) * R + lz.to(tl.int64)
    sx = tl.where(x1 > 0, R * R, 0).to(tl.int64)
    sy = tl.where(y1 > 0, R, 0).to(tl.int64)
    sz = tl.where(z1 > 0, 1, 0).to(tl.int64)
    return lo, sx, sy, sz, 1.0 - x1, x1, 1.0 - y1, y1, 1.0 - z1, z1


@triton.jit
def _devoxelize_fwd(
    grid,
    coords,
    out,
    C,
    N,
    R,
    sgb,
    sgc,
    sgv,
    scb,
    sca,
    scn,
    BLOCK_C: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    b, c, n, pm, m = _tile(C, N, BLOCK_C, BLOCK_P)
    ACC = out.dtype.element_ty  # float32 / float64: cast by the caller
    lo, sx, sy, sz, x0, x1, y0, y1, z0, z1 = _corners(coords, b, n, pm, R, scb, sca, scn)
    rows = grid + b * sgb + c[:, None] * sgc
    total = tl.zeros([BLOCK_C, BLOCK_P], ACC)  # 0 + first term: the first term exactly
    for corner in tl.static_range(8):  # 000, 001, ..., 111 (x, y, z bits)
        bx = (corner >> 2) & 1
        by = (corner >> 1) & 1
        bz = corner & 1
        index = lo + bx * sx + by * sy + bz * sz
        w = (_pick(x0, x1, bx) * _pick(y0, y1, by) * _pick(z0, z1, bz)).to(ACC)
        term = tl.load(rows + index[None, :] * sgv, mask=m).to(ACC) * w[None, :]
        total += term
    tl.store(out + (b * C + c[:, None]) * N + n[None, :], total, mask=m)


@triton.jit
def _devoxelize_bwd(
    grad,
    coords,
    acc,
    C,
    N,
    R,
    sgb,
    sgc,
    sgn,
    scb,
    sca,
    scn,
    BLOCK_C: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    b, c, n, pm, m = _tile(C, N, BLOCK_C, BLOCK_P)
    lo, sx, sy, sz, x0, x1, y0, y1, z0, z1 = _corners(coords, b, n, pm, R, scb, sca, scn)
    ACC = acc.dtype.element_ty
    g = tl.load(grad + b * sgb + c[:, None] * sgc + n[None, :] * sgn, mask=m).to(ACC)
    rows = acc + (b * C + c[:, None]) * R * R * R
    for corner in tl.static_range(8):
        bx = (corner >> 2) & 1
        by = (corner >> 1) & 1
        bz = corner & 1
        index = lo + bx * sx + by * sy + bz * sz
        w = (_pick(x0, x1, bx) * _pick(y0, y1, by) * _pick(z0, z1, bz)).to(ACC)
        tl.atomic_add(rows + index[None, :], g * w[None, :], mask=m)


@triton.jit
def _interpolate_fwd(
    feat,
    idx,
    wts,
    out,
    C,
    M,
    N,
    sfb,
    sfc,
    sfm,
    sib,
    sik,
    sin,
    swb,
    swk,
    swn,
    BLOCK_C: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    b, c, n, pm, m = _tile(C, N, BLOCK_C, BLOCK_P)
    ACC = out.dtype.element_ty  # float32 / float64: cast by the caller
    rows = feat + b * sfb + c[:, None] * sfc
    total = tl.zeros([BLOCK_C, BLOCK_P], ACC)
    for k in tl.static_range(3):  # f0 * w0 + f1 * w1 + f2 * w2, in that order
        i = tl.load(idx + b * sib + k * sik + n * sin, mask=pm, other=0).to(tl.int64)
        w = tl.load(wts + b * swb + k * swk + n * swn, mask=pm, other=0).to(ACC)
        term = tl.load(rows + i[None, :] * sfm, mask=m).to(ACC) * w[None, :]
        total += term
    tl.store(out + (b * C + c[:, None]) * N + n[None, :], total, mask=m)


@triton.jit
def _interpolate_bwd(
    grad,
    idx,
    wts,
    acc,
    C,
    M,
    N,
    sgb,
    sgc,
    sgn,
    sib,
    sik,
    sin,
    swb,
    swk,
    swn,
    BLOCK_C: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    b, c, n, pm, m = _tile(C, N, BLOCK_C, BLOCK_P)
    ACC = acc.dtype.element_ty
    g = tl.load(grad + b * sgb + c[:, None] * sgc + n[None, :] * sgn, mask=m).to(ACC)
    rows = acc + (b * C + c[:, None]) * M
    for k in tl.static_range(3):
        i = tl.load(idx + b * sib + k * sik + n * sin, mask=pm, other=0).to(tl.int64)
        w = tl.load(wts + b * swb + k * swk + n * swn, mask=pm, other=0).to(ACC)
        tl.atomic_add(rows + i[None, :], g * w[None, :], mask=m)


# ------------------------------------------------------------------------------- custom ops


@triton_op("pointcloud::grouping", mutates_args=())
def _grouping(features: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    batch, channels, n = features.shape
    flat = indices.reshape(batch, -1)
    out = features.new_empty(batch, channels, flat.shape[1])
    if out.numel():
        launchable(_grouping_fwd)[_grid(flat.shape[1], channels, batch)](
            features,
            flat,
            out,
            channels,
            n,
            flat.shape[1],
            *features.stride(),
            *flat.stride(),
            BLOCK_C,
            BLOCK_P,
        )
    return out.view(batch, channels, *indices.shape[1:])


@triton_op("pointcloud::grouping_backward", mutates_args=())
def _grouping_backward(grad: torch.Tensor, indices: torch.Tensor, n: int) -> torch.Tensor:
    batch, channels = grad.shape[:2]
    flat = indices.reshape(batch, -1)
    g = grad.reshape(batch, channels, flat.shape[1])
    acc = grad.new_zeros(batch, channels, n, dtype=_acc(grad.dtype))
    if g.numel():
        launchable(_grouping_bwd)[_grid(flat.shape[1], channels, batch)](
            g, flat, acc, channels, n, flat.shape[1], *g.stride(), *flat.stride(), BLOCK_C, BLOCK_P
        )
    return acc.to(grad.dtype)


def _grouping_context(ctx, inputs, output) -> None:
    features, indices = inputs
    ctx.save_for_backward(indices)
    ctx.n = features.shape[2]


def _grouping_grad(ctx, grad):
    return _grouping_backward(grad, ctx.saved_tensors[0], ctx.n), None


_grouping.register_autograd(_grouping_grad, setup_context=_grouping_context)


@triton_op("pointcloud::voxel_index", mutates_args=())
def _voxel_index_op(grid_coords: torch.Tensor, resolution: int) -> list[torch.Tensor]:
    """Each point's flat voxel index (B, N) and each voxel's point count (B, R^3), int32."""
    batch, _, n = grid_coords.shape
    vox = grid_coords.new_empty(batch, n, dtype=torch.int32)
    counts = grid_coords.new_zeros(batch, resolution**3, dtype=torch.int32)
    if vox.numel():
        launchable(_voxel_index)[(triton.cdiv(n, BLOCK_P), batch)](
            grid_coords, vox, counts, n, resolution, *grid_coords.stride(), BLOCK_P
        )
    return [vox, counts]


@triton_op("pointcloud::avg_voxelize", mutates_args=())
def _avg_voxelize(
    features: torch.Tensor, vox: torch.Tensor, counts: torch.Tensor, resolution: int
) -> torch.Tensor:
    batch, channels, n = features.shape
    r3 = resolution**3
    acc = features.new_zeros(batch, channels, r3, dtype=_acc(features.dtype))
    if features.numel():
        launchable(_avg_voxelize_fwd)[_grid(n, channels, batch)](
            features, vox, counts, acc, channels, n, r3, *features.stride(), BLOCK_C, BLOCK_P
        )
    return acc.to(features.dtype).view(batch, channels, resolution, resolution, resolution)


@triton_op("pointcloud::avg_voxelize_backward", mutates_args=())
def _avg_voxelize_backward(
    grad: torch.Tensor, vox: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    grad = grad.flatten(2)  # (B, C, R^3)
    batch, channels, r3 = grad.shape
    n = vox.shape[1]
    out = grad.new_empty(batch, channels, n, dtype=_acc(grad.dtype))
    if out.numel():
        launchable(_avg_voxelize_bwd)[_grid(n, channels, batch)](
            grad,
            vox,
            counts,
            out,
            channels,
            n,
            r3,
            *grad.stride(),
            BLOCK_C,
            BLOCK_P,
        )
    return out.to(grad.dtype)


def _avg_voxelize_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[1], inputs[2])


def _avg_voxelize_grad(ctx, grad):
    return _avg_voxelize_backward(grad, *ctx.saved_tensors), None, None, None


_avg_voxelize.register_autograd(_avg_voxelize_grad, setup_context=_avg_voxelize_context)


@triton_op("pointcloud::trilinear_devoxelize", mutates_args=())
def _devoxelize(grid: torch.Tensor, grid_coords: torch.Tensor, resolution: int) -> torch.Tensor:
    batch, channels = grid.shape[:2]
    n = grid_coords.shape[2]
    flat = grid.reshape(batch, channels, resolution**3)
    dtype = torch.promote_types(grid.dtype, grid_coords.dtype)
    out = grid.new_empty(batch, channels, n, dtype=_acc(dtype))
    if out.numel():
        launchable(_devoxelize_fwd)[_grid(n, channels, batch)](
            flat,
            grid_coords,
            out,
            channels,
            n,
            resolution,
            *flat.stride(),
            *grid_coords.stride(),
            BLOCK_C,
            BLOCK_P,
        )
    return out.to(dtype)


@triton_op("pointcloud::trilinear_devoxelize_backward", mutates_args=())
def _devoxelize_backward(
    grad: torch.Tensor, grid_coords: torch.Tensor, resolution: int
) -> torch.Tensor:
    """Gradient of the flat grid (B, C, R^3), in the accumulation dtype."""
    batch, channels, n = grad.shape
    acc = grad.new_zeros(batch, channels, resolution**3, dtype=_acc(grad.dtype))
    if grad.numel():
        launchable(_devoxelize_bwd)[_grid(n, channels, batch)](
            grad,
            grid_coords,
            acc,
            channels,
            n,
            resolution,
            *grad.stride(),
            *grid_coords.stride(),
            BLOCK_C,
            BLOCK_P,
        )
    return acc


def _devoxelize_context(ctx, inputs, output) -> None:
    grid, grid_coords, resolution = inputs
    ctx.save_for_backward(grid_coords)
    ctx.resolution, ctx.shape, ctx.dtype = resolution, grid.shape, grid.dtype


def _devoxelize_grad(ctx, grad):
    flat = _devoxelize_backward(grad, ctx.saved_tensors[0], ctx.resolution)
    return flat.to(ctx.dtype).view(ctx.shape), None, None


_devoxelize.register_autograd(_devoxelize_grad, setup_context=_devoxelize_context)


@triton_op("pointcloud::interpolate", mutates_args=())
def _interpolate(
    features: torch.Tensor, index: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    batch, channels, m = features.shape
    n = index.shape[2]
    dtype = torch.promote_types(features.dtype, weights.dtype)
    out = features.new_empty(batch, channels, n, dtype=_acc(dtype))
    if out.numel():
        launchable(_interpolate_fwd)[_grid(n, channels, batch)](
            features,
            index,
            weights,
            out,
            channels,
            m,
            n,
            *features.stride(),
            *index.stride(),
            *weights.stride(),
            BLOCK_C,
            BLOCK_P,
        )
    return out.to(dtype)


@triton_op("pointcloud::interpolate_backward", mutates_args=())
def _interpolate_backward(
    grad: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, m: int
) -> torch.Tensor:
    """Gradient of the centre features (B, C, M), in the accumulation dtype."""
    batch, channels, n = grad.shape
    acc = grad.new_zeros(batch, channels, m, dtype=_acc(grad.dtype))
    if grad.numel():
        launchable(_interpolate_bwd)[_grid(n, channels, batch)](
            grad,
            index,
            weights,
            acc,
            channels,
            m,
            n,
            *grad.stride(),
            *index.stride(),
            *weights.stride(),
            BLOCK_C,
            BLOCK_P,
        )
    return acc


def _interpolate_context(ctx, inputs, output) -> None:
    features, index, weights = inputs
    ctx.save_for_backward(index, weights)
    ctx.m, ctx.dtype = features.shape[2], features.dtype


def _interpolate_grad(ctx, grad):
    index, weights = ctx.saved_tensors
    return _interpolate_backward(grad, index, weights, ctx.m).to(ctx.dtype), None, None


_interpolate.register_autograd(_interpolate_grad, setup_context=_interpolate_context)


# ------------------------------------------------------------------------ ops.py's interface


def grouping(features: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """ops.grouping: features (B, C, N) at neighbour indices (B, M, K): (B, C, M, K)."""
    return _grouping(features, indices)


def avg_voxelize(
    features: torch.Tensor, grid_coords: torch.Tensor, resolution: int
) -> torch.Tensor:
    """ops.avg_voxelize: (B, C, R, R, R) means of the points' features per voxel."""
    vox, counts = _voxel_index_op(grid_coords, resolution)
    return _avg_voxelize(features, vox, counts, resolution)


def trilinear_devoxelize(
    grid: torch.Tensor, grid_coords: torch.Tensor, resolution: int
) -> torch.Tensor:
    """ops.trilinear_devoxelize: grid (B, C, R, R, R) at float grid coordinates: (B, C, N)."""
    return _devoxelize(grid, grid_coords, resolution)


def interpolate(features: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """ops.interpolate: sum over k of features at index[:, k] times weights[:, k]: (B, C, N)."""
    return _interpolate(features, index, weights)
