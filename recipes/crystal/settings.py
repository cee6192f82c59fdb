"""The crystal recipe's settings, declared once (`CrystalSettings`: flags, `--config` keys, the
export's config and the resume check). recipes/train_crystal.py, convert.py and
recipes/crystal_api.py all read them, so they live here: the folder never imports the script."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from accel_common import MAX_BLOCKS, ConfigError, Settings, setting
from recipes.crystal.data import TARGET_HELP
from recipes.crystal.model import BATCHNORMS, VARIANTS


@dataclass
class CrystalSettings(Settings):
    """The workload's settings: each is a flag, a `--config` key and, unless adjustable, part of
    the run's identity that --resume checks."""

    target: str = setting("energy_per_atom", f"Target: {TARGET_HELP}.")
    per_atom: bool = setting(False, "Divide the target by the number of atoms.")
    index: str = setting(
        ":", "Frames to read, as ASE takes it: ':', ':1000', '::10', or one frame: '5'."
    )
    cutoff: float = setting(
        5.0,
        "Neighbour search radius in angstrom; widened until every atom has enough (6).",
        min=0.5,
    )
    max_neighbors: int = setting(
        8, "Nearest neighbours per atom, ties at the last distance kept (25).", min=1
    )
    non_periodic: bool = setting(False, "Accept non-periodic structures (molecules).")
    train_ratio: float = setting(0.8, "Share for training.", min=0.01, max=0.98)
    val_ratio: float = setting(0.1, "Share for validation.", min=0.01, max=0.98)
    test_ratio: float = setting(0.1, "Share for testing.", min=0.01, max=0.98)
    split_seed: int = setting(
        123,
        "Seed of the train/val/test split, ComFormer's procedure (Python's random.shuffle of the "
        "frame indices in file order): the original's structures in each split for its seed.",
    )
    model: str = setting(
        "iComformer",
        "The original's network: iComformer, or eComformer (equivariant, e3nn; its preset: "
        "configs/original_ecomformer.yaml, 3 layers).",
    )
    width: int = setting(16, "Node and edge feature width: node_features (256).", min=8)
    layers: int = setting(4, "Node convolutions: conv_layers (4).", min=1, max=MAX_BLOCKS)
    heads: int = setting(1, "Attention heads per convolution: node_layer_head (1).", min=1)
    rbf_bins: int = setting(
        64, "RBF centres of -0.75/|r| and the lattice lengths: edge_features (256).", min=2
    )
    angle_bins: int = setting(
        64,
        "RBF centres of the edge-lattice cosines: triplet_input_features (256; unused by "
        "eComformer, as there).",
        min=2,
    )
    fc_features: int = setting(16, "Width of the MLP after pooling: fc_features (256).", min=1)
    batchnorm: str = setting(
        "float64",
        "BatchNorm in training: float64 (statistics summed in float64, the same steps on 1 and N "
        "processes), or torch (torch's BatchNorm1d as the original's, its step bit for bit; "
        "the presets' choice; on N processes --sync-batchnorm makes it SyncBatchNorm on GPUs).",
    )
    sync_batchnorm: bool = setting(
        True,
        "BatchNorm statistics of the whole global batch, so that N processes take one process's "
        "steps; --no-sync-batchnorm: each process's own, as plain DDP does (one all-reduce fewer "
        "per BatchNorm, forward and backward: faster where collectives are slow, not exact).",
    )
    init_from: Path | None = setting(
        None,
        "Start from the weights of an export (a ComFormer best_model.pt converted with "
        "`accel-recipes convert --from comformer`); its network settings must be these.",
    )
    cache_graphs: bool = setting(
        True,
        "Keep the built graphs on disk for later runs.",
        adjustable=True,
    )
    graph_cache_dir: Path | None = setting(
        None,
        "Folder of the graph cache (default: under the Hugging Face datasets cache).",
        adjustable=True,
    )

    def validate(self) -> None:
        super().validate()
        if not math.isclose(self.train_ratio + self.val_ratio + self.test_ratio, 1, abs_tol=1e-6):
            raise ConfigError("--train-ratio, --val-ratio and --test-ratio must sum to 1")
        if self.model not in VARIANTS:
            raise ConfigError(f"--model {self.model}: this recipe builds {', '.join(VARIANTS)}")
        if self.batchnorm not in BATCHNORMS:
            raise ConfigError(f"--batchnorm {self.batchnorm}: one of {', '.join(BATCHNORMS)}")
