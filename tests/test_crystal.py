"""The crystal recipe: extxyz targets where real files keep them, k-NN graphs, the graph cache,
learning, exact scaling, predict, and the original's Python API."""

from __future__ import annotations

import copy
import csv
import functools
import json
import warnings
from collections import Counter
from pathlib import Path

import ase.io
import datasets
import numpy as np
import pytest
import torch
from accelerate.state import AcceleratorState
from ase import Atoms
from ase.build import bulk
from ase.calculators.singlepoint import SinglePointCalculator
from ase.neighborlist import neighbor_list
from safetensors.torch import load_file
from typer.testing import CliRunner

import recipes.train_crystal as recipe
from accel_common.checkpoint import inference_device, write_export
from accel_common.entry import train_in_python
from accel_common.errors import CheckpointError, ConfigError, DataError
from accel_common.tools import cli
from recipes.crystal import api, convert
from recipes.crystal.data import (
    CrystalGraphs,
    comformer_graph,
    knn_graph,
    load_graphs,
    read_frames,
    split_indices,
    target_value,
)
from recipes.crystal.example import random_crystal
from recipes.crystal.model import BatchNorm, Comformer, EComformer, cgcnn_features
from tests.conftest import (
    CRYSTAL,
    CRYSTAL_TINY,
    REPO,
    dry_run_plan,
    exported_params,
    global_relative_difference,
    invoke_train,
    metrics_log,
    recipe_env,
    run_processes,
    run_recipe,
)

with warnings.catch_warnings():  # PyG's import trips torch's own torch.jit deprecation warning
    warnings.simplefilter("ignore", FutureWarning)
    from torch_geometric.data import Data
    from torch_geometric.loader.dataloader import Collater


def labelled_frames() -> list[Atoms]:
    """Two frames the way real files carry targets: info keys, and calculator results."""
    frames = []
    for scale in (1.0, 1.05):
        atoms = bulk("Cu", "fcc", a=3.6 * scale, cubic=True)  # 4 atoms
        atoms.info["formation_energy_per_atom"] = -0.5 * scale
        forces = np.tile([[3.0, 4.0, 0.0]], (4, 1))  # norm 5 on every atom
        atoms.calc = SinglePointCalculator(atoms, energy=-8.0 * scale, forces=forces)
        frames.append(atoms)
    return frames


def test_targets_are_found_in_info_calculator_results_and_arrays(tmp_path):
    path = tmp_path / "t.extxyz"
    ase.io.write(path, labelled_frames(), format="extxyz")
    frames = read_frames(path, ":")
    assert len(frames) == 2 and len(read_frames(path, "::2")) == 1
    first = frames[0]
    assert target_value(first, "formation_energy_per_atom", "f", False) == pytest.approx(-0.5)
    # current ASE reads energy back into the calculator, not info
    assert "energy" not in first.info
    assert target_value(first, "energy", "f", per_atom=True) == pytest.approx(-2.0)
    assert target_value(first, "forces", "f", False) == pytest.approx(5.0)  # mean per-atom norm
    with pytest.raises(DataError, match=r"frame 1: no target 'band_gap'; this frame has info: "):
        target_value(frames[1], "band_gap", "frame 1", False)


def test_a_per_atom_array_becomes_the_mean_of_per_atom_norms_and_a_stress_its_norm():
    atoms = bulk("Cu", "fcc", a=3.6, cubic=True)  # 4 atoms
    atoms.arrays["local_e"] = np.array([1.0, -1.0, 1.0, -1.0])  # opposite signs do not cancel
    atoms.arrays["dipoles"] = np.array([[3.0, 4.0, 0.0], [0.0, 0.0, -5.0]] * 2)
    atoms.info["config_type"] = "bulk"
    assert target_value(atoms, "local_e", "f", False) == pytest.approx(1.0)
    assert target_value(atoms, "dipoles", "f", False) == pytest.approx(5.0)
    assert target_value(atoms, "local_e", "f", per_atom=True) == pytest.approx(0.25)
    # six atoms and a six-component (Voigt) stress: still one tensor, not six atoms
    six = bulk("Cu", "fcc", a=3.6, cubic=True).repeat((1, 1, 2))[:6]
    stress = np.array([1.0, -2.0, 2.0, 0.0, 0.0, 0.0])
    six.calc = SinglePointCalculator(six, stress=stress, charges=[2.0, -2.0] * 3)
    assert target_value(six, "stress", "f", False) == pytest.approx(3.0)
    assert target_value(six, "charges", "f", False) == pytest.approx(2.0)  # per atom, declared
    with pytest.raises(DataError, match=r"^f: target 'config_type' is 'bulk', not a number$"):
        target_value(atoms, "config_type", "f", False)


def test_per_atom_arrays_are_read_back_from_an_extxyz_file(tmp_path):
    atoms = bulk("Cu", "fcc", a=3.6, cubic=True)
    atoms.arrays["local_e"] = np.array([1.0, -1.0, 1.0, -1.0])
    path = tmp_path / "a.extxyz"
    ase.io.write(path, [atoms], format="extxyz")
    (frame,) = read_frames(path, ":")
    assert "local_e" in frame.arrays  # an arrays column, not a calculator result
    assert target_value(frame, "local_e", "f", False) == pytest.approx(1.0)


