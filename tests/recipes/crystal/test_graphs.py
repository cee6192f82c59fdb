"""The crystal recipe's k-NN graphs: neighbours with ties and lattice self-loops, the graph
cache, graph workers, structures without a lattice.
"""

from __future__ import annotations

import ase.io
import datasets
import numpy as np
import pytest
from ase import Atoms
from ase.build import bulk
from ase.neighborlist import neighbor_list

from accel_common.errors import DataError
from recipes.crystal.data import knn_graph, load_graphs
from recipes.crystal.example import random_crystal
from tests.recipes.crystal.helpers import edge_multiset, labelled_frames


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


def test_non_periodic_with_icomformer_names_the_molecule_not_the_learning_rate(tmp_path):
    """Issue 43: --non-periodic with iComformer (the default) trained to NaN at step 1 with advice
    to lower --lr: a molecule's lattice vectors are zeros, and iComformer's edges attend over
    them. Refused naming the frame and --model eComformer, which trains on them."""
    import recipes.train_crystal as recipe
    from accel_common.recipe_cli.entry import train_in_python
    from tests.processes import CRYSTAL, CRYSTAL_TINY

    frames = [random_crystal(np.random.default_rng(seed)) for seed in range(19)]
    frames.insert(3, Atoms("Cu2", positions=[[0, 0, 0], [0, 0, 2.3]]))
    for atoms in frames:
        atoms.info["y"] = float(len(atoms))
    path = tmp_path / "mixed.extxyz"
    ase.io.write(path, frames, format="extxyz")
    argv = ["--data", str(path), "--target", "y", "--non-periodic", "--no-cache-graphs"]
    argv += [*CRYSTAL_TINY, "--bs", "4", "--max-steps", "1", "--output-dir", str(tmp_path / "r")]
    with pytest.raises(DataError) as refused:
        train_in_python(recipe.train, argv, tmp_path / "r", script=CRYSTAL)
    message = str(refused.value)
    assert message.startswith(f"{path}, frame 3: a molecule") and "--lr" not in message
    assert "--model eComformer" in message
    metrics, _ = train_in_python(
        recipe.train, [*argv, "--model", "eComformer"], tmp_path / "r", script=CRYSTAL
    )
    assert np.isfinite(metrics["train_loss"])
