"""The crystal recipe trained: it learns, predicts, and 2 processes compute what 1 does (float64
gradients, batch norm over the global batch); the Python API in process and on 2 processes.
"""

from __future__ import annotations

import csv
import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from ase.build import bulk

import recipes.train_crystal as recipe
from accel_common.checkpoints.export import inference_device, write_export
from recipes import crystal_api as api
from recipes.crystal.data import CrystalGraphs, load_graphs, read_frames
from recipes.crystal.model import Comformer
from tests.processes import CRYSTAL, CRYSTAL_TINY, REPO, recipe_env, run_processes, run_recipe
from tests.recipes.crystal.helpers import write_volumes
from tests.results import exported_params, global_relative_difference, metrics_log

with warnings.catch_warnings():  # PyG's import trips torch's own torch.jit deprecation warning
    warnings.simplefilter("ignore", FutureWarning)
    from torch_geometric.loader.dataloader import Collater


@pytest.fixture(scope="module")
def trained(crystal_data, tmp_path_factory) -> Path:
    """The example's defaults (the original's network at width 16, 8 neighbours, 64 RBF
    centres) but 2 convolutions instead of 4: 56.7 CPU-s for the whole run (graphs cached,
    20 epochs; 94 s wall on the 2-core VM at load average 6), ending at test MAE 0.064
    eV/atom against the baseline's 0.325 (0.20 x)."""
    tmp = tmp_path_factory.mktemp("crystal-run")
    args = ["--data", str(crystal_data), "--output-dir", str(tmp / "run"), "--layers", "2"]
    run_recipe(args, cwd=tmp, script=CRYSTAL)
    return tmp / "run"


@pytest.mark.slow
def test_learns_the_emt_energy_far_better_than_the_mean(trained):
    metrics = json.loads((trained / "model" / "model.json").read_text())["metrics"]
    assert metrics["test_n"] == 100
    assert metrics["test_mae"] < 0.6 * metrics["test_baseline_mae"], metrics


@pytest.mark.slow
def test_predict_writes_one_row_per_frame(trained, crystal_data, tmp_path):
    out = tmp_path / "p.csv"
    data = crystal_data / "structures.extxyz"
    args = ["predict", "--model", str(trained / "model"), "--data", str(data), "--out", str(out)]
    run_recipe([*args, "--index", ":50"], cwd=tmp_path, script=CRYSTAL)
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == 50 and rows[0].keys() == {
        "index",
        "formula",
        "prediction",
        "energy_per_atom",
    }
    errors = [abs(float(r["prediction"]) - float(r["energy_per_atom"])) for r in rows]
    spread = np.std([float(r["energy_per_atom"]) for r in rows])
    assert np.mean(errors) < spread


def test_predict_writes_every_digit_of_the_models_output(tmp_path):
    """The CSV holds each prediction and target as the exact float (the float32 output read back
    as a float), not 6 significant digits: -163.0903 eV/atom was written as -163.09."""
    torch.manual_seed(0)
    model = Comformer(width=8, layers=1, heads=1, rbf_bins=8)
    config = dict(width=8, layers=1, heads=1, rbf_bins=8, angle_bins=8, fc_features=8)
    config |= dict(cutoff=4.0, max_neighbors=6)
    config |= dict(target="volume", per_atom=False, mean=-163.0903, std=0.5, non_periodic=False)
    write_export(model.state_dict(), tmp_path / "model", {"recipe": "crystal", "config": config})
    path, out = tmp_path / "v.extxyz", tmp_path / "p.csv"
    write_volumes(path, 5)
    recipe.predict(model_dir=tmp_path / "model", data=path, out=out, index=":")

    options = dict(index=":", target="volume", per_atom=False, cutoff=4.0, max_neighbors=6)
    graphs = CrystalGraphs(
        load_graphs(path, non_periodic=False, workers=1, cache=False, **options)[0]
    )
    batch = Collater(graphs)([graphs[i] for i in range(len(graphs))])
    device = inference_device()
    with torch.no_grad():
        expected = (model.to(device).eval()(batch.to(device)) * 0.5 - 163.0903).tolist()
    rows = list(csv.DictReader(out.open()))
    assert [float(r["prediction"]) for r in rows] == expected  # exact, not approx
    assert any(float(f"{p:.6g}") != p for p in expected)  # more digits than 6 can hold
    assert [float(r["volume"]) for r in rows] == [a.info["volume"] for a in read_frames(path, ":")]


