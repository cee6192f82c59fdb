"""`--deterministic`: a run that repeats bit for bit on the same hardware and software, as
Lightning's `Trainer(deterministic=True)`.

On a CPU the recipes are deterministic already. On a GPU they are not by default: scatter-adds
(voxel grids, graph messages, embedding gradients) sum with atomics in whatever order threads
arrive, cuDNN picks algorithms by timing, and cuBLAS splits reductions by workspace. Training
amplifies those last-bit differences (measured on the CPU: a 1e-7 nudge of the weights after
step 1 ends 0.3 relative apart in quality's near-zero norm biases after 40 steps), so two GPU runs
that should agree do not, and neither does a resumed run with an uninterrupted one.
"""

from __future__ import annotations

import os

# cuBLAS is deterministic only with one of these fixed workspaces (the CUDA docs' "Results
# reproducibility"); read when cuBLAS makes its handle, so it is set before the first matmul
CUBLAS_WORKSPACES = (":4096:8", ":16:8")


def make_deterministic() -> None:
    """Deterministic kernels or an error, cuDNN without benchmarking, a fixed cuBLAS workspace.

    Data-loader workers are seeded already: every training loader has its own generator seeded
    by --seed (data.loaders.make_train_loader), from which torch seeds each worker's torch,
    random and numpy generators. An op that has no deterministic kernel raises instead of running
    (accel_common.errors.refused_op names it)."""
    import torch  # here: accel_common.errors imports this module, and the CLI avoids torch

    if os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in CUBLAS_WORKSPACES:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACES[0]
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