def write_volumes(path: Path, count: int) -> list[float]:
    """`count` Cu cells of growing size with their volume in info["volume"]."""
    frames = [bulk("Cu", "fcc", a=3.5 + 0.01 * i, cubic=True) for i in range(count)]
    for atoms in frames:
        atoms.info["volume"] = atoms.get_volume()
    ase.io.write(path, frames, format="extxyz")
    return [atoms.get_volume() for atoms in frames]


def test_index_takes_slices_and_frame_numbers_as_ase_writes_them(tmp_path):
    path = tmp_path / "v.extxyz"
    volumes = write_volumes(path, 5)

    def selected(index: str) -> list[float]:
        return [atoms.info["volume"] for atoms in read_frames(path, index)]

    assert selected(":") == pytest.approx(volumes)
    assert selected(":1000") == pytest.approx(volumes)  # past the end: what there is
    assert selected(":3") == pytest.approx(volumes[:3])
    assert selected("1::2") == pytest.approx(volumes[1::2])
    assert selected("2") == pytest.approx([volumes[2]])
    assert selected("-1") == pytest.approx([volumes[-1]])
    with pytest.raises(DataError, match=r"v.extxyz: --index 7 selects no frames"):
        read_frames(path, "7")
    with pytest.raises(ConfigError, match=r"--index first: give a frame number or a slice"):
        read_frames(path, "first")


def test_a_truncated_or_malformed_file_is_a_data_error_naming_the_file_and_frame(tmp_path):
    path = tmp_path / "v.extxyz"
    write_volumes(path, 3)
    lines = path.read_text().splitlines(keepends=True)  # 6 lines per 4-atom frame
    path.write_text("".join(lines[:-2]))  # the last frame cut short
    with pytest.raises(DataError, match=r"v.extxyz, frame 2: not a readable extended XYZ file"):
        read_frames(path, ":")
    assert len(read_frames(path, ":2")) == 2  # the frames before it still read
    lines[8] = "Cu 0.0 x.y 0.0\n"  # frame 1, its third line
    path.write_text("".join(lines))
    with pytest.raises(DataError, match=r"v.extxyz, frame 1: not a readable extended XYZ file"):
        read_frames(path, "::1")
    lines[6] = "four\n"  # a broken header: ASE's scan fails before any frame is read
    path.write_text("".join(lines))
    with pytest.raises(DataError, match=r"v.extxyz: not a readable extended XYZ file"):
        read_frames(path, ":")


def test_a_singular_cell_is_refused_even_with_non_periodic(tmp_path):
    flat = Atoms("Cu2", positions=[[0, 0, 0], [1.8, 0, 0]], pbc=True)
    flat.cell = [[3.6, 0, 0], [0, 3.6, 0], [3.6, 3.6, 0]]  # three vectors in one plane
    flat.info["y"] = 1.0
    crystal = bulk("Cu", "fcc", a=3.6)
    crystal.info["y"] = 2.0
    path = tmp_path / "flat.extxyz"
    ase.io.write(path, [crystal, flat], format="extxyz")
    options = dict(index=":", target="y", per_atom=False, cutoff=4.0, max_neighbors=4, workers=1)
    for non_periodic in (False, True):
        with pytest.raises(
            DataError, match=r"flat.extxyz, frame 1: periodic \(pbc \[True, True, True\]\) but "
            r"its cell is singular \(volume 0\); give the frame three independent lattice"
        ):  # fmt: skip
            load_graphs(path, non_periodic=non_periodic, cache=False, **options)


def test_split_is_fixed_by_its_seed_disjoint_covering_and_80_10_10():
    parts = split_indices(50, (0.8, 0.1, 0.1), seed=123)
    assert [len(p) for p in parts] == [40, 5, 5]
    assert sorted(np.concatenate(parts).tolist()) == list(range(50))  # disjoint and covering
    again = split_indices(50, (0.8, 0.1, 0.1), seed=123)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    other = split_indices(50, (0.8, 0.1, 0.1), seed=124)
    assert not np.array_equal(parts[2], other[2])
    with pytest.raises(DataError, match=r"5 structures are too few for the split ratios"):
        split_indices(5, (0.8, 0.1, 0.1), seed=0)


def test_two_graph_workers_build_exactly_the_graphs_of_one(tmp_path):
    path = tmp_path / "t.extxyz"
    frames = [random_crystal(np.random.default_rng(seed)) for seed in range(6)]
    for atoms in frames:
        atoms.info["y"] = len(atoms)
    ase.io.write(path, frames, format="extxyz")
    options = dict(index=":", target="y", per_atom=False, cutoff=5.0, max_neighbors=6)
    options |= dict(non_periodic=False, cache=False)
    one, _, _ = load_graphs(path, workers=1, **options)
    two, _, _ = load_graphs(path, workers=2, **options)
    assert one.column_names == two.column_names and len(one) == len(two) == 6
    assert one.to_dict() == two.to_dict()  # same rows, same order, same values


def test_a_structure_without_a_lattice_is_refused_unless_asked_for(tmp_path):
    molecule = Atoms("Cu2", positions=[[0, 0, 0], [0, 0, 2.3]])
    molecule.info["y"] = 1.0
    path = tmp_path / "m.extxyz"
    ase.io.write(path, [molecule], format="extxyz")
    options = dict(index=":", target="y", per_atom=False, cutoff=4.0, max_neighbors=4, workers=1)
    with pytest.raises(DataError, match=r"frame 0: not a periodic crystal .*--non-periodic"):
        load_graphs(path, non_periodic=False, **options)
    graphs, _, _ = load_graphs(path, non_periodic=True, **options)
    # each atom finds the other, and each pair found is an edge both ways, as in crystals
    assert len(graphs[0]["source"]) == len(graphs[0]["target"]) == 4