@pytest.mark.dist
@pytest.mark.parametrize("two_processes", ["float64", "torch"])
def test_two_processes_end_with_the_same_parameters(crystal_data, tmp_path, two_processes):
    """Each structure weighs the same in the loss (a mean over structures) and every BatchNorm
    normalises with the statistics of the global batch (model.BatchNorm sums them over the
    processes and trains with the same formula in one process; the gradients of 1 and 2
    processes agree to 1e-11 in float64, tested below). What remains is float32 sum order,
    which AdamW amplifies where the true gradient is zero: the biases of the Linear layers right
    before a BatchNorm (`lin_concate.bias`), which the normalisation cancels, so their gradient
    is rounding noise that Adam turns into steps of about the learning rate (measured after 20
    steps: up to 10% apart), and the running means of those BatchNorms, which track them (7%).
    Every other tensor agrees to 2e-5 (measured; the largest, `edge_update_layer.bn_att.bias`,
    was 1.4e-2 apart while one process used torch's own BatchNorm, whose float32 CPU backward
    sums less exactly). `--batchnorm torch` (the presets') on 2 CPU processes becomes the same
    global, float64 BatchNorm (accel_common.batch_lr.batchnorm; SyncBatchNorm on GPUs), so it too
    takes one process's steps (its new layers' parameters are the ones the optimizer steps)."""
    args = ["--data", str(crystal_data), *CRYSTAL_TINY, "--bs", "16", "--max-steps", "20"]
    one, two = tmp_path / "one", tmp_path / "two"
    run_recipe([*args, "--output-dir", str(one)], cwd=tmp_path, script=CRYSTAL)
    run_recipe(
        [*args, "--batchnorm", two_processes, "--output-dir", str(two)],
        cwd=tmp_path, script=CRYSTAL, nproc=2,
    )  # fmt: skip
    assert metrics_log(two)[0]["config"]["num_processes"] == 2
    first, second = exported_params(one), exported_params(two)
    counts = {k for k, v in first.items() if not v.is_floating_point()}  # num_batches_tracked
    assert counts and all(torch.equal(first[k], second[k]) for k in counts)
    noise = {k for k in first if k.endswith(("lin_concate.bias", ".bn.running_mean"))}
    assert len(noise) == 6  # 2 convolutions and the edge update
    for key in first.keys() - counts - noise:
        assert global_relative_difference({key: first[key]}, {key: second[key]}) <= 2e-4, key


@pytest.mark.dist
def test_per_process_batch_norm_says_so_and_trains_otherwise(crystal_data, tmp_path):
    """--no-sync-batchnorm on two processes: the run says that it leaves one process's steps,
    records the setting, and its BatchNorms really normalise per process (its weights end
    apart from the synchronised run's: 25 times the 2e-4 the 1-vs-2 test allows, or more)."""
    args = ["--data", str(crystal_data), *CRYSTAL_TINY, "--bs", "16", "--max-steps", "10"]
    synced, alone = tmp_path / "synced", tmp_path / "alone"
    run_recipe([*args, "--output-dir", str(synced)], cwd=tmp_path, script=CRYSTAL, nproc=2)
    result = run_recipe(
        [*args, "--no-sync-batchnorm", "--output-dir", str(alone)],
        cwd=tmp_path, script=CRYSTAL, nproc=2,
    )  # fmt: skip
    assert "BatchNorm: each process's own statistics (--no-sync-batchnorm)" in result.stdout
    assert metrics_log(alone)[0]["config"]["sync_batchnorm"] is False
    first, second = exported_params(synced), exported_params(alone)
    assert global_relative_difference(first, second) > 5e-3  # measured 2.3e-2


GRADIENT_RANK = """
import os, sys
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
sys.path.insert(0, {repo!r})
from torch_geometric.data import Data
from torch_geometric.loader.dataloader import Collater
from recipes.crystal.data import knn_graph
from recipes.crystal.example import random_crystal
from recipes.crystal.model import build_network

world = int(os.environ.get("WORLD_SIZE", "1"))
if world > 1:
    dist.init_process_group("gloo")
rank = dist.get_rank() if world > 1 else 0
rng = np.random.default_rng(0)
graphs = []
for _ in range(16):
    atoms = random_crystal(rng)
    graph = knn_graph(atoms, 5.0, 8)
    graphs.append(Data(
        z=torch.as_tensor(atoms.numbers), edge_index=torch.as_tensor(graph["edge_index"]),
        vector=torch.as_tensor(graph["vector"], dtype=torch.float64).view(-1, 3),
        lattice=torch.as_tensor(graph["lattice"], dtype=torch.float64).view(1, 3, 3),
        y=torch.tensor([len(atoms) / 10], dtype=torch.float64), num_nodes=len(atoms),
    ))
torch.manual_seed(0)
model = build_network({model!r}, 16, 2, 1, 16, 16, 16).double()
mine = graphs[rank * 16 // world : (rank + 1) * 16 // world]
batch = Collater(mine)(mine)
F.mse_loss(model(batch), batch.y).backward()
grads = {{n: p.grad for n, p in model.named_parameters() if p.grad is not None}}
for grad in grads.values():
    if world > 1:
        dist.all_reduce(grad)  # what DDP does: the mean over the processes
        grad /= world
if rank == 0:
    state = {{k: v for k, v in model.state_dict().items() if "running" in k}}
    torch.save({{"grads": grads, "state": state}}, {out!r} + str(world))
if world > 1:
    dist.destroy_process_group()
"""


