"""`accel-recipes` refuses what cannot work with one `error:` line, exit code 2, nothing started
or overwritten: a DeepSpeed config without DeepSpeed, a malformed or missing accelerate config,
a launcher that does not exist, a file where make-data needs a folder, a bad --ref-lr."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from tests.processes import ACCELERATE_LAUNCH, BIN, CPU_2PROC, REPO, TEMPLATE

runner = CliRunner()
DEEPSPEED_CONFIG = REPO / "accelerate_configs" / "deepspeed_zero2_8gpu.yaml"
# not valid YAML: an unclosed flow sequence, then a key with two colons
BROKEN_YAML = "distributed_type: [MULTI_GPU\nnum_processes: : 2\n"


def invoke(*args: str) -> Result:
    from accel_common.tools.cli import app  # imports torch: only when a test runs

    return runner.invoke(app, list(args))


def one_error_line(result: Result) -> str:
    """The single `error: ...` line a refused command prints on stderr (and nothing else)."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def launch(tmp_path: Path, *launcher: str) -> tuple[Result, Path]:
    """`accel-recipes launch -- LAUNCHER recipes/train_template.py --output-dir RUN`."""
    out = tmp_path / "run"
    command = [*launcher, str(TEMPLATE), "--max-steps", "1", "--output-dir", str(out)]
    return invoke("launch", "--", *command), out


