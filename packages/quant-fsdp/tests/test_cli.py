"""The command line refuses bad values before any work starts: exit code 2, one line naming the
option and the fix, nothing written; --help, --version and those refusals import no torch."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

import quant_fsdp_cli
from quant_fsdp import __version__
from quant_fsdp_cli import DEMO_STEPS, main

BAD = {
    "demo --steps 0": (["demo", "--steps", "0"], "argument --steps: must be >= 1"),
    "demo --steps -1": (["demo", "--steps", "-1"], "argument --steps: must be >= 1"),
    "demo --steps ten": (["demo", "--steps", "ten"], "argument --steps: must be a whole number, got 'ten'"),
    "demo --recipes fp9": (["demo", "--recipes", "fp8,fp9"], "argument --recipes: unknown recipe 'fp9'; give 'all' or"),
    "demo --recipes empty": (["demo", "--recipes", "fp8,"], "argument --recipes: unknown recipe ''"),
    "demo --recipes bf16": (["demo", "--recipes", "bf16"], "(bf16 always runs, as the baseline)"),
    "demo --nproc 0": (["demo", "--nproc", "0"], "argument --nproc: must split the global batch of 8 sequences"),
    "demo --nproc -1": (["demo", "--nproc", "-1"], "argument --nproc: must split the global batch of 8 sequences"),
    "demo --nproc 3": (["demo", "--nproc", "3"], "evenly over the ranks: one of 1, 2, 4, 8; got 3"),
    "demo --nproc 16": (["demo", "--nproc", "16"], "evenly over the ranks: one of 1, 2, 4, 8; got 16"),
    "demo --seed -1": (["demo", "--seed", "-1"], "argument --seed: must be a whole number from 0 to 2**63 - 1, got -1"),
    "demo --seed 1.5": (["demo", "--seed", "1.5"], "argument --seed: must be a whole number, got '1.5'"),
    "demo --device tpu": (["demo", "--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    "demo --device cuda, no GPU": (["demo", "--device", "cuda"], "argument --device: torch 2"),
    "demo --device cuda, 1 GPU": (["demo", "--device", "cuda", "--nproc", "2"], "need 2 GPUs, torch sees 1"),
}


@pytest.fixture
def num_gpus(monkeypatch):
    """How many GPUs torch reports to the command line (none unless a test says otherwise)."""
    import torch

    count = {"value": 0}
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count["value"])
    return count


@pytest.mark.parametrize("existing", [False, True], ids=["new out", "existing out"])
@pytest.mark.parametrize("case", BAD)
def test_bad_values_exit_2_with_one_line_and_write_nothing(case, existing, tmp_path, capsys, num_gpus):
    argv, message = BAD[case]
    num_gpus["value"] = 1 if case.endswith("1 GPU") else 0
    out = tmp_path / "results"
    if existing:
        out.mkdir()
        (out / "demo.json").write_text("previous run")
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--out", str(out)])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert len(error.splitlines()) == 1, error
    assert message in error
    if existing:
        assert [p.name for p in out.iterdir()] == ["demo.json"]
        assert (out / "demo.json").read_text() == "previous run"
    else:
        assert not out.exists()


def _fake_demo(seen: dict):
    def run_demo(out: pathlib.Path, options) -> int:
        seen["options"] = options
        (out / "demo.json").write_text("{}")
        return 0

    return run_demo


def test_demo_options_reach_the_run_as_arguments(tmp_path, monkeypatch, num_gpus):
    import quant_lab.demo._run
    from quant_lab.demo._training import RECIPES, DemoOptions

    seen: dict = {}
    monkeypatch.setattr(quant_lab.demo._run, "run_demo", _fake_demo(seen))
    argv = [
        "demo",
        "--recipes",
        " nvfp4,fp8,nvfp4",
        "--nproc",
        "4",
        "--steps",
        "3",
        "--seed",
        "7",
        "--out",
        str(tmp_path),
    ]
    assert main(argv) == 0
    command = "quant-fsdp demo --recipes ' nvfp4,fp8,nvfp4' --nproc 4 --steps 3 --seed 7 --out " + str(tmp_path)
    expected = DemoOptions(recipes=("nvfp4", "fp8"), num_ranks=4, num_steps=3, device="cpu", seed=7, command=command)
    assert seen["options"] == expected

    assert main(["demo", "--recipes", "all", "--out", str(tmp_path)]) == 0
    assert seen["options"].recipes == RECIPES
    assert (seen["options"].num_ranks, seen["options"].seed, seen["options"].num_steps) == (2, 0, DEMO_STEPS)


@pytest.mark.parametrize(("gpus", "nproc", "device"), [(0, 1, "cpu"), (1, 2, "cpu"), (2, 2, "cuda"), (8, 4, "cuda")])
def test_auto_device_is_cuda_when_every_rank_has_a_gpu(gpus, nproc, device, tmp_path, monkeypatch, num_gpus):
    import quant_lab.demo._run

    seen: dict = {}
    monkeypatch.setattr(quant_lab.demo._run, "run_demo", _fake_demo(seen))
    num_gpus["value"] = gpus
    assert main(["demo", "--nproc", str(nproc), "--out", str(tmp_path)]) == 0
    assert seen["options"].device == device


def test_an_out_that_is_a_file_is_refused_and_left_as_it_was(tmp_path, capsys):
    target = tmp_path / "results"
    target.write_text("keep me")
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--out", str(target)])
    assert exit_info.value.code == 2
    assert "exists and is not a folder" in capsys.readouterr().err
    assert target.read_text() == "keep me"


def test_an_out_under_a_file_is_refused(tmp_path, capsys):
    parent = tmp_path / "file"
    parent.write_text("")
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--out", str(parent / "sub")])
    assert exit_info.value.code == 2
    assert f"{parent} is a file, so no folder can be created in it; name a folder" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == [parent]


@pytest.mark.parametrize("missing", [False, True], ids=["out exists", "out under it"])
def test_an_out_in_a_folder_that_is_not_writable_is_refused(missing, tmp_path, capsys, monkeypatch):
    # The tests run as root, for whom every folder is writable: os.access answers for a user here.
    locked = tmp_path / "locked"
    locked.mkdir()
    access = os.access
    monkeypatch.setattr(
        os, "access", lambda path, mode, **kw: pathlib.Path(path) != locked and access(path, mode, **kw)
    )
    out = locked / "results" if missing else locked
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--out", str(out)])
    assert exit_info.value.code == 2
    where = f"folder {locked} is not writable" if missing else "folder is not writable"
    assert capsys.readouterr().err == (
        f"quant-fsdp demo: error: argument --out {out}: {where}; name a writable folder (see quant-fsdp demo --help)\n"
    )
    assert list(locked.iterdir()) == []


def test_out_errors_point_to_the_demo_help_which_documents_out(tmp_path, capsys):
    target = tmp_path / "results"
    target.write_text("")
    with pytest.raises(SystemExit):
        main(["demo", "--out", str(target)])
    error = capsys.readouterr().err
    assert error.startswith(f"quant-fsdp demo: error: argument --out {target}: exists and is not a folder")
    assert error.endswith("(see quant-fsdp demo --help)\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--help"])
    assert exit_info.value.code == 0
    assert "--out FOLDER" in capsys.readouterr().out


def test_recipes_and_batch_are_the_demos():
    # The command line keeps its own copy, so that checking --recipes and --nproc imports no torch.
    from quant_lab.demo import _training

    assert (quant_fsdp_cli.RECIPES, quant_fsdp_cli.BATCH) == (_training.RECIPES, _training.BATCH)


# Runs the command line on its arguments in a fresh interpreter, then names the heavy modules it imported.
DRIVER = """
import sys
import quant_fsdp_cli
try:
    quant_fsdp_cli.main(sys.argv[1:])