def test_every_atom_gets_its_nearest_neighbours_with_the_ties_and_lattice_self_loops():
    atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat((2, 1, 1))
    atoms.rattle(0.05, seed=3)
    graph = knn_graph(atoms, cutoff=5.0, max_neighbors=7)
    source, target = graph["edge_index"]
    length = np.linalg.norm(graph["vector"].astype(np.float64), axis=1)
    i, d = neighbor_list("id", atoms, 5.0)  # ASE's own search, as the reference
    lattice = np.linalg.norm(graph["lattice"].astype(np.float64), axis=1)
    for atom in range(len(atoms)):
        # found from this atom: its 7 nearest (no ties in a rattled cell), plus 3 self-loops
        # (both ways: 6 edges) and the edges other atoms found to it
        mine = np.sort(length[(source == atom) & (target != atom)])
        assert set(np.round(np.sort(d[i == atom])[:7], 4)) <= set(np.round(mine, 4))
        loops = np.sort(length[(source == atom) & (target == atom)])
        assert np.round(loops, 4).tolist() == np.round(np.repeat(np.sort(lattice), 2), 4).tolist()
    # undirected: every edge is there both ways, with the opposite vector
    forward = edge_multiset(graph["edge_index"], graph["vector"])
    assert forward == edge_multiset(graph["edge_index"][::-1], -graph["vector"])
    one_atom = knn_graph(bulk("Cu", "sc", a=2.0), cutoff=2.5, max_neighbors=5)
    # the 6 images of the first shell, all kept though 5 were asked for, both ways (their
    # lattice self-loops are among them)
    assert np.linalg.norm(one_atom["vector"], axis=1) == pytest.approx([2.0] * 12)


def test_graphs_are_built_once_and_rebuilt_when_the_file_or_a_setting_changes(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "t.extxyz"
    ase.io.write(path, labelled_frames(), format="extxyz")
    options = dict(index=":", target="energy", per_atom=True, non_periodic=False, workers=1)
    graphs, _, cached = load_graphs(path, cutoff=5.0, max_neighbors=6, **options)
    assert not cached and graphs["y"] == pytest.approx([-2.0, -2.1])
    again, _, cached = load_graphs(path, cutoff=5.0, max_neighbors=6, **options)
    assert cached and again["source"] == graphs["source"]
    _, _, cached = load_graphs(path, cutoff=5.0, max_neighbors=4, **options)
    assert not cached  # another setting
    ase.io.write(path, labelled_frames()[:1], format="extxyz")
    changed, _, cached = load_graphs(path, cutoff=5.0, max_neighbors=6, **options)
    assert not cached and len(changed) == 1  # another file


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


@pytest.mark.slow
def test_a_missing_target_stops_with_one_line_naming_the_frame(crystal_data, tmp_path):
    args = ["--data", str(crystal_data), "--target", "band_gap", "--output-dir", str(tmp_path)]
    result = run_recipe(args, cwd=tmp_path, script=CRYSTAL, check=False)
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert "structures.extxyz, frame 0: no target 'band_gap'; this frame has info: " in line
    assert "calculator: ['energy', 'forces', 'stress']" in line


@pytest.mark.slow
def test_a_truncated_file_stops_the_run_with_one_line_and_exit_code_2(tmp_path):
    path = tmp_path / "v.extxyz"
    write_volumes(path, 3)
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:-2]))  # as a copy cut off in the middle of the last frame
    args = ["--data", str(path), "--target", "volume", "--output-dir", str(tmp_path / "run")]
    result = run_recipe(args, cwd=tmp_path, script=CRYSTAL, check=False)
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"error: {path}, frame 2: not a readable extended XYZ file (")


@pytest.mark.dist
def test_two_processes_end_with_the_same_parameters(crystal_data, tmp_path):
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
    sums less exactly)."""
    args = ["--data", str(crystal_data), *CRYSTAL_TINY, "--bs", "16", "--max-steps", "20"]
    one, two = tmp_path / "one", tmp_path / "two"
    run_recipe([*args, "--output-dir", str(one)], cwd=tmp_path, script=CRYSTAL)
    run_recipe([*args, "--output-dir", str(two)], cwd=tmp_path, script=CRYSTAL, nproc=2)
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


def test_the_originals_arguments_without_a_counterpart_are_refused_by_name(monkeypatch):
    call = functools.partial(api.train_from_extxyz, "never_read.extxyz", "energy")
    with pytest.raises(ConfigError, match=r"^model_name='cgcnn': not available here; give one"):
        call(model_name="cgcnn")
    with pytest.raises(ConfigError, match=r"^use_angle=True: not available here .* leave use_"):
        call(use_angle=True)
    with pytest.raises(ConfigError, match=r"^n_early_stopping: not an argument this recipe kn"):
        call(n_early_stopping=50)
    with pytest.raises(ConfigError, match=r"^--train-ratio, --val-ratio and --test-ratio must"):
        call(train_ratio=0.5)  # checked here, before anything is read or launched
    monkeypatch.setattr(api.torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ConfigError, match=r"^distributed=True: this machine has 0 GPU\(s\); pass"):
        call(distributed=True)
    with pytest.raises(ConfigError, match=r"^3 structures but 2 labels"):
        api.train_from_list(strucs=[bulk("Cu")] * 3, labels=[1.0, 2.0])


def test_a_training_split_smaller_than_the_global_batch_says_so_and_what_to_pass(
    tmp_path, monkeypatch
):
    """22 training structures and batch_size=64: no optimizer step can be taken. The error names
    the split's size, the global batch and the way out, not an empty schedule."""
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "v.extxyz"
    write_volumes(path, 28)  # 22 / 2 / 4 at 0.8 / 0.1 / 0.1
    with pytest.raises(
        ConfigError, match=r"^the training split \(22 structures\) is smaller than the global "
        r"batch \(64\).* a smaller --bs \(batch_size= from Python\), at most 22, or more data"
    ):  # fmt: skip
        api.train_from_extxyz(
            path, "volume", batch_size=64, n_epochs=1, cache_graphs=False,
            extra_args=("--width", "16", "--layers", "1", "--rbf-bins", "16"),
        )  # fmt: skip


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