@pytest.fixture
def no_deepspeed(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSpeed reads as not installed, whether this machine has it or not."""
    find_spec = importlib.util.find_spec

    def without_deepspeed(name: str, *args, **kwargs):
        return None if name.split(".")[0] == "deepspeed" else find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", without_deepspeed)


@pytest.mark.parametrize(
    "launcher",
    [
        [str(BIN / "accelerate"), "launch", "--config_file", str(DEEPSPEED_CONFIG)],
        [*ACCELERATE_LAUNCH, "--config-file", str(DEEPSPEED_CONFIG)],  # accelerate's other spelling
        [str(BIN / "accelerate"), "launch", "--use_deepspeed", "--num_processes", "2"],
    ],
    ids=["config", "module-and-hyphen", "flag"],
)
def test_a_deepspeed_launch_without_deepspeed_names_the_package(tmp_path, no_deepspeed, launcher):
    result, out = launch(tmp_path, *launcher)
    line = one_error_line(result)
    assert "needs DeepSpeed, which is not installed: `pip install deepspeed`" in line
    if "--use_deepspeed" not in launcher:
        assert line.startswith("error: deepspeed_zero2_8gpu.yaml needs DeepSpeed")
    else:
        assert line.startswith("error: --use_deepspeed needs DeepSpeed")
    assert not out.exists()  # nothing was launched


def test_a_malformed_accelerate_config_is_one_line_from_launch_and_doctor(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(BROKEN_YAML)
    result, out = launch(tmp_path, *ACCELERATE_LAUNCH, "--config_file", str(bad))
    line = one_error_line(result)
    assert line.startswith(f"error: --config_file {bad}: not valid YAML at line 2, column ")
    assert not out.exists()
    # the doctor reads it with the same check, worded for its own flag, also on one line
    doctor = one_error_line(invoke("doctor", "--config-file", str(bad)))
    assert doctor == line.replace("--config_file", "--config-file")
    assert bad.read_text() == BROKEN_YAML


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("num_processes: -3", "num_processes: -3: give a positive whole number"),
        ("num_processes: two", "num_processes: 'two': give a positive whole number"),
        ("num_machines: 0", "num_machines: 0: give a positive whole number"),
        ("distributed_type: WARP_DRIVE", "distributed_type: 'WARP_DRIVE': give one of NO,"),
        ("dynamo_backend: bogus", "dynamo_backend: 'bogus': give one of no, eager,"),
        (
            "dynamo_config: {dynamo_backend: INDUCTOR, dynamo_use_regional_compilation: maybe}",
            "dynamo_use_regional_compilation: 'maybe': give true or false",
        ),
    ],
    ids=["negative-processes", "text-processes", "zero-machines", "kind", "backend", "regional"],
)
def test_a_bad_value_in_an_accelerate_config_is_one_line_from_launch_and_doctor(
    tmp_path, line, expected
):
    """Values Accelerate reads without checking: the launch would start, then die in a
    traceback (or start a nonsense number of processes); refused before anything starts."""
    bad = tmp_path / "bad.yaml"
    bad.write_text(CPU_2PROC.read_text() + line + "\n")
    result, out = launch(tmp_path, *ACCELERATE_LAUNCH, "--config_file", str(bad))
    assert one_error_line(result).startswith(f"error: --config_file {bad}: {expected}")
    assert not out.exists()
    doctor = one_error_line(invoke("doctor", "--config-file", str(bad)))
    assert doctor.startswith(f"error: --config-file {bad}: {expected}")


def test_a_python_tag_in_an_accelerate_config_is_refused_and_never_run(tmp_path):
    marker = tmp_path / "pwned"
    bad = tmp_path / "tagged.yaml"
    bad.write_text(
        CPU_2PROC.read_text() + f'foo: !!python/object/apply:os.system ["touch {marker}"]\n'
    )
    result, out = launch(tmp_path, *ACCELERATE_LAUNCH, "--config_file", str(bad))
    line = one_error_line(result)
    assert line.startswith(f"error: --config_file {bad}: a tag that builds an object at line ")
    assert "python/object/apply" in line and "nothing in the file was run" in line
    doctor = invoke("doctor", "--json", "--config-file", str(bad))  # a blocker in its report
    assert doctor.exit_code == 1 and "tagged.yaml holds a tag that builds" in doctor.stdout
    assert not marker.exists() and not out.exists()


def test_a_missing_accelerate_config_names_the_shipped_ones(tmp_path):
    missing = tmp_path / "nope.yaml"
    result, out = launch(tmp_path, *ACCELERATE_LAUNCH, "--config_file", str(missing))
    line = one_error_line(result)
    assert line.startswith(f"error: --config_file {missing}: no such file; the configs in")
    assert CPU_2PROC.name in line
    assert not out.exists()


@pytest.mark.parametrize("name", ["nosuchbinary", "./nosuchbinary"])
def test_a_launcher_that_does_not_exist_is_one_line(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    line = one_error_line(invoke("launch", "--", name, "--flag"))
    assert line.startswith(f"error: {name}: no such ")
    assert "accel-recipes launch -- accelerate launch --config_file" in line  # what to run


def test_a_launcher_that_is_not_executable_is_one_line(tmp_path):
    script = tmp_path / "launcher.sh"
    script.write_text("echo hi\n")
    line = one_error_line(invoke("launch", "--", str(script)))
    assert line.startswith(f"error: {script}: cannot run it (Permission denied)")


@pytest.mark.parametrize("force", [False, True])
def test_make_data_into_a_file_refuses_and_keeps_the_file(tmp_path, force):
    target = tmp_path / "notes.txt"
    target.write_text("my notes\n")
    args = ["make-data", "template", str(target), *(["--force"] if force else [])]
    line = one_error_line(invoke(*args))
    assert line == (
        f"error: {target} is a file, not a folder: give a folder to write the data set into "
        "(it is created if missing)"
    )
    assert target.read_text() == "my notes\n"
    below = one_error_line(invoke("make-data", "template", str(target / "data")))
    assert below.startswith(f"error: {target / 'data'}: {target} is a file, not a folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize("value", ["nan", "-1", "inf", "0"])
def test_plan_names_ref_lr_for_a_bad_ref_lr(value):
    line = one_error_line(invoke("plan", "--ref-bs", "8", "--ref-lr", value))
    assert line.startswith(f"error: --ref-lr must be a positive number, got {float(value)}")


def test_plan_measure_checks_ref_lr_before_measuring(tmp_path):
    line = one_error_line(invoke("plan", "--measure", "template", "--ref-lr", "nan"))
    assert line.startswith("error: --ref-lr must be a positive number, got nan")


@pytest.mark.parametrize(
    ("name", "content", "expected"),
    [
        ("missing.py", None, ": no such recipe or file; give a recipe (captioning, cricket,"),
        ("folder", "", " is a folder; give a recipe script"),
        ("notes.txt", "hello\n", " is not a Python file; give a recipe ("),
        (
            "broken.py",
            "x = (\n",
            ": cannot import it (SyntaxError: '(' was never closed at line 1)",
        ),
        ("plain.py", "x = 1\n", " defines no recipe command `train`"),
    ],
)
def test_plan_measure_of_a_file_that_is_no_recipe_is_one_line_naming_it(
    tmp_path, name, content, expected
):
    path = tmp_path / name
    if content == "":
        path.mkdir()
    elif content is not None:
        path.write_text(content)
    line = one_error_line(invoke("plan", "--measure", str(path)))
    assert line.startswith(f"error: --measure {path}{expected}")
    assert not (tmp_path / "runs").exists()


def pcdiff_checkpoint(path: Path, **extra: object) -> Path:
    """A checkpoint as pcdiff's trainer saves it, of a small PVCNN2 (random weights)."""
    import torch

    from recipes.pointcloud.model import PVCNN2

    model = PVCNN2(num_points=192, width_multiplier=0.25, embed_dim=16)
    state = {f"model._orig_mod.{k}": v for k, v in model.state_dict().items()}
    torch.save({"epoch": 1, "model_state": state, "loss": 0.5, **extra}, path)
    return path


def test_convert_from_pcdiff_refuses_in_one_line(tmp_path):
    import argparse

    import torch

    good = pcdiff_checkpoint(tmp_path / "model_best.pth")
    text = tmp_path / "notes.pth"
    text.write_text("not a checkpoint\n")
    pickled = pcdiff_checkpoint(tmp_path / "args.pth", args=argparse.Namespace(lr=2e-4))
    narrow = tmp_path / "narrow.pth"
    checkpoint = torch.load(good, weights_only=True)
    checkpoint["model_state"]["model._orig_mod.sa_layers.0.0.voxel_layers.0.weight"] = torch.zeros(
        12, 3, 3, 3, 3
    )
    torch.save(checkpoint, narrow)
    mine = tmp_path / "mine.txt"
    mine.write_text("mine")
    cases = [
        (text, tmp_path / "a", "not a torch checkpoint"),
        (pickled, tmp_path / "b", "holds a pickled argparse.Namespace object"),
        (narrow, tmp_path / "c", "not PVCNN2 at a size it builds"),
        (good, mine, "is a file; give a folder"),
    ]
    for source, out, message in cases:
        line = one_error_line(invoke("convert", str(source), str(out), "--from", "pcdiff"))
        assert message in line
    assert mine.read_text() == "mine"
    line = one_error_line(invoke("convert", str(good), str(tmp_path / "x.pth"), "--to", "pcdiff"))
    assert "not an export of the pointcloud recipe" in line


def test_convert_set_refuses_in_one_line(tmp_path):
    """--set NAME=VALUE: malformed, without --from, a value not of the assumed type, or a name
    the import does not take: one line each, nothing written."""
    good = pcdiff_checkpoint(tmp_path / "model_best.pth")
    out = tmp_path / "out"
    cases = [
        (["--from", "pcdiff", "--set", "vox_res_mult"], "--set vox_res_mult: give NAME=VALUE"),
        (["--set", "vox_res_mult=1"], "use it with --from"),
        (["--from", "pcdiff", "--set", "vox_res_mult=big"], "not a float (as the assumed 1.0)"),
        (["--from", "pcdiff", "--set", "width=3"], "--set takes vox_res_mult"),
    ]
    for extra, message in cases:
        line = one_error_line(invoke("convert", str(good), str(out), *extra))
        assert message in line, line
    assert not out.exists()


def test_convert_to_an_original_names_source_for_another_recipes_export(tmp_path):
    """The shared export reader's message names the argument that gave the folder: convert's
    SOURCE, not the --model of the recipes' own commands."""
    import torch

    from accel_common.checkpoints.export import write_export

    other = tmp_path / "template_model"
    write_export({"w": torch.zeros(2)}, other, {"recipe": "template", "config": {"hidden": 8}})
    line = one_error_line(invoke("convert", str(other), str(tmp_path / "x.pth"), "--to", "pcdiff"))
    assert "exported by the 'template' recipe" in line and "Point SOURCE at" in line, line
    assert "--model" not in line


ORIGINALS = ["cricketmodel", "comformer", "crowd-bt", "pcdiff"]


def unusable_checkpoints(folder: Path) -> dict[str, Path]:
    """Files a user may hand `convert --from`: empty, text with a checkpoint's suffix, a
    safetensors file, a truncated torch.save archive, values where the state dict should be,
    another network's state dict, a folder."""
    import torch

    folder.mkdir()
    torch.save({"model": {"w": torch.zeros(256)}}, folder / "whole.pt")
    files = {
        "empty.pt": b"",
        "notes.pth": b"not a checkpoint\n",
        "config.pt": b'{"model": [1, 2]}',
        "truncated.pt": (folder / "whole.pt").read_bytes()[:300],
        "weights.safetensors": b'\x08\x00\x00\x00\x00\x00\x00\x00{"a": 1}',
    }
    for name, data in files.items():
        (folder / name).write_bytes(data)
    torch.save([1, 2, 3], folder / "list.pt")
    wrappers = ("model_state_dict", "model_state", "model")
    torch.save({key: [1.0, 2.0] for key in wrappers}, folder / "ill-typed.pt")
    other_net = {"fc.weight": torch.zeros(2, 2)}
    torch.save({key: other_net for key in wrappers}, folder / "other-net.pt")
    (folder / "folder.pt").mkdir()
    return {path.name: path for path in folder.iterdir() if path.name != "whole.pt"}


@pytest.mark.parametrize("original", ORIGINALS)
def test_convert_from_an_unusable_checkpoint_is_one_line_naming_it(original, tmp_path):
    """Issue 43: an empty file, a truncated or ill-typed checkpoint ended in a traceback."""
    out = tmp_path / "out"
    for name, source in unusable_checkpoints(tmp_path / "in").items():
        line = one_error_line(invoke("convert", str(source), str(out), "--from", original))
        assert line.startswith(f"error: {source}"), (name, line)
        assert not out.exists(), name  # nothing written


@pytest.mark.parametrize("direction", ["--from", "--to"])
@pytest.mark.parametrize("original", ORIGINALS)
def test_convert_into_an_output_it_cannot_write_is_one_line_before_reading(
    original, direction, tmp_path, read_only_folder
):
    """Issue 43: an OUTPUT under a file or in a read-only folder failed after the conversion,
    in a traceback. The source is never read: the output is checked first."""
    source = tmp_path / "never-read.pt"
    afile = tmp_path / "afile"
    afile.write_text("mine")
    for out, says in (
        (afile / "sub" / "x.pt", f"{afile} is a file, not a folder"),
        (read_only_folder / "x.pt", f"cannot write in {read_only_folder}"),
    ):
        line = one_error_line(invoke("convert", str(source), str(out), direction, original))
        assert line.startswith(f"error: OUTPUT {out}: {says}"), line
    assert afile.read_text() == "mine" and not list(read_only_folder.iterdir())


def test_convert_to_an_original_names_the_recipe_of_a_converted_export(tmp_path):
    """Issue 43: --to comformer of an export converted from pcdiff said only that it was converted,
    not that it belongs to the pointcloud recipe."""
    import torch

    from accel_common.checkpoints.export import write_export

    other = tmp_path / "pcdiff_model"
    meta = {"recipe": "pointcloud", "converted_from": "pcdiff: model_best.pth"}
    write_export({"w": torch.zeros(2)}, other, meta)
    out = str(tmp_path / "x.pt")
    line = one_error_line(invoke("convert", str(other), out, "--to", "comformer"))
    assert "from pcdiff: model_best.pth, for the 'pointcloud' recipe" in line, line