@pytest.mark.dist
@pytest.mark.parametrize("model", ["iComformer", "eComformer"])
def test_two_processes_compute_one_processs_gradients_in_float64(tmp_path, model):
    """The network in float64 on 16 structures, in one process and split 8 + 8 over two: every
    gradient (the mean over the processes, as DDP takes it) and every running statistic equal
    one process's to float64 rounding (measured: 1e-11), so the BatchNorm synchronisation adds
    nothing but sum order. Left out: the biases right before a BatchNorm, whose true gradient
    is zero (theirs is rounding, 1e-16 in norm)."""
    script, out = tmp_path / "rank.py", str(tmp_path / "grads")
    script.write_text(GRADIENT_RANK.format(repo=str(REPO), model=model, out=out))
    for processes in (1, 2):
        result = run_processes(
            script, [], processes, cwd=tmp_path, env=recipe_env(tmp_path), timeout=300
        )
        assert result.returncode == 0, result.stderr
    one, two = (torch.load(out + str(n), weights_only=True) for n in (1, 2))
    for key, grad in one["grads"].items():
        if key.endswith("lin_concate.bias"):
            assert grad.norm() < 1e-12  # zero but for rounding
            continue
        assert global_relative_difference({key: grad}, {key: two["grads"][key]}) <= 1e-8, key
    for key, value in one["state"].items():
        assert global_relative_difference({key: value}, {key: two["state"][key]}) <= 1e-8, key


def test_the_originals_call_forms_train_in_process(tmp_path, monkeypatch):
    """train_from_list and train_from_extxyz called with the keywords of the original's README
    and tests; its num_workers, random_seed, graph_cache_dir and weight_decay reach the run."""
    monkeypatch.chdir(tmp_path)
    tiny = ("--width", "16", "--layers", "2", "--rbf-bins", "16")
    strucs = [bulk("Cu", "fcc", a=3.5 + 0.05 * i) for i in range(10)]
    labels = [s.get_volume() for s in strucs]
    metrics, model_dir = api.train_from_list(
        strucs=strucs,
        labels=labels,
        learning_rate=0.001,
        batch_size=4,
        n_epochs=1,
        train_ratio=0.6,
        val_ratio=0.2,
        test_ratio=0.2,
        cutoff=6.0,
        max_neighbors=10,
        use_lattice=True,
        use_angle=False,
        output_dir="./test_output",
        num_workers=0,
        random_seed=42,
        cache_graphs=True,
        graph_cache_dir="./graph_cache",
        weight_decay=1e-5,
        extra_args=tiny,
    )
    assert metrics["test_n"] == 2 and (model_dir / "model.safetensors").is_file()
    exported = json.loads((model_dir / "model.json").read_text())["config"]
    assert (exported["cutoff"], exported["max_neighbors"]) == (6.0, 10)
    run = metrics_log(Path("test_output"))[0]["config"]
    assert (run["seed"], run["workers"], run["weight_decay"]) == (42, 0, 1e-5)
    assert len(list(Path("graph_cache").glob("crystal-*"))) == 1

    path = tmp_path / "volumes.extxyz"
    write_volumes(path, 12)
    metrics, model_dir = api.train_from_extxyz(
        extxyz_file=str(path),
        target_property="volume",
        index=slice(None, 10),  # the original takes an int, a slice or ASE's string
        n_epochs=1,
        batch_size=4,
        output_dir="./extxyz_output",
        cache_graphs=False,  # the original's default; nothing left in the datasets cache
        extra_args=tiny,
    )
    assert metrics["test_n"] == 1 and model_dir == Path("extxyz_output") / "model"