# --------------------------------------------------------------------------- settings

ORIGINAL = REPO / "recipes" / "crystal" / "configs" / "original.yaml"
ORIGINAL_ECOMFORMER = ORIGINAL.with_name("original_ecomformer.yaml")


invoke = functools.partial(invoke_train, recipe.train)
dry_run = functools.partial(dry_run_plan, recipe.train)


def parameters(width: int, layers: int, heads: int = 1, bins: int = 256, fc: int = 16) -> str:
    model = Comformer(width, layers, heads, bins, bins, fc)
    return str(sum(p.numel() for p in model.parameters()))


def test_the_original_preset_plans_its_size_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    plan = dry_run(["--config", str(ORIGINAL)])
    # the original's iComformer at its default config: 4,966,497 parameters in 166 tensors
    assert plan["parameters"] == parameters(256, 4, fc=256) == "4966497"
    assert plan["batch"] == "global batch 64 = 64 per device x 1 processes x 1 accumulation steps"
    assert plan["learning rate"].startswith("peak 0.001 (--lr 0.001 at --ref-bs 64, linear")
    assert plan["learning rate"].endswith("then onecycle")
    assert plan["epochs"] == "500" and plan["mixed precision"] == "no"
    assert list(tmp_path.iterdir()) == []  # no output folder, no example data


def test_the_original_ecomformer_preset_plans_its_size(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    plan = dry_run(["--config", str(ORIGINAL_ECOMFORMER)])
    # the original's eComformer at its default config: 5,583,809 parameters in 116 tensors
    model = EComformer(256, 3, 1, 256, 256)
    assert plan["parameters"] == str(sum(p.numel() for p in model.parameters())) == "5583809"
    assert plan["learning rate"].startswith("peak 0.001 (--lr 0.001 at --ref-bs 64, linear")
    assert plan["epochs"] == "500" and list(tmp_path.iterdir()) == []


def test_a_config_value_is_used_and_a_flag_overrides_it(tmp_path):
    config = tmp_path / "small.yaml"
    config.write_text("width: 16\nlayers: 2\nrbf-bins: 16\nangle-bins: 16\nlr: 2.0e-3\n")
    plan = dry_run(["--config", str(config)])
    assert plan["parameters"] == parameters(16, 2, bins=16)
    assert plan["learning rate"].startswith("peak 0.002 (--lr 0.002 at --ref-bs 64")
    plan = dry_run(["--config", str(config), "--width", "24", "--processes", "4"])
    assert plan["parameters"] == parameters(24, 2, bins=16)
    assert plan["batch"] == "global batch 64 = 16 per device x 4 processes x 1 accumulation steps"
    # the recipe's own checks hold for a file as for a flag
    config.write_text("train-ratio: 0.5\n")
    result = invoke(["--config", str(config), "--dry-run"])
    assert isinstance(result.exception, ConfigError)
    assert str(result.exception) == "--train-ratio, --val-ratio and --test-ratio must sum to 1"


def test_resuming_with_another_split_seed_is_refused_naming_it(tmp_path):
    path = tmp_path / "v.extxyz"
    write_volumes(path, 30)
    out = tmp_path / "run"
    argv = ["--data", str(path), "--target", "volume", "--no-cache-graphs", *CRYSTAL_TINY]
    argv += ["--bs", "8", "--output-dir", str(out)]
    try:
        train_in_python(recipe.train, [*argv, "--max-steps", "2"], out, script=CRYSTAL)
        again = [*argv, "--max-steps", "3", "--resume", "latest", "--split-seed", "7"]
        with pytest.raises(CheckpointError, match=r"belongs to another run") as refused:
            train_in_python(recipe.train, again, out, script=CRYSTAL)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert len(str(refused.value).splitlines()) == 1
    assert "--split-seed 123 in the checkpoint, 7 now" in str(refused.value)


def write_with_nan(path: Path, what: str) -> None:
    """Three labelled copper crystals; frame 1 has one NaN position or cell entry."""
    frames = []
    for i in range(3):
        atoms = bulk("Cu", "fcc", a=3.6, cubic=True)
        atoms.info["y"] = float(i)
        frames.append(atoms)
    if what == "position":
        frames[1].positions[2, 0] = np.nan
    else:
        cell = frames[1].cell.array.copy()
        cell[1, 1] = np.inf
        frames[1].set_cell(cell)
    ase.io.write(path, frames, format="extxyz")


@pytest.mark.parametrize(
    ("what", "message"),
    [
        ("position", r"nan.extxyz, frame 1: atom 2 has position \[nan, 0\.0, 1\.8\], not finite"),
        ("cell", r"nan.extxyz, frame 1: its cell has a value that is not finite"),
    ],
)
def test_a_non_finite_position_or_cell_is_refused_in_training_and_predict(tmp_path, what, message):
    path = tmp_path / "nan.extxyz"
    write_with_nan(path, what)
    options = dict(index=":", target="y", per_atom=False, cutoff=4.0, max_neighbors=4, workers=1)
    with pytest.raises(DataError, match=message):
        load_graphs(path, non_periodic=False, cache=False, **options)
    model = Comformer(width=8, layers=1, heads=1, rbf_bins=8)
    config = dict(width=8, layers=1, heads=1, rbf_bins=8, angle_bins=8, fc_features=8)
    config |= dict(cutoff=4.0, max_neighbors=6)
    config |= dict(target="y", per_atom=False, mean=0.0, std=1.0, non_periodic=False)
    write_export(model.state_dict(), tmp_path / "model", {"recipe": "crystal", "config": config})
    out = tmp_path / "p.csv"
    with pytest.raises(DataError, match=message):
        recipe.predict(model_dir=tmp_path / "model", data=path, out=out, index=":")
    assert not out.exists()


def test_predict_reads_a_data_folder_as_training_does(tmp_path):
    """`--data FOLDER` means FOLDER/structures.extxyz in training; predict reads it the same way."""
    folder = tmp_path / "data"
    folder.mkdir()
    write_volumes(folder / "structures.extxyz", 3)
    model = Comformer(width=8, layers=1, heads=1, rbf_bins=8)
    config = dict(width=8, layers=1, heads=1, rbf_bins=8, angle_bins=8, fc_features=8)
    config |= dict(cutoff=4.0, max_neighbors=6)
    config |= dict(target="volume", per_atom=False, mean=0.0, std=1.0, non_periodic=False)
    write_export(model.state_dict(), tmp_path / "model", {"recipe": "crystal", "config": config})
    out = tmp_path / "p.csv"
    recipe.predict(model_dir=tmp_path / "model", data=folder, out=out, index=":")
    assert len(list(csv.DictReader(out.open()))) == 3
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"empty: no structures.extxyz in this folder"):
        recipe.predict(
            model_dir=tmp_path / "model",
            data=tmp_path / "empty",
            out=out.with_name("q.csv"),
            index=":",
        )


