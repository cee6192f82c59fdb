"""A second shape of training, ported: node classification on one big graph by neighbour sampling.

The script it comes from (docs/porting.md, "A second shape") trains GraphSAGE on the nodes of one
graph: its dataset is a list of node ids, a collate function samples each batch's neighbourhood
(two hops, `--fanouts 10,5`) into a subgraph, the model classifies the batch's nodes, and the
evaluation is one forward pass over the whole graph, not a loop over a test loader. It keeps an
EMA of the weights. What changes from the template's shape:

- the data is one file (graph.npz: features, labels, edges, split), and the training "dataset"
  is the training nodes' ids; `args.make_train_loader(ids, plan, collate_fn=sample)` batches and
  shards the ids, and the collate function builds each batch's subgraph;
- the subgraph is drawn from a generator seeded by (seed, epoch, the batch's nodes), so a resume
  draws the same subgraphs;
- a seed's subgraph depends on the other seeds of its batch (their neighbours are shared), so a
  2-process run, whose batches hold other seeds, cannot equal the 1-process run: CHECK_WAIVE
  says so, and `accel-recipes check` shows row a waived with that reason;
- `--ema-decay` (every recipe has it) averages the weights; `loop.ema.applied()` is where they
  are scored, and the export holds them.

    python examples/train_graph.py --ema-decay 0.99
    accel-recipes check examples/train_graph.py --only a,c

Why the sampling is hand-written: PyG's NeighborLoader needs pyg-lib or torch-sparse, compiled
extensions that have no wheels for this project's torch; the model is PyG's SAGEConv.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import typer
from accelerate import Accelerator
from torch import nn
from torch_geometric.nn import SAGEConv

from accel_common import (
    Settings,
    SharedSettings,
    format_metrics,
    load_exported,
    model_option,
    read_recipe_export,
    run_recipe,
    setting,
    train_command,
)
from accel_common.data import existing_data, named_files, resolve_data

RECIPE = "graph"
FEATURES, CLASSES = 16, 4
CHECK_ARGS = ["--hidden", "16", "--bs", "32", "--fanouts", "4,2"]
CHECK_DATA = {"nodes": 400}
CHECK_COMMAND = ["evaluate", "--model", "{model}", "--data", "{data}"]
CHECK_RESUME = ["--ema-decay", "0.9"]  # the EMA a resume must restore, with the sampling's draws
CHECK_WAIVE = {
    "a": "neighbour sampling: a node's subgraph shares the neighbours of its batch-mates, and "
    "2 processes give it other batch-mates than 1 does",
}
SPLITS = {"train": 0, "val": 1, "test": 2}


# --------------------------------------------------------------------------- data


def write_dataset(out_dir: Path, *, nodes: int = 3000, seed: int = 0) -> Path:
    """graph.npz: a graph of CLASSES communities (most edges inside one), features around each
    community's centre, and a 60/20/20 split of the nodes."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    y = rng.integers(0, CLASSES, nodes)
    centres = rng.normal(size=(CLASSES, FEATURES))
    x = centres[y] + 2.0 * rng.normal(size=(nodes, FEATURES))  # a node alone is ambiguous
    source = rng.integers(0, nodes, 8 * nodes)
    same = rng.random(8 * nodes) < 0.8
    peers = [np.flatnonzero(y == c) for c in range(CLASSES)]
    target = np.where(
        same, [rng.choice(peers[c]) for c in y[source]], rng.integers(0, nodes, 8 * nodes)
    )
    edges = np.unique(np.concatenate([[source, target], [target, source]], axis=1), axis=1)
    split = rng.choice(3, nodes, p=[0.6, 0.2, 0.2]).astype(np.int8)
    np.savez(out_dir / "graph.npz", x=x.astype(np.float32), y=y, edges=edges, split=split)
    return out_dir


@dataclass
class Graph:
    x: torch.Tensor
    y: torch.Tensor
    edges: torch.Tensor  # (2, E): source -> target, both directions
    split: torch.Tensor
    starts: torch.Tensor  # CSR over targets: the sources of node v are neighbours[starts[v]:...]
    neighbours: torch.Tensor

    def nodes(self, split: str) -> torch.Tensor:
        return torch.nonzero(self.split == SPLITS[split]).flatten()


def load_graph(data_dir: Path) -> Graph:
    with np.load(data_dir / "graph.npz", allow_pickle=False) as arrays:
        x, y, edges, split = (torch.from_numpy(arrays[k]) for k in ("x", "y", "edges", "split"))
    order = torch.argsort(edges[1], stable=True)
    counts = torch.bincount(edges[1], minlength=len(x))
    starts = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    return Graph(x, y.long(), edges, split, starts, edges[0][order])


