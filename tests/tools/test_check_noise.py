"""`accel-recipes check` explains its rows 2 processes = 1 (a) and FSDP = plain (g), and finds
the tensors whose true gradient is zero by itself (issue 57): on synthetic runs (exported
weights and losses written as a run writes them, the comparisons the promises make) and on a
test recipe with attention and a one-channel GroupNorm, whose real 1- and 2-process runs the
check makes; a recipe that skips one process's batch still fails, naming its worst tensors."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from accel_common.tools.check.noise import Bounds, named, over, rounding_noise
from accel_common.tools.check.promises import HELD, NOT_HELD, fsdp_equals_plain
from accel_common.tools.check.promises import two_processes_equal_one as row_a
from tests.processes import REPO
from tests.tools.test_check import check, rows

ATTENTION = REPO / "tests" / "fixtures" / "check_recipes" / "train_attention.py"
# the fixture's tensors whose true gradient is zero: the key bias (softmax ignores a shift of
# every key) and the biases that only add a constant per channel, which the GroupNorm of one
# channel per group removes (value and output biases of the attention, the projection's)
ZERO_GRADIENT = ["attention.to_k.bias", "attention.to_v.bias", "attention.to_out.bias", "proj.bias"]


def test_a_tensor_moved_far_more_than_the_median_by_sum_order_alone_is_noise():
    real = {f"layer{i}.weight": 1e-7 * (1 + i % 3) for i in range(10)}
    spread = real | {"attn.to_k.bias": 3.7e-5, "proj.bias": 5.5e-3}
    assert rounding_noise(spread, 1e-5) == {"attn.to_k.bias": 3.7e-5, "proj.bias": 5.5e-3}
    # halves that are another computation (BatchNorm over each half) move every tensor alike
    assert rounding_noise({k: 1e-2 * (1 + i % 3) for i, k in enumerate(spread)}, 1e-5) == {}
    # bit-equal halves: only a spread FLOOR could not cover ten-fold is listed
    assert rounding_noise({"w": 0.0, "b": 0.0, "small": 5e-7, "k": 2e-5}, 1e-5) == {"k": 2e-5}
    # two tensors, one of them noise: the lower median is the real one's
    assert rounding_noise({"w": 1e-7, "to_k.bias": 1e-3}, 1e-5) == {"to_k.bias": 1e-3}
    assert rounding_noise({}, 1e-5) == {}


def test_each_tensor_is_held_to_its_bound_and_the_worst_are_named_first():
    bounds = Bounds(1e-5, {"to_k.bias": 2e-3})
    assert bounds.of("w") == 1e-5 and bounds.of("to_k.bias") == pytest.approx(2e-1)
    differences = {"a": 5e-5, "b": 2e-4, "c": 1e-6, "to_k.bias": 1e-2, "d": 3e-5, "e": 2e-5}
    found = over(differences, bounds)
    assert [name for name, _, _ in found] == ["b", "a", "d", "e"]
    assert named(found) == (
        "b 2.0e-04 (bound 1.0e-05), a 5.0e-05 (bound 1.0e-05), d 3.0e-05 (bound 1.0e-05) and 1 more"
    )
    assert over({"to_k.bias": 3e-1}, bounds) == [("to_k.bias", 3e-1, pytest.approx(2e-1))]


def test_a_tensor_of_zeros_compares_without_dividing_by_zero():
    """A bias initialised to zeros and never moved (nn.MultiheadAttention's in_proj_bias can
    be) is equal, not nan; moved from zero it is infinitely far."""
    from accel_common.tools.check.compare import relative_differences

    zero, one = {"b": torch.zeros(4)}, {"b": torch.ones(4)}
    assert relative_differences(zero, {"b": torch.zeros(4)}) == {"b": 0.0}
    assert relative_differences(zero, one) == {"b": float("inf")}
    assert relative_differences(one, zero) == {"b": 1.0}


class Runs:
    """A stand-in for the check's Session: runs named as the promises name them, each a folder
    holding an export and a metrics log as a real run leaves them."""

    def __init__(self, tmp: Path, runs: dict[str, tuple[dict[str, torch.Tensor], list[float]]]):
        self.recipe, self.tmp = SimpleNamespace(noise=()), tmp
        for name, (weights, losses) in runs.items():
            (tmp / name / "model").mkdir(parents=True)
            (tmp / name / "logs").mkdir()
            save_file(weights, str(tmp / name / "model" / "model.safetensors"))
            lines = [json.dumps({"step": i + 1, "train/loss": v}) for i, v in enumerate(losses)]
            (tmp / name / "logs" / "metrics.jsonl").write_text("\n".join(lines) + "\n")

    def run(self, name: str, *extra: str, nproc: int = 1) -> Path:
        return self.tmp / name

    def fsdp(self, name: str) -> tuple[Path, str]:
        return self.tmp / name, "fsdp unit: Block\nfsdp unit: Model\n"


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shapes = {"net.0.weight": (16, 8), "net.0.bias": (16,), "net.2.weight": (1, 16)}
    shapes |= {"attn.to_k.bias": (16,), "net.2.bias": (1,)}
    return {k: torch.randn(shape, generator=generator) for k, shape in shapes.items()}


def moved(
    base: dict[str, torch.Tensor], by: dict[str, float], seed: int
) -> dict[str, torch.Tensor]:
    """`base` with each tensor moved by `by[name]` relative to its norm (a random direction)."""
    generator, out = torch.Generator().manual_seed(seed), {}
    for name, tensor in base.items():
        step = torch.randn(tensor.shape, generator=generator)
        out[name] = tensor + by.get(name, 0.0) * tensor.norm() / step.norm() * step
    return out


LOSSES = [1.0, 0.9, 0.8, 0.7]


def sum_order(relative: float, noise: float) -> dict[str, float]:
    """What another sum order moves: every tensor by `relative`, the key bias by `noise`."""
    return {k: relative for k in weights()} | {"attn.to_k.bias": noise}


def test_a_held_row_says_which_criterion_held_and_names_the_noise(tmp_path):
    """The 2-process run as the one-batch run but for the key bias (LR-sized noise); halves
    accumulated otherwise (another computation, BatchNorm-like): held vs one batch, the
    other's numbers on a line of their own without bounds, the key bias named as noise."""
    base = weights()
    runs = Runs(tmp_path, {
        "single": (base, LOSSES),
        "halves": (moved(base, sum_order(2e-7, 3e-3), 1), LOSSES),
        "double": (moved(base, sum_order(3e-7, 4e-3), 2), LOSSES),
        "fsdp": (moved(moved(base, sum_order(3e-7, 4e-3), 2), sum_order(1e-7, 2e-3), 3), LOSSES),
    })  # fmt: skip
    outcome = row_a(runs)
    assert outcome.status == HELD, outcome
    first, second, noise = outcome.measured.splitlines()
    assert first.startswith("held vs one batch: weights 3.0e-07 (bound 1.0e-05), losses 0.0e+00")
    assert second.startswith("(either suffices) vs accumulated halves: weights ")
    assert "bound" not in second
    assert (
        noise.startswith("rounding noise (zero true gradient; ")
        and "attn.to_k.bias 4.0e-03" in noise
    )
    assert outcome.why == ""
    fsdp = fsdp_equals_plain(runs)
    assert fsdp.status == HELD, fsdp
    assert fsdp.measured.startswith("2 FSDP units; vs DDP: weights 1.0e-07 (bound 1.0e-05)")
    assert "attn.to_k.bias 2.0e-03 (bound 3.0e-01)" in fsdp.measured