# --------------------------------------------------------------------------- the original's code

FIXTURES = REPO / "tests" / "fixtures" / "crystal"  # made by jwchen25/comformer: see README.md


def original_outputs(name: str = "icomformer") -> dict:
    return json.loads((FIXTURES / "outputs.json").read_text())[name]


def original_graphs(max_neighbors: int | None = None) -> list[dict]:
    graphs = json.loads((FIXTURES / "graphs.json").read_text())["graphs"]
    return [g for g in graphs if max_neighbors in (None, g["max_neighbors"])]


def fixture_frames() -> dict[str, Atoms]:
    return {a.info["name"]: a for a in read_frames(FIXTURES / "structures.extxyz", ":")}


def fixture_model(name: str = "icomformer") -> Comformer | EComformer:
    config = original_outputs(name)["config"]
    sizes = [config["node_features"], config["conv_layers"], config["node_layer_head"]]
    sizes.append(config["edge_features"])
    if name == "icomformer":
        model = Comformer(*sizes, config["triplet_input_features"], config["fc_features"])
    else:
        model = EComformer(*sizes, config["fc_features"])
    model.load_state_dict(load_file(FIXTURES / f"{name}.safetensors"), strict=True)
    return model


def as_batch(graphs: list[dict]):
    frames = fixture_frames()
    data = [
        Data(
            z=torch.as_tensor(frames[g["name"]].numbers),
            edge_index=torch.tensor(g["edge_index"]),
            vector=torch.tensor(g["edge_attr"]),
            lattice=torch.tensor(g["lattice"]).view(1, 3, 3),
            num_nodes=len(frames[g["name"]]),
        )
        for g in graphs
    ]
    return Collater(data)(data)


def relative(a: torch.Tensor, b: list[float]) -> float:
    b = torch.tensor(b)
    return ((a - b).abs() / b.abs().clamp(min=1e-6)).max().item()


def test_the_network_is_the_originals_key_for_key_at_its_default_config():
    model = Comformer(256, 4, 1, 256, 256, 256)
    assert sum(p.numel() for p in model.parameters()) == 4_966_497
    state = model.state_dict()
    assert len(state) == 166  # the original's tensors, buffers included; no CGCNN table
    assert "edge_update_layer.lin_key_e3.weight" in state and "rbf.0.centers" in state
    original = load_file(FIXTURES / "icomformer.safetensors")  # its keys at another width
    assert sorted(fixture_model().state_dict()) == sorted(original) == sorted(state)


def test_ecomformer_is_the_originals_key_for_key_at_its_default_config():
    model = EComformer(256, 3, 1, 256, 256)
    assert sum(p.numel() for p in model.parameters()) == 5_583_809
    state = model.state_dict()
    assert len(state) == 116  # e3nn's own buffers (tp.output_mask, tp.weight) included
    original = load_file(FIXTURES / "ecomformer.safetensors")  # its keys at another width
    assert sorted(fixture_model("ecomformer").state_dict()) == sorted(original) == sorted(state)
    assert {k: v.shape for k, v in fixture_model("ecomformer").state_dict().items()} == {
        k: v.shape for k, v in original.items()
    }