@pytest.mark.dist
def test_the_python_api_trains_in_process_and_on_two_processes(tmp_path, monkeypatch):
    """The original's train_from_list, called as from a notebook: in this process, then on 2
    CPU processes through Accelerate's launcher."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    rng = np.random.default_rng(0)
    elements = ["Cu", "Ag", "Au", "Ni"] * 20
    structures = [
        bulk(e, "fcc", a=a) for e, a in zip(elements, rng.uniform(3.5, 4.2, 80), strict=True)
    ]
    labels = [s.get_volume() for s in structures]
    options = dict(n_epochs=2, batch_size=8, extra_args=tuple(CRYSTAL_TINY))
    metrics, model_dir = api.train_from_list(structures, labels, output_dir="one", **options)
    assert metrics["test_n"] == 8 and (model_dir / "model.safetensors").is_file()
    metrics, model_dir = api.train_from_list(
        structures, labels, output_dir="two", num_processes=2, **options
    )
    assert metrics_log(Path("two"))[0]["config"]["num_processes"] == 2
    assert metrics["test_n"] == 8 and model_dir == Path("two") / "model"


BATCH_NORM_RANK = """
import json, sys
import torch
import torch.distributed as dist
sys.path.insert(0, {repo!r})
from recipes.crystal.model import BatchNorm

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
x = torch.randn(10, 4) * 3 + 1
weight = torch.randn(10, 4)
norm = BatchNorm(4)
norm.synchronised = {synchronised}
with torch.no_grad():
    norm.weight.copy_(torch.tensor([0.5, 1.0, 2.0, -1.0]))
    norm.bias.copy_(torch.tensor([0.1, 0.0, -0.2, 0.3]))
rows = slice(0, 6) if rank == 0 else slice(6, 10)  # uneven shares: 6 and 4 rows
mine = x[rows].clone().requires_grad_(True)
out = norm(mine)
(out * weight[rows]).sum().backward()
grads = [norm.weight.grad, norm.bias.grad]
for grad in grads:
    dist.all_reduce(grad)  # what DDP does (then divides by the world size: a sum loss here)
parts = [None, None]
dist.all_gather_object(parts, (out.tolist(), mine.grad.tolist()))
if rank == 0:
    state = {{k: v.tolist() for k, v in norm.state_dict().items()}}
    result = {{"out": parts[0][0] + parts[1][0], "x_grad": parts[0][1] + parts[1][1],
               "grads": [g.tolist() for g in grads], "state": state}}
    with open({out!r}, "w") as handle:
        json.dump(result, handle)
dist.destroy_process_group()
"""


@pytest.mark.dist
@pytest.mark.parametrize("synchronised", [True, False])
def test_batch_norm_uses_the_global_batchs_statistics_on_two_processes(tmp_path, synchronised):
    """Rows split 6 + 4 over two gloo processes: the outputs, the gradients (of the inputs and
    of the affine parameters) and the running statistics are those of one process with all 10
    rows (torch's BatchNorm1d), to float rounding. Not synchronised (--no-sync-batchnorm), each
    process's are those of torch's BatchNorm1d on its own rows, as under plain DDP."""
    script, out = tmp_path / "rank.py", tmp_path / "out.json"
    script.write_text(
        BATCH_NORM_RANK.format(repo=str(REPO), out=str(out), synchronised=synchronised)
    )
    result = run_processes(script, [], 2, cwd=tmp_path, env=recipe_env(tmp_path), timeout=300)
    assert result.returncode == 0, result.stderr
    got = json.loads(out.read_text())

    torch.manual_seed(0)
    x = (torch.randn(10, 4) * 3 + 1).requires_grad_(True)
    weight = torch.randn(10, 4)
    norm = torch.nn.BatchNorm1d(4)
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([0.5, 1.0, 2.0, -1.0]))
        norm.bias.copy_(torch.tensor([0.1, 0.0, -0.2, 0.3]))
    if synchronised:
        expected = norm(x)
    else:  # each process's rows alone; the running statistics are the first process's
        alone = torch.nn.functional.batch_norm
        second = alone(x[6:], None, None, norm.weight, norm.bias, training=True)
        expected = torch.cat([norm(x[:6]), second])
    (expected * weight).sum().backward()
    state = norm.state_dict()
    assert torch.tensor(got["out"]) == pytest.approx(expected.detach(), abs=1e-5)
    assert torch.tensor(got["x_grad"]) == pytest.approx(x.grad, abs=1e-5)
    assert torch.tensor(got["grads"][0]) == pytest.approx(norm.weight.grad, abs=1e-5)
    assert torch.tensor(got["grads"][1]) == pytest.approx(norm.bias.grad, abs=1e-5)
    for key, value in state.items():
        assert torch.tensor(got["state"][key]) == pytest.approx(value, abs=1e-6), key