def test_a_row_held_by_the_accumulated_halves_puts_the_one_batch_numbers_second(tmp_path):
    base = weights()
    halves = moved(base, {k: 5e-3 for k in base}, 1)  # BatchNorm over halves: no sum order
    runs = Runs(tmp_path, {
        "single": (base, LOSSES),
        "halves": (halves, [v * 1.01 for v in LOSSES]),
        "double": (halves, [v * 1.01 for v in LOSSES]),
    })  # fmt: skip
    outcome = row_a(runs)
    assert outcome.status == HELD, outcome
    first, second = outcome.measured.splitlines()
    assert first == (
        "held vs accumulated halves: weights 0.0e+00 (bound 1.0e-05), "
        "losses 0.0e+00 (bound 1.0e-05)"
    )
    assert second == "(either suffices) vs one batch: weights 5.0e-03, losses 1.0e-02"


def test_a_real_fault_fails_naming_its_worst_tensors_under_either_criterion(tmp_path):
    """One process's batch skipped: every tensor moves at 1e-2. The key bias is still noise
    (found on the 1-process runs, which the fault does not touch), the others fail."""
    base = weights()
    fault = {k: 1e-2 * (i + 1) for i, k in enumerate(base)} | {"attn.to_k.bias": 4e-3}
    runs = Runs(tmp_path, {
        "single": (base, LOSSES),
        "halves": (moved(base, sum_order(2e-7, 3e-3), 1), LOSSES),
        "double": (moved(base, fault, 2), [v * 1.3 for v in LOSSES]),
        "fsdp": (moved(base, sum_order(3e-7, 4e-3), 3), LOSSES),
    })  # fmt: skip
    outcome = row_a(runs)
    assert outcome.status == NOT_HELD, outcome
    assert outcome.measured.splitlines()[0].startswith(
        "vs one batch: weights 5.0e-02 (bound 1.0e-05)"
    )
    why = outcome.why.splitlines()
    assert why[0] == "2 processes trained otherwise than 1 (neither criterion held)"
    assert why[1].startswith(
        "vs one batch: worst tensors net.2.bias 5.0e-02 (bound 1.0e-05), net.2.weight 3.0e-02"
    )
    assert why[1].endswith("and 1 more; the per-step losses differ")
    assert why[2].startswith("vs accumulated halves: worst tensors net.2.bias 5.0e-02")
    assert "attn.to_k.bias" not in outcome.why
    fsdp = fsdp_equals_plain(runs)  # FSDP that trained as the 1-process run, not as DDP
    assert fsdp.status == NOT_HELD
    assert fsdp.why.startswith("FSDP trained otherwise than DDP: worst tensors net.2.bias ")