def test_the_atom_features_are_the_originals_92_cgcnn_features():
    table = cgcnn_features()
    assert table.shape == (104, 92) and set(table.unique().tolist()) == {0.0, 1.0}
    assert table[0].sum() == 0 and (table[101] == table[100]).all()
    assert (table[1:101].sum(1) > 0).all()


@pytest.mark.parametrize("name", ["icomformer", "ecomformer"])
def test_the_originals_weights_give_its_outputs_on_its_graphs(name):
    """Made by the original's code on CPU (tests/fixtures/crystal/README.md): the same weights
    on the same graphs give its outputs, with running statistics (eval), each graph alone, and
    with the batch's own (train, BatchNorm on the batch)."""
    model, graphs = fixture_model(name), original_graphs(25)
    expected = original_outputs(name)
    with torch.no_grad():
        assert relative(model.eval()(as_batch(graphs)), expected["eval"]) <= 1e-5
        alone = torch.cat([model(as_batch([g])) for g in graphs])
        one_by_one = [value for (value,) in expected["eval_one_by_one"]]  # one list per graph
        assert relative(alone, one_by_one) <= 1e-5
        # the batch's statistics: model.BatchNorm's float64 sums, not torch's float32 CPU
        # kernel, whose rounding is in the original's numbers (they are 5.5e-5 from float64,
        # ours 6.8e-5, 1.1e-4 apart on the smallest output: measured), hence 3e-4
        assert relative(model.train()(as_batch(graphs)), expected["train"]) <= 3e-4


def test_in_training_the_batch_norm_is_torchs_in_float64():
    """The whole network in train mode, in float64 (where rounding is out of the way): with
    model.BatchNorm and with torch's BatchNorm1d in its place, the same outputs."""
    batch = as_batch(original_graphs(25))
    batch.vector, batch.lattice = batch.vector.double(), batch.lattice.double()
    model = fixture_model().double().train()
    torch_own = fixture_model().double().train()
    for module in torch_own.modules():
        if isinstance(module, BatchNorm):
            module.forward = functools.partial(torch.nn.BatchNorm1d.forward, module)
    with torch.no_grad():
        assert torch.allclose(model(batch), torch_own(batch), rtol=1e-10, atol=0)
    for key, value in torch_own.state_dict().items():  # running statistics included
        assert torch.allclose(model.state_dict()[key], value, rtol=1e-10, atol=1e-12), key


def random_fixture_sized_model(seed: int) -> Comformer:
    config = original_outputs()["config"]
    sizes = [config[k] for k in ("node_features", "conv_layers", "node_layer_head")]
    sizes += [config[k] for k in ("edge_features", "triplet_input_features", "fc_features")]
    torch.manual_seed(seed)
    return Comformer(*sizes).train()


def test_under_bf16_autocast_the_messages_are_gathered_and_summed_in_float32():
    """On CUDA a sum over a node's edges is an atomic add that rounds to bf16 at every add, in
    the forward (the messages at each node) and the backward (each node's query, key and value
    gradients over its edges): under bf16 both must see float32 tensors. On the CPU these sums
    accumulate in float32 anyway, so training on the CPU did not show it (the crystal's bf16 run
    was 0.4% from fp32's loss here, 12.1% on an H100; 20.7% on the CPU with CUDA's bf16 sums
    emulated, 0.1% with this)."""
    model, batch = random_fixture_sized_model(0), as_batch(original_graphs(25))
    seen = []
    for conv in model.att_layers:
        conv.aggr_module.register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
        conv.register_message_forward_pre_hook(
            lambda m, inputs: seen.extend(inputs[0][k].dtype for k in ("key_i", "value_j"))
        )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(batch).sum().backward()
    assert seen == [torch.float32] * 3 * len(model.att_layers)


@pytest.mark.parametrize("seed", [0, 1])
def test_bf16_autocast_keeps_the_edge_update_near_float32(seed):
    """The edge update's BatchNorm normalises a channel whose mean is up to ~400x its spread
    (its input: a Linear's output, summed over the three lattice vectors); rounded to bf16 before
    it, that channel came out as noise. Measured on the fixture graphs, the edge update's output
    under bf16 autocast against float32's (relative): seeds 0 and 1 0.098 and 0.124 with the
    Linear in bf16, 0.053 and 0.055 with it in float32 (seeds 2, 3: 0.093, 0.085 against 0.048,
    0.067)."""
    model, batch = random_fixture_sized_model(seed), as_batch(original_graphs(25))
    twin = copy.deepcopy(model)  # training mode updates the running statistics
    edges = []
    for net, narrow in ((model, False), (twin, True)):
        hook = net.edge_update_layer.register_forward_hook(lambda m, i, out: edges.append(out))
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=narrow):
            net(batch)
        hook.remove()
    wide, narrow = edges[0], edges[1].float()
    assert ((narrow - wide).norm() / wide.norm()).item() <= 0.075


def test_ecomformer_is_invariant_to_rotating_the_structure():
    """Its tensor products are equivariant and its output is built from scalars only: turning
    every edge vector by a rotation (and the lattice with it) leaves the prediction as it is."""
    model, batch = fixture_model("ecomformer").eval(), as_batch(original_graphs(25))
    rotation = torch.linalg.qr(torch.randn(3, 3, generator=torch.Generator().manual_seed(1)))[0]
    turned = batch.clone()
    turned.vector = batch.vector @ rotation.T
    turned.lattice = batch.lattice @ rotation.T
    with torch.no_grad():
        assert torch.allclose(model(turned), model(batch), rtol=1e-4, atol=1e-5)