class SampleNeighbours:
    """The collate function: a batch of node ids -> (features, edges, labels) of its sampled
    subgraph, the batch's nodes first. Each hop draws up to `fanout` neighbours of every node
    reached so far, from a generator seeded by (seed, epoch, the batch's nodes)."""

    def __init__(self, graph: Graph, fanouts: tuple[int, ...], seed: int) -> None:
        self.graph, self.fanouts, self.seed, self.epoch = graph, fanouts, seed, 0

    def set_epoch(self, epoch: int) -> None:  # the loop calls it before each epoch
        self.epoch = epoch

    def __call__(self, ids: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        seeds = torch.stack(ids)
        entropy = [self.seed, self.epoch, *seeds.tolist()]
        state = np.random.SeedSequence(entropy).generate_state(1, np.uint64)[0]
        generator = torch.Generator().manual_seed(int(state))
        g, order, frontier, sources, targets = self.graph, seeds.tolist(), seeds.tolist(), [], []
        index = {int(v): i for i, v in enumerate(order)}
        for fanout in self.fanouts:
            reached = []
            for v in frontier:
                candidates = g.neighbours[g.starts[v] : g.starts[v + 1]]
                pick = torch.randperm(len(candidates), generator=generator)[:fanout]
                for u in candidates[pick].tolist():
                    if u not in index:
                        index[u] = len(order)
                        order.append(u)
                        reached.append(u)
                    sources.append(index[u])
                    targets.append(index[v])
            frontier = reached
        nodes = torch.tensor(order)
        edges = torch.tensor([sources, targets], dtype=torch.long).reshape(2, -1)
        return g.x[nodes], edges, g.y[seeds]


# --------------------------------------------------------------------------- model


@dataclass
class GraphSettings(Settings):
    hidden: int = setting(64, "Width of the GraphSAGE layers.", min=1)
    fanouts: tuple[int, ...] = setting(
        (10, 5), "Neighbours sampled per node at each hop (one per layer).", min=1
    )


class GraphSAGE(nn.Module):
    def __init__(self, features: int, hidden: int, classes: int, layers: int) -> None:
        super().__init__()
        widths = [features, *[hidden] * (layers - 1), classes]
        self.convs = nn.ModuleList(SAGEConv(a, b) for a, b in itertools.pairwise(widths))

    def forward(self, x: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
        for i, conv in enumerate(self.convs):
            x = conv(x, edges)
            if i < len(self.convs) - 1:
                x = F.relu(x)
        return x


def build_model(args: SharedSettings, settings: GraphSettings) -> GraphSAGE:
    """The network for `--dry-run` (built on the meta device: the graph is read with numpy)."""
    features = FEATURES
    if args.data is not None:
        with np.load(existing_data(RECIPE, args.data) / "graph.npz") as arrays:
            features = arrays["x"].shape[1]
    return GraphSAGE(features, settings.hidden, CLASSES, len(settings.fanouts))


# --------------------------------------------------------------------------- quality


@torch.no_grad()
def evaluate(model: nn.Module, graph: Graph, split: str) -> dict[str, float]:
    """Accuracy on `split`'s nodes from one forward pass over the whole graph (the same on every
    process: no loader, nothing to gather), against predicting the training split's majority."""
    model.eval()
    device = next(model.parameters()).device
    predicted = model(graph.x.to(device), graph.edges.to(device)).argmax(1).cpu()
    model.train()
    nodes = graph.nodes(split)
    majority = torch.bincount(graph.y[graph.nodes("train")]).argmax()
    accuracy = (predicted[nodes] == graph.y[nodes]).float().mean().item()
    baseline = (graph.y[nodes] == majority).float().mean().item()
    return {f"{split}_accuracy": accuracy, "majority_accuracy": baseline}


# --------------------------------------------------------------------------- training


@train_command(
    GraphSettings,
    build_model=build_model,
    default_bs=64,
    lr=3e-3,
    ref_bs=64,
    epochs=10,
    schedule="constant",  # the original's: a constant LR at its batch
    lr_scaling="none",
    output_dir=Path("runs/graph"),
)
def train(args: SharedSettings, settings: GraphSettings) -> dict[str, float]:
    """Train GraphSAGE on one graph's nodes by neighbour sampling (or a generated example)."""
    accelerator, plan = args.make_accelerator()
    data_dir = resolve_data(accelerator, RECIPE, args.data, write_dataset)
    graph = load_graph(data_dir)
    model = GraphSAGE(graph.x.shape[1], settings.hidden, CLASSES, len(settings.fanouts))
    optimizer = args.make_optimizer(torch.optim.Adam, model.parameters(), lr=args.lr)
    sample = SampleNeighbours(graph, settings.fanouts, args.seed)
    ids = graph.nodes("train")  # the "dataset": node ids, sharded and batched as any
    train_loader = args.make_train_loader(ids, plan, collate_fn=sample)
    model, optimizer, train_loader = accelerator.prepare(model, optimizer, train_loader)
    schedule = args.make_lr_schedule(accelerator, optimizer, plan, len(train_loader))
    loop = args.make_loop(
        accelerator, plan, train_loader, schedule, model=model, recipe=RECIPE,
        data_files=named_files([data_dir / "graph.npz"], data_dir), settings=settings,
    )  # fmt: skip
    for _epoch in loop.epochs():
        sample.set_epoch(_epoch)
        for x, edges, y in loop.batches():
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(x, edges)[: len(y)], y)  # the batch's nodes first
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            loop.record(loss)
        with loop.ema.applied():  # the EMA's weights with --ema-decay: scored and exported
            loop.end_epoch(evaluate(model, graph, "val"))
    return loop.finish(model)


def evaluate_export(
    model_dir: Path = model_option(RECIPE),
    data: Path = typer.Option(Path("data/example/graph"), "--data", help="Folder of graph.npz."),
    split: str = typer.Option("test", help="Which nodes to score: train, val or test."),
) -> None:
    """Load an exported model on one device and score a split's nodes against the majority."""
    settings = GraphSettings.from_config(read_recipe_export(model_dir, RECIPE))
    graph = load_graph(data)
    model = GraphSAGE(graph.x.shape[1], settings.hidden, CLASSES, len(settings.fanouts))
    load_exported(model_dir, model)
    model = Accelerator(cpu=True).prepare(model)
    print(format_metrics(evaluate(model, graph, split)))


if __name__ == "__main__":
    run_recipe(train, evaluate=evaluate_export)
