"""The heterogeneous graph of one delivery as cricketmodel (lyndonkl/cricketmodel @a97d68e,
src/data/edge_builder.py and hetero_data_builder.py) defines it: 21 node types, their input
widths, and the edge types with the convolution each one gets (src/model/conv_builder.py).

One graph is the state before one delivery: 19 context node types of one node each (entities,
match state, actor state, dynamics), one `ball` node per earlier delivery of the innings, and
the `query` node that is read out. The names here are the original's, so state dicts map one to
one. The network is in recipes/cricket/model.py, the graphs themselves in graphs.py.
"""

from __future__ import annotations

LAYER_NODES = {
    "global": ["venue", "batting_team", "bowling_team"],
    "state": ["score_state", "chase_state", "phase_state", "time_pressure", "wicket_buffer"],
    "actor": [
        "striker_identity",
        "striker_state",
        "nonstriker_identity",
        "nonstriker_state",
        "bowler_identity",
        "bowler_state",
        "partnership",
    ],
    "dynamics": ["batting_momentum", "bowling_momentum", "pressure_index", "dot_pressure"],
}
ENTITY_NODES = ["venue", "batting_team", "bowling_team"]
PLAYER_NODES = ["striker_identity", "nonstriker_identity", "bowler_identity"]
# input width of each numeric context node, in the original's encoder order (encoders.py)
FEATURE_DIMS = {
    "score_state": 5, "chase_state": 7, "phase_state": 6, "time_pressure": 3, "wicket_buffer": 2,
    "striker_state": 8, "nonstriker_state": 8, "bowler_state": 8, "partnership": 4,
    "batting_momentum": 1, "bowling_momentum": 1, "pressure_index": 1, "dot_pressure": 5,
}  # fmt: skip
BALL_FEATURE_DIM = 18
NODE_TYPES = [
    "venue", "batting_team", "bowling_team",
    "striker_identity", "nonstriker_identity", "bowler_identity",
    "score_state", "chase_state", "phase_state", "time_pressure", "wicket_buffer",
    "striker_state", "nonstriker_state", "bowler_state", "partnership",
    "batting_momentum", "bowling_momentum", "pressure_index", "dot_pressure",
    "ball", "query",
]  # fmt: skip
CONTEXT_NODES = [*LAYER_NODES["global"], *LAYER_NODES["state"], *LAYER_NODES["actor"]]
CONTEXT_NODES += LAYER_NODES["dynamics"]
NUM_ROLES = 8  # unknown, opener, top_order, middle_order, finisher, bowler, allrounder, keeper

# one-node-to-one-node edges between the context nodes
HIERARCHICAL = [
    *[(g, s) for g in LAYER_NODES["global"] for s in LAYER_NODES["state"]],
    *[(s, a) for s in LAYER_NODES["state"] for a in LAYER_NODES["actor"]],
    *[(a, d) for a in LAYER_NODES["actor"] for d in LAYER_NODES["dynamics"]],
]
INTRA_GLOBAL = [
    ("venue", "batting_team"), ("venue", "bowling_team"), ("batting_team", "bowling_team"),
]  # fmt: skip
INTRA_STATE = [
    ("score_state", "chase_state"), ("score_state", "phase_state"),
    ("score_state", "time_pressure"), ("score_state", "wicket_buffer"),
    ("chase_state", "time_pressure"), ("phase_state", "time_pressure"),
    ("time_pressure", "wicket_buffer"),
]  # fmt: skip
INTRA_ACTOR = [
    ("striker_identity", "striker_state"), ("nonstriker_identity", "nonstriker_state"),
    ("bowler_identity", "bowler_state"), ("striker_identity", "bowler_identity"),
    ("nonstriker_identity", "bowler_identity"), ("striker_identity", "nonstriker_identity"),
    ("striker_state", "partnership"), ("nonstriker_state", "partnership"),
    ("bowler_state", "partnership"), ("striker_identity", "partnership"),
    ("nonstriker_identity", "partnership"),
]  # fmt: skip
INTRA_DYNAMICS = [
    ("batting_momentum", "bowling_momentum"), ("batting_momentum", "pressure_index"),
    ("bowling_momentum", "pressure_index"), ("pressure_index", "dot_pressure"),
]  # fmt: skip


def _both(pairs: list[tuple[str, str]], rel: str) -> list[tuple[str, str, str]]:
    return [e for s, t in pairs for e in ((s, rel, t), (t, rel, s))]


STATIC_EDGES = (
    [(s, "conditions", t) for s, t in HIERARCHICAL]
    + _both(INTRA_GLOBAL, "relates_to")
    + _both(INTRA_STATE, "relates_to")
    + _both(INTRA_ACTOR, "matchup")
    + _both(INTRA_DYNAMICS, "relates_to")
    + [(n, "attends", "query") for n in CONTEXT_NODES]
    + [(d, "drives", "query") for d in LAYER_NODES["dynamics"]]
)
BALL_RELATIONS = [
    "recent_precedes", "medium_precedes", "distant_precedes",
    "same_bowler", "same_batsman", "same_matchup", "same_over",
]  # fmt: skip
BALL_EDGES = [("ball", rel, "ball") for rel in BALL_RELATIONS]
CROSS_EDGES = [
    ("ball", "faced_by", "striker_identity"),
    ("ball", "partnered_by", "nonstriker_identity"),
    ("ball", "bowled_by", "bowler_identity"),
    *[("ball", "informs", d) for d in LAYER_NODES["dynamics"]],
    ("ball", "attends", "query"),
]
# every edge type, sorted as the original's get_all_edge_types() returns them (the HeteroConv
# order, and so the order of the state dict)
EDGE_TYPES = sorted(set(STATIC_EDGES + BALL_EDGES + CROSS_EDGES))
# the ball-to-ball relations that carry a 1-wide edge attribute (a distance or a position)
ATTR_RELATIONS = {
    "recent_precedes", "medium_precedes", "distant_precedes",
    "same_bowler", "same_batsman", "same_over",
}  # fmt: skip
# the convolution of each relation (conv_builder.py build_hetero_conv): GATv2 unless named here
TRANSFORMER_RELATIONS = {
    "recent_precedes", "medium_precedes", "same_bowler", "same_batsman", "same_over",
}  # fmt: skip
SAGE_RELATIONS = {"distant_precedes"}