def edge_multiset(edge_index, vectors) -> Counter:
    vectors = np.round(np.asarray(vectors, dtype=np.float64), 4) + 0.0  # -0.0 as 0.0
    return Counter(
        (int(s), int(t), *v) for s, t, v in zip(*edge_index, vectors.tolist(), strict=True)
    )


@pytest.mark.parametrize(
    "graph", original_graphs(), ids=lambda g: f"{g['name']}-k{g['max_neighbors']}"
)
def test_the_graphs_are_the_originals_edge_for_edge(graph):
    """The original's graph code on the same structures: diamond silicon and fcc copper (every
    shell a tie), hcp, a rattled rock salt and a triclinic cell, at 25 and 12 neighbours."""
    atoms = fixture_frames()[graph["name"]]
    mine = comformer_graph(atoms, graph["cutoff"], graph["max_neighbors"])
    assert mine["edge_index"].shape[1] == len(graph["edge_attr"])
    assert edge_multiset(mine["edge_index"], mine["vector"]) == edge_multiset(
        graph["edge_index"], graph["edge_attr"]
    )
    assert np.array_equal(mine["lattice"], np.asarray(graph["lattice"], dtype=np.float32))


def test_from_the_file_through_the_recipes_graphs_the_output_is_the_originals(tmp_path):
    options = dict(index=":", target=None, per_atom=False, cutoff=6.0, max_neighbors=25)
    rows, _, _ = load_graphs(
        FIXTURES / "structures.extxyz", non_periodic=False, workers=1, cache=False, **options
    )
    graphs = CrystalGraphs(rows.add_column("y", [0.0] * len(rows)))
    batch = Collater(graphs)([graphs[i] for i in range(len(graphs))])
    with torch.no_grad():
        assert relative(fixture_model().eval()(batch), original_outputs()["eval"]) <= 1e-5


def write_original_checkpoint(folder: Path, name: str = "icomformer", **config) -> Path:
    """A ComFormer run folder: best_model.pt as its train.py saves it, and its config.json."""
    folder.mkdir(parents=True, exist_ok=True)
    state = load_file(FIXTURES / f"{name}.safetensors")
    torch.save({"model": state}, folder / "best_model.pt")
    model = original_outputs(name)["config"]
    original = {"model": model, "cutoff": 6.0, "max_neighbors": 25, "target": "band_gap"}
    (folder / "config.json").write_text(json.dumps(original | config))
    return folder / "best_model.pt"


def test_convert_from_comformer_imports_best_model_strictly_and_back(tmp_path):
    source = write_original_checkpoint(tmp_path / "orig", mean_train=1.5, std_train=2.0)
    out = tmp_path / "export"
    result = CliRunner().invoke(cli.app, ["convert", str(source), str(out), "--from", "comformer"])
    assert result.exit_code == 0, result.output
    meta = json.loads((out / "model.json").read_text())
    config = meta["config"]
    assert meta["recipe"] == "crystal" and config["mean"] == 1.5 and config["std"] == 2.0
    assert (config["width"], config["rbf_bins"], config["angle_bins"]) == (16, 12, 10)
    assert (config["fc_features"], config["max_neighbors"], config["target"]) == (8, 25, "band_gap")
    model = recipe.build_model(None, recipe.CrystalSettings.from_config(config))
    model.load_state_dict(load_file(out / "model.safetensors"), strict=True)
    with torch.no_grad():
        got = model.eval()(as_batch(original_graphs(25)))
    assert relative(got, original_outputs()["eval"]) <= 1e-5
    back = tmp_path / "back" / "best_model.pt"
    result = CliRunner().invoke(cli.app, ["convert", str(out), str(back), "--to", "comformer"])
    assert result.exit_code == 0, result.output
    saved = torch.load(back, weights_only=True)["model"]
    original = load_file(FIXTURES / "icomformer.safetensors")
    assert saved.keys() == original.keys()
    assert all(torch.equal(saved[k], original[k]) for k in original)
    written = json.loads((back.parent / "config.json").read_text())
    assert written["model"] == {k: v for k, v in original_outputs()["config"].items()}
    assert (written["mean_train"], written["std_train"], written["max_neighbors"]) == (1.5, 2.0, 25)


def test_convert_from_comformer_imports_an_ecomformer_strictly_and_back(tmp_path):
    """The original's config names the network; the tensors must be that network's."""
    source = write_original_checkpoint(tmp_path / "orig", "ecomformer", mean_train=0.5)
    state, config = convert.import_checkpoint(source)
    assert (config["model"], config["width"], config["layers"]) == ("eComformer", 16, 3)
    assert (config["rbf_bins"], config["fc_features"], config["mean"]) == (12, 8, 0.5)
    model = recipe.build_model(None, recipe.CrystalSettings.from_config(config))
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        got = model.eval()(as_batch(original_graphs(25)))
    assert relative(got, original_outputs("ecomformer")["eval"]) <= 1e-5
    write_export(state, tmp_path / "export", {"recipe": "crystal", "config": config})
    back = tmp_path / "back" / "best_model.pt"
    result = CliRunner().invoke(
        cli.app, ["convert", str(tmp_path / "export"), str(back), "--to", "comformer"]
    )
    assert result.exit_code == 0, result.output
    saved = torch.load(back, weights_only=True)["model"]
    original = load_file(FIXTURES / "ecomformer.safetensors")
    assert saved.keys() == original.keys()
    assert all(torch.equal(saved[k], original[k]) for k in original)
    written = json.loads((back.parent / "config.json").read_text())
    assert written["model"] == original_outputs("ecomformer")["config"]
    (source.parent / "config.json").write_text(json.dumps({"model": {"name": "iComformer"}}))
    with pytest.raises(CheckpointError, match=r"'iComformer' but the checkpoint's tensors are eC"):
        convert.import_checkpoint(source)