def test_a_noise_tensor_is_never_held_tighter_than_the_largest_spread_allowed_before(tmp_path):
    """Two noise tensors of spreads 1e-3 and 1.5e-6: the second moved 5e-4 by FSDP (330x its
    own spread; cricket's GNN measured 25x) is held, as it was when every tensor was held to
    twice the largest spread; a tensor that is not noise keeps the tight bound."""
    base = weights()
    spread = {k: 1e-9 for k in base} | {"attn.to_k.bias": 1e-3, "net.2.bias": 1.5e-6}
    double = moved(base, spread, 2)
    for fsdp, status in (({"net.2.bias": 5e-4}, HELD), ({"net.0.weight": 5e-5}, NOT_HELD)):
        runs = Runs(tmp_path / str(status), {
            "single": (base, LOSSES),
            "halves": (moved(base, spread, 1), LOSSES),
            "double": (double, LOSSES),
            "fsdp": (moved(double, fsdp, 3), LOSSES),
        })  # fmt: skip
        assert fsdp_equals_plain(runs).status == status


def test_a_failure_where_the_halves_are_another_computation_says_to_check_in_float64(tmp_path):
    """BatchNorm over halves (the floor above CAP): only one batch can hold, and a ReLU
    network's float32 runs drift from rounding; the row says what to do (issue 57's ResNet)."""
    base = weights()
    runs = Runs(tmp_path, {
        "single": (base, LOSSES),
        "halves": (moved(base, {k: 5e-2 for k in base}, 1), [v * 1.1 for v in LOSSES]),
        "double": (moved(base, {k: 2e-2 for k in base}, 2), [v * 1.05 for v in LOSSES]),
    })  # fmt: skip
    outcome = row_a(runs)
    assert outcome.status == NOT_HELD, outcome
    assert outcome.why.splitlines()[-1].startswith(
        "the halves are another computation (BatchNorm statistics per half)"
    )
    assert "run CHECK_ARGS in float64" in outcome.why


@pytest.mark.slow
def test_attention_and_a_one_channel_groupnorm_hold_with_their_noise_named(tmp_path):
    """The Done-when of issue 57: rows a and g hold on real 1- and 2-process runs (and FSDP)
    without a hand-written CHECK_NOISE, and name the tensors they took for rounding noise;
    before, g held them to 1e-5 and failed (4.1e-03 on proj.bias)."""
    assert "\nCHECK_NOISE = " not in ATTENTION.read_text()  # no declaration of its own
    result = check(tmp_path, str(ATTENTION), "--only", "a,g")
    assert result.returncode == 0, result.stdout + result.stderr
    found = rows(result.stdout)
    assert sorted(found) == ["a", "g"] and all(row[1] == "held" for row in found.values()), found
    assert found["a"][2].startswith("held vs one batch: weights ")
    for row in found.values():
        noise = row[2][row[2].index("rounding noise") :]
        assert all(name in noise for name in ZERO_GRADIENT), row
    assert "accel-recipes check attention: 2 held" in result.stdout


@pytest.mark.slow
def test_a_recipe_that_skips_one_process_batch_still_fails_row_a(tmp_path):
    """The noise found cannot hide a real fault: rank 1's loss zeroed (its batch skipped) moves
    every other tensor at 1e-2, and the row names the worst."""
    text = ATTENTION.read_text()
    line = "loss = F.mse_loss(model(x), y)\n"
    assert text.count(line) == 1
    script = tmp_path / "fault" / ATTENTION.name
    script.parent.mkdir()
    script.write_text(text.replace(line, line[:-1] + " * (accelerator.process_index == 0)\n"))
    result = check(tmp_path, str(script), "--only", "a")
    assert result.returncode == 1, result.stdout + result.stderr
    row = rows(result.stdout)["a"]
    assert row[1] == "not held"
    assert "2 processes trained otherwise than 1 (neither criterion held)" in row[3]
    assert "vs one batch: worst tensors " in row[3] and "(bound 1.0e-05)" in row[3]
    worst = row[3].split("vs one batch: worst tensors ")[1].split(" ")[0]
    assert worst not in ZERO_GRADIENT, row
