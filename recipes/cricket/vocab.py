"""The vocabulary of players, venues and teams: built from the training split's matches,
its sizes (the embeddings' rows), and an imported one keyed as this recipe keys players.
"""

from __future__ import annotations

from typing import Any

import datasets

VOCAB_FILE = "vocab.json"
UNKNOWN = 0  # vocabulary index of names not seen (often enough) in the training split


def build_vocab(parsed: datasets.Dataset, rows: list[int], min_matches: int) -> dict[str, dict]:
    """Players, venues and teams seen in at least `min_matches` training matches, numbered from
    1; everything else (rarer, or only in validation and test) is index 0, the unknown."""
    seen: dict[str, dict[str, set]] = {k: {} for k in ("players", "venues", "teams")}
    columns = ["file", "batter", "non_striker", "bowler", "venue", "batting_team", "bowling_team"]
    for row in parsed.select(rows).select_columns(columns).iter(batch_size=256):
        for i, file in enumerate(row["file"]):
            names = set(row["batter"][i]) | set(row["non_striker"][i]) | set(row["bowler"][i])
            for kind, keys in (
                ("players", names),
                ("venues", {row["venue"][i]}),
                ("teams", {row["batting_team"][i], row["bowling_team"][i]}),
            ):
                for key in keys:
                    seen[kind].setdefault(key, set()).add(file)
    return {
        kind: {
            key: index
            for index, key in enumerate(
                sorted(k for k, files in found.items() if len(files) >= min_matches), start=1
            )
        }
        for kind, found in seen.items()
    }


ENTITIES = ("players", "venues", "teams")


def vocab_sizes(vocab: dict[str, Any]) -> dict[str, int]:
    """Embedding rows (less the unknown's) a vocabulary needs: its highest index of each kind."""
    return {kind: max(vocab[kind].values(), default=0) for kind in ENTITIES}


def keyed_by_registry(vocab: dict[str, Any], registries: list[dict[str, str]]) -> dict[str, Any]:
    """A vocabulary whose players are keyed by name (the original's: `"player_key": "name"`) as
    this recipe keys them, by Cricsheet registry id, through the matches' registries (name ->
    id): their indices and bowling types; the names stay too, for files without a registry.
    Others are returned as they are."""
    if vocab.get("player_key") != "name":
        return vocab
    keyed = dict(vocab, player_key="registry")
    for kind in ("players", "player_bowling_types"):
        by_name = vocab.get(kind, {})
        keyed[kind] = dict(by_name)
        for registry in registries:
            keyed[kind] |= {person: by_name[name] for name, person in registry.items()
                            if name in by_name}  # fmt: skip
    return keyed