def test_convert_from_comformer_refuses_another_network_naming_the_tensor(tmp_path):
    source = write_original_checkpoint(tmp_path / "orig")
    state = torch.load(source, weights_only=True)["model"]
    state["fc_out.weight"] = torch.zeros(2, 8)  # a classification head
    torch.save({"model": state}, source)
    with pytest.raises(
        CheckpointError, match=r"fc_out.weight has shape \(2, 8\) in the checkpoint, \(1, 8\)"
    ):
        convert.import_checkpoint(source)
    del state["fc_out.weight"]
    torch.save({"model": state}, source)
    with pytest.raises(CheckpointError, match=r"missing tensor fc_out.weight \(1, 8\)"):
        convert.import_checkpoint(source)
    (source.parent / "config.json").write_text(json.dumps({"model": {"name": "Matformer"}}))
    with pytest.raises(
        CheckpointError, match=r"model 'Matformer'; this recipe builds iComformer, eC"
    ):
        convert.import_checkpoint(source)


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


def test_the_python_apis_defaults_are_the_originals():
    """An argument left out of train_from_extxyz takes the original's default (its preset),
    not the CPU-sized command-line default."""
    args, settings = recipe.train.resolve(**api.original_defaults())
    assert (args.lr, args.bs, args.epochs, args.weight_decay) == (1e-3, 64, 500, 1e-5)
    assert (settings.cutoff, settings.max_neighbors, settings.width) == (6.0, 25, 256)
    assert (settings.rbf_bins, settings.angle_bins, settings.fc_features) == (256, 256, 256)
    assert recipe.train.resolve()[1].width == 16  # the command line's own default
    # model_name="eComformer" takes eComformerConfig's defaults, as the original's config does
    _, settings = recipe.train.resolve(**api.original_defaults("eComformer"))
    assert (settings.model, settings.layers, settings.width) == ("eComformer", 3, 256)


def test_init_from_starts_training_from_a_converted_comformer_checkpoint(tmp_path):
    source = write_original_checkpoint(tmp_path / "orig", mean_train=0.0, std_train=1.0)
    state, config = convert.import_checkpoint(source)
    write_export(state, tmp_path / "converted", {"recipe": "crystal", "config": config})
    path = tmp_path / "v.extxyz"
    write_volumes(path, 20)
    sizes = ["--width", "16", "--rbf-bins", "12", "--angle-bins", "10", "--fc-features", "8"]
    argv = ["--data", str(path), "--target", "volume", "--no-cache-graphs", *sizes]
    argv += ["--bs", "8", "--max-steps", "1", "--output-dir", str(tmp_path / "run")]
    try:
        train_in_python(
            recipe.train,
            [*argv, "--init-from", str(tmp_path / "converted")],
            tmp_path / "run",
            script=CRYSTAL,
        )
        with pytest.raises(CheckpointError, match=r"does not fit this model"):
            wrong = [*argv, "--width", "24", "--output-dir", str(tmp_path / "wrong")]
            train_in_python(
                recipe.train,
                [*wrong, "--init-from", str(tmp_path / "converted")],
                tmp_path / "wrong",
                script=CRYSTAL,
            )
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    trained = load_file(tmp_path / "run" / "model" / "model.safetensors")
    # one step from the original's weights: close to them, not to a fresh initialisation
    start = load_file(FIXTURES / "icomformer.safetensors")
    assert (trained["fc_out.weight"] - start["fc_out.weight"]).abs().max() < 0.05


def test_ecomformer_trains_exports_predicts_and_converts_back(tmp_path):
    """`--model eComformer` through the whole recipe: training steps, the export, predict from
    it, and `convert --to comformer` giving the original's tensors (its fixture's keys)."""
    path = tmp_path / "v.extxyz"
    write_volumes(path, 20)
    argv = ["--data", str(path), "--target", "volume", "--no-cache-graphs", "--model", "eComformer"]
    argv += ["--width", "16", "--layers", "3", "--rbf-bins", "12", "--fc-features", "8"]
    argv += ["--bs", "8", "--max-steps", "2", "--output-dir", str(tmp_path / "run")]
    try:
        _, model_dir = train_in_python(recipe.train, argv, tmp_path / "run", script=CRYSTAL)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    out = tmp_path / "p.csv"
    recipe.predict(model_dir=model_dir, data=path, out=out, index=":")
    assert len(list(csv.DictReader(out.open()))) == 20
    back = tmp_path / "back" / "best_model.pt"
    result = CliRunner().invoke(
        cli.app, ["convert", str(model_dir), str(back), "--to", "comformer"]
    )
    assert result.exit_code == 0, result.output
    saved = torch.load(back, weights_only=True)["model"]
    original = load_file(FIXTURES / "ecomformer.safetensors")
    assert {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in original.items()}
    assert json.loads((back.parent / "config.json").read_text())["model"]["name"] == "eComformer"
