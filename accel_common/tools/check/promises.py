"""The promises `accel-recipes check` holds a recipe to, one function each: each returns an
Outcome (held, not held or skipped, with the numbers measured).

Bounds. 2 processes compute the same per-sample gradients as 1 at the same global batch; only
the order of floating-point sums differs, ~1e-7 relative per step, which AdamW magnifies in
tensors whose gradients are tiny (biases near zero, those a normalisation cancels). So the
2-process run may be no further from the 1-process run than one process accumulating the same
two halves is (its distance is the sum-order floor): at most 2 x floor + 1e-6, and never held
to less than 1e-5 (the template's bound in tests/test_distributed.py). A real difference (a
wrong batch split, a gradient not averaged, a scheduler stepped twice) shows at 1e-2 or more.
FSDP reduce-scatters where DDP all-reduces: held to the same bound against the 2-process run.
The tensors whose true gradient is zero are found by their own sum-order spread and held to it
(noise.py); the floor is that of the others. A row says which criterion held, or names the
tensors furthest over their bounds.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from accel_common.conversion.convert import convert_checkpoint
from accel_common.tools.check.compare import (
    exported_params,
    max_relative_step_difference,
    parse_plan,
    per_step,
    plan_differences,
    relative_differences,
)
from accel_common.tools.check.noise import Bounds, largest, named, noise_line, over, rounding_noise
from accel_common.tools.check.opened import data_files_read
from accel_common.tools.check.processes import failure_line
from accel_common.tools.check.session import AUDIT, SHORT, STEPS, Session

HELD, NOT_HELD, SKIPPED, WAIVED = "held", "not held", "skipped", "waived"
FLOOR = 1e-5  # the least any comparison is held to (test_distributed's bound)


@dataclass
class Outcome:
    status: str
    measured: str = ""
    why: str = ""


CAP = 1e-3  # a sum-order floor above this is another computation (BatchNorm over halves)


def bound(floor: float) -> float:
    """What a comparison with the one-batch run is held to: twice the sum-order floor, unless
    that floor is no sum order at all (then only FLOOR)."""
    return max(FLOOR, 2 * floor + 1e-6) if floor <= CAP else FLOOR


def weights_of(session: Session, run: Path) -> dict[str, torch.Tensor]:
    """A run's exported weights but the tensors the recipe declares rounding noise
    (CHECK_NOISE: the names ending so)."""
    noise = session.recipe.noise
    return {k: v for k, v in exported_params(run).items() if not k.endswith(noise or ("\0",))}


def floats(session: Session, run: Path) -> dict[str, torch.Tensor]:
    """The floating-point weights (counters of forward passes, BatchNorm's
    num_batches_tracked, double with accumulation by design)."""
    return {k: v for k, v in weights_of(session, run).items() if v.is_floating_point()}


@dataclass(frozen=True)
class Floor:
    """How far the sum order alone moves the 1-process run: the tensors their own spread marks
    rounding noise (with it: noise.py), the largest spread of the others, and of the per-step
    losses."""

    noise: dict[str, float]
    weights: float
    losses: float

    def bounds(self) -> Bounds:
        """What a comparison with the one-batch run is held to, tensor by tensor."""
        return Bounds(bound(self.weights), self.noise, bound(max(self.noise.values(), default=0)))


def sum_order_floor(session: Session) -> Floor:
    """One process at the global batch against one accumulating its two halves."""
    single, halves = session.run("single"), session.run("halves", "--grad-accum", "2")
    spread = relative_differences(floats(session, single), floats(session, halves))
    noise = rounding_noise(spread, FLOOR)
    weights = max((s for k, s in spread.items() if k not in noise), default=0.0)
    return Floor(noise, weights, max_relative_step_difference(per_step(single), per_step(halves)))


def criterion(weights: float, losses: float, bounds: tuple[float, float] | None) -> str:
    """`weights W (bound B), losses L (bound B)`, or without the bounds (a criterion not
    needed: its numbers may exceed them, which must not read like a failure)."""
    if bounds is None:
        return f"weights {weights:.1e}, losses {losses:.1e}"
    weights_bound, losses_bound = bounds
    return (
        f"weights {weights:.1e} (bound {weights_bound:.1e}), "
        f"losses {losses:.1e} (bound {losses_bound:.1e})"
    )


def failed(name: str, differences: dict[str, float], bounds: Bounds, losses: bool) -> str:
    """What a criterion that did not hold found: its worst tensors, or that the losses differ."""
    tensors = over(differences, bounds)
    found = [f"worst tensors {named(tensors)}"] if tensors else []
    found += ["the per-step losses differ"] if losses else []
    return f"{name}: {'; '.join(found)}"


def two_processes_equal_one(session: Session) -> Outcome:
    """a. 2 processes (gloo) at the same global batch: the same per-step loss and weights as 1
    process, on one batch (within twice the sum order's effect) or accumulating the same two
    halves (within FLOOR: the same sums, in the same micro-batches); the tensors found to be
    rounding noise each within NOISE_FACTOR times their own sum-order spread (noise.py)."""
    floor = sum_order_floor(session)
    single, halves = session.run("single"), session.run("halves", "--grad-accum", "2")
    double = session.run("double", nproc=2)
    batch_bounds, halves_bounds = floor.bounds(), Bounds(FLOOR, floor.noise)
    by_batch = relative_differences(floats(session, single), floats(session, double))
    by_halves = relative_differences(floats(session, halves), floats(session, double))
    losses = max_relative_step_difference(per_step(single), per_step(double))
    losses_halves = max_relative_step_difference(per_step(halves), per_step(double))
    loss_bound = bound(floor.losses)
    batch_losses, halves_losses = losses > loss_bound, losses_halves > FLOOR
    one_batch = not over(by_batch, batch_bounds) and not batch_losses
    accumulated = not over(by_halves, halves_bounds) and not halves_losses
    batch = ("vs one batch", largest(by_batch, batch_bounds), losses)
    split = ("vs accumulated halves", largest(by_halves, halves_bounds), losses_halves)
    limits = {batch[0]: (batch_bounds.default, loss_bound), split[0]: (FLOOR, FLOOR)}
    if one_batch or accumulated:  # either suffices: the one that held first, the other after
        held, other = (batch, split) if one_batch else (split, batch)
        lines = [
            f"held {held[0]}: {criterion(*held[1:], limits[held[0]])}",
            f"(either suffices) {other[0]}: {criterion(*other[1:], None)}",
        ]
        noise = noise_line(*((by_batch, batch_bounds) if one_batch else (by_halves, halves_bounds)))
        return Outcome(HELD, "\n".join(filter(None, [*lines, noise])))
    lines = [f"{name}: {criterion(w, loss, limits[name])}" for name, w, loss in (batch, split)]
    why = [
        "2 processes trained otherwise than 1 (neither criterion held)",
        failed(batch[0], by_batch, batch_bounds, batch_losses),
        failed(split[0], by_halves, halves_bounds, halves_losses),
    ]
    if floor.weights > CAP:  # the halves are another computation: BatchNorm over each half
        why.append(
            "the halves are another computation (BatchNorm statistics per half), so only one "
            "batch can hold; a ReLU network's float32 runs drift apart from rounding alone: "
            "run CHECK_ARGS in float64 (docs/porting.md, 'A BatchNorm network')"
        )
    noise = noise_line(by_batch, batch_bounds)
    return Outcome(NOT_HELD, "\n".join(filter(None, [*lines, noise])), "\n".join(why))


def resume_is_exact(session: Session) -> Outcome:
    """b. kill -9 after a checkpoint, then --resume latest: the export bit for bit, with what
    CHECK_RESUME turns back on (dropout, augmentation, EMA) that a resume must restore."""
    extra = session.recipe.resume_args[len(session.recipe.args) :]
    full = exported_params(session.run("resumable", *extra) if extra else session.run("single"))
    killed, latest = session.killed_and_resumed(*extra)
    resumed = exported_params(killed)
    if full.keys() != resumed.keys():
        return Outcome(NOT_HELD, "", "the resumed export has other tensors")
    differ = [k for k in full if not full[k].equal(resumed[k])]
    measured = f"killed after step {latest}; {len(differ)} of {len(full)} tensors differ"
    if differ:
        return Outcome(NOT_HELD, measured, f"not bit-equal, e.g. {differ[0]}")
    return Outcome(HELD, measured)


def dry_run_is_the_run(session: Session) -> Outcome:
    """c. --dry-run prints what the run uses: parameters, batch plan, LR line, steps."""
    single = session.run("single")
    result = session.process([*session.flags("--output-dir", str(single)), "--dry-run"])
    plan = parse_plan(result.stdout)
    if result.returncode != 0 or plan is None:
        line = failure_line(result.stderr) if result.returncode else "it printed no plan"
        return Outcome(NOT_HELD, "", f"the dry run failed (exit {result.returncode}): {line}")
    export = json.loads((single / "model" / "model.json").read_text())
    found = plan_differences(plan, export, STEPS)
    measured = f"parameters {plan.get('parameters')}, {plan.get('batch')}"
    if found:
        return Outcome(NOT_HELD, measured, "; ".join(found))
    return Outcome(HELD, measured)


def data_files_are_declared(session: Session) -> Outcome:
    """d. The files the run opens are its `data_files`, no more, no fewer."""
    out, record = session.tmp / "runs" / "audit", session.tmp / "opened.json"
    args = [str(record), str(session.recipe.script), *session.flags("--output-dir", str(out))]
    # a cache of its own: a table the other runs prepared would spare it reading the data
    result = session.process(args, script=AUDIT, hf=session.tmp / "hf-audit")
    if result.returncode != 0 or not record.is_file():
        return Outcome(NOT_HELD, "", f"the run failed (exit {result.returncode})")
    files = json.loads(record.read_text())
    caches = [out, session.tmp / "hf", session.tmp / "hf-audit"]
    opened = data_files_read(files["opened"], session.example(), caches)
    declared = {Path(p) for p in files["declared"]}
    data = session.example()

    def name(paths: set[Path]) -> str:
        return ", ".join(
            sorted(str(p.relative_to(data) if p.is_relative_to(data) else p) for p in paths)[:3]
        )

    measured = f"{len(opened)} opened, {len(declared)} declared"
    if not opened:
        return Outcome(NOT_HELD, measured, "the run opened no file under its data")
    if opened - declared:
        return Outcome(NOT_HELD, measured, f"read, not declared: {name(opened - declared)}")
    if declared - opened:
        return Outcome(NOT_HELD, measured, f"declared, not read: {name(declared - opened)}")
    return Outcome(HELD, measured)


def command_loads(session: Session, model: Path) -> tuple[bool, str]:
    """Whether CHECK_COMMAND runs on the export `model`, and its last line (or error)."""
    result = session.process(session.fill(session.recipe.command, model))
    stream = result.stdout if result.returncode == 0 else result.stderr
    lines = [line.strip() for line in stream.splitlines() if line.strip()]
    return result.returncode == 0, (lines[-1] if lines else "")[:80]


def export_loads(session: Session) -> Outcome:
    """e. The export loads into the recipe's own single-device command."""
    if session.recipe.command is None:
        return Outcome(SKIPPED, "", "the recipe declares no CHECK_COMMAND")
    ok, line = command_loads(session, session.run("single") / "model")
    return Outcome(HELD if ok else NOT_HELD, line, "" if ok else "its command failed")


def converted_checkpoint_loads(session: Session) -> Outcome:
    """f. `accel-recipes convert` of its last checkpoint gives the export's tensors, and the
    recipe's command loads it (strictly, by load_exported) in place of the export."""
    single = session.run("single")
    checkpoint = single / "checkpoints" / f"step_{STEPS}"
    converted = convert_checkpoint(
        checkpoint, session.tmp / "converted", recipe=session.recipe.name
    )
    state, export = load_file(str(converted)), exported_params(single)
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    if shapes != {k: tuple(v.shape) for k, v in export.items()}:
        other = sorted(set(shapes).symmetric_difference(export))[:3]
        return Outcome(NOT_HELD, f"{len(state)} tensors", f"not the export's tensors: {other}")
    changed = sum(not state[k].equal(export[k]) for k in state)
    measured = f"{len(state)} tensors as exported ({changed} with other values)"
    if session.recipe.command is None:
        return Outcome(HELD, measured, "no CHECK_COMMAND: keys and shapes compared only")
    folder = session.tmp / "converted_export"
    shutil.copytree(single / "model", folder)
    shutil.copy(converted, folder / "model.safetensors")
    ok, line = command_loads(session, folder)
    return Outcome(HELD if ok else NOT_HELD, measured, "" if ok else f"its command: {line}")


def fsdp_equals_plain(session: Session) -> Outcome:
    """g. FSDP2 on 2 CPU processes ends where the plain 2-process run does, each tensor within
    the one-batch bound of row a (the rounding-noise tensors within their own)."""
    floor = sum_order_floor(session)
    double = session.run("double", nproc=2)
    out, stdout = session.fsdp("fsdp")
    units = sum(line.startswith("fsdp unit: ") for line in stdout.splitlines())
    differences = relative_differences(weights_of(session, double), weights_of(session, out))
    bounds = floor.bounds()
    weights = largest(differences, bounds)
    measured = f"{units} FSDP units; vs DDP: weights {weights:.1e} (bound {bounds.default:.1e})"
    measured = "\n".join(filter(None, [measured, noise_line(differences, bounds)]))
    if units == 0:
        return Outcome(NOT_HELD, measured, "nothing was sharded")
    if tensors := over(differences, bounds):
        return Outcome(
            NOT_HELD, measured, f"FSDP trained otherwise than DDP: worst tensors {named(tensors)}"
        )
    return Outcome(HELD, measured)


# --compile's run compiles with the eager backend, as an accelerate config's dynamo_backend would
# (and benchmarks/compile_breaks.py does): dynamo's tracing and graph breaks are the recipe's to
# get right, and the compiled module's keys are what the promise is about. Inductor's C++ codegen
# took over 10 minutes for PVCNN2 on a loaded 2-core machine; AOT autograd's tracing 15 for
# cricket's 21 node types (the eager backend: 5).
COMPILE_ENV = {"ACCELERATE_DYNAMO_BACKEND": "EAGER"}


def compile_and_bf16(session: Session) -> Outcome:
    """h. --compile (traced by dynamo, the eager backend) keeps the export's plain keys;
    --mixed-precision bf16 trains (finite loss)."""
    plain = exported_params(session.run("single"))
    compiled = exported_params(session.run("compiled", "--compile", steps=SHORT, env=COMPILE_ENV))
    prefixed = [k for k in compiled if "_orig_mod." in k or k.startswith("module.")]
    bf16 = per_step(session.run("bf16", "--mixed-precision", "bf16", steps=SHORT))
    finite = bool(bf16) and all(math.isfinite(v) for v in bf16.values())
    measured = f"compiled keys {'plain' if not prefixed else 'prefixed'}; bf16 losses " + (
        ", ".join(f"{v:.3g}" for v in bf16.values())
    )
    if prefixed or compiled.keys() != plain.keys():
        return Outcome(NOT_HELD, measured, f"compiled export's keys differ, e.g. {prefixed[:1]}")
    if not finite:
        return Outcome(NOT_HELD, measured, "bf16 loss not finite")
    return Outcome(HELD, measured)


PROMISES = {
    "a": ("2 processes = 1", two_processes_equal_one),
    "b": ("kill -9 and resume = uninterrupted", resume_is_exact),
    "c": ("--dry-run = the run", dry_run_is_the_run),
    "d": ("files opened = data_files", data_files_are_declared),
    "e": ("export loads in its command", export_loads),
    "f": ("converted checkpoint loads", converted_checkpoint_loads),
    "g": ("FSDP = plain", fsdp_equals_plain),
    "h": ("--compile plain keys, bf16 trains", compile_and_bf16),
}