finally:
    print("imported:", *sorted({"torch", "quant_fsdp", "quant_tensors"} & set(sys.modules)), file=sys.stderr)
"""

WITHOUT_TORCH = {
    "--help": (["--help"], 0, "usage: quant-fsdp"),
    "demo --help": (["demo", "--help"], 0, "usage: quant-fsdp demo"),
    "--version": (["--version"], 0, f"quant-fsdp {__version__}"),
    "no command": ([], 2, "the following arguments are required: command"),
    "demo --steps 0": (["demo", "--steps", "0"], 2, "argument --steps: must be >= 1"),
    "demo --nproc 3": (["demo", "--nproc", "3"], 2, "argument --nproc: must split the global batch"),
    "demo --recipes fp9": (["demo", "--recipes", "fp9"], 2, "argument --recipes: unknown recipe 'fp9'"),
    "demo --out file": (["demo", "--out", __file__], 2, "exists and is not a folder"),
}


@pytest.mark.parametrize("case", WITHOUT_TORCH)
def test_help_version_and_refusals_import_no_torch(case):
    argv, code, expected = WITHOUT_TORCH[case]
    done = subprocess.run([sys.executable, "-c", DRIVER, *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == code, done.stderr
    assert expected in done.stdout + done.stderr
    assert done.stderr.splitlines()[-1] == "imported:", done.stderr


def test_demo_without_the_lab_exits_2_with_one_line_saying_how_to_run_it(tmp_path):
    # quant-fsdp installed from its wheel alone: the lab (quant_lab) cannot be imported.
    out = tmp_path / "results"
    without_lab = "sys.modules['quant_lab'] = None  # an import of it raises ModuleNotFoundError\n"
    driver = DRIVER.replace("import quant_fsdp_cli\n", "import quant_fsdp_cli\n" + without_lab, 1)
    done = subprocess.run(
        [sys.executable, "-c", driver, "demo", "--out", str(out)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr
    *printed, imported = done.stderr.splitlines()
    assert len(printed) == 1, done.stderr
    assert printed[0].startswith("quant-fsdp demo: error: the demo ships with the quant-fsdp repository")
    assert "`nox -s demo` in a clone" in printed[0]
    assert "`pip install ./lab`" in printed[0]
    assert imported == "imported:"
    assert not out.exists()


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"quant-fsdp {__version__}"


def test_a_good_out_is_not_created_before_work_starts(tmp_path):
    # The check probes with a temporary folder it removes again: a run refused for another reason
    # (here a rank count that does not split the batch) leaves nothing behind.
    out: pathlib.Path = tmp_path / "new" / "results"
    with pytest.raises(SystemExit):
        main(["demo", "--nproc", "3", "--out", str(out)])
    assert not (tmp_path / "new").exists()
    assert list(tmp_path.iterdir()) == []


def _fake_run(fail: bool):
    def run_demo(out: pathlib.Path, options) -> int:
        (out / "demo.json").write_text("{}")
        if fail:
            raise KeyboardInterrupt  # interrupted halfway
        (out / "demo.md").write_text("done")
        return 0

    return run_demo


def test_results_move_into_out_only_when_the_command_returns(tmp_path, monkeypatch, capsys):
    import quant_lab.demo._run

    out = tmp_path / "results"
    out.mkdir()
    (out / "demo.json").write_text("previous run")
    monkeypatch.setattr(quant_lab.demo._run, "run_demo", _fake_run(fail=True))
    assert main(["demo", "--out", str(out)]) == 130  # 128 + SIGINT, as shells report Ctrl-C
    assert capsys.readouterr().err == f"quant-fsdp demo: interrupted; nothing written to {out}\n"
    assert [p.name for p in out.iterdir()] == ["demo.json"]
    assert (out / "demo.json").read_text() == "previous run"  # as it was

    monkeypatch.setattr(quant_lab.demo._run, "run_demo", _fake_run(fail=False))
    assert main(["demo", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["demo.json", "demo.md"]
    assert (out / "demo.json").read_text() == "{}"
    assert f"wrote demo.json, demo.md to {out}" in capsys.readouterr().out


@pytest.mark.parametrize(("nproc", "gpus", "warned"), [(4, 0, True), (2, 0, False), (4, 4, False)])
def test_more_cpu_ranks_than_cores_warns_in_one_line(nproc, gpus, warned, tmp_path, monkeypatch, capsys, num_gpus):
    import quant_lab.demo._run

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(quant_lab.demo._run, "run_demo", _fake_demo({}))
    num_gpus["value"] = gpus
    assert main(["demo", "--nproc", str(nproc), "--out", str(tmp_path)]) == 0
    error = capsys.readouterr().err
    if warned:
        assert error.startswith("quant-fsdp demo: warning: --nproc 4 is more ranks than the 2 CPU cores")
        assert "tokens/s and step ms are not comparable" in error
        assert len(error.splitlines()) == 1
    else:
        assert error == ""
