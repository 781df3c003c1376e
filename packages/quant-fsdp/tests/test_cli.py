"""The command line refuses bad values before any work starts: exit code 2, one line naming the
option and the fix, nothing written."""

from __future__ import annotations

import pathlib

import pytest

from quant_fsdp import __version__
from quant_fsdp.cli import main

BAD = {
    "demo --steps 0": (["demo", "--steps", "0"], "--steps: must be >= 1"),
    "demo --steps -1": (["demo", "--steps", "-1"], "--steps: must be >= 1"),
    "demo --world-size 0": (["demo", "--world-size", "0"], "--world-size: must be a power of two"),
    "demo --world-size -1": (["demo", "--world-size", "-1"], "--world-size: must be a power of two"),
    "demo --world-size 99": (["demo", "--world-size", "99"], "--world-size: must be a power of two"),
    "demo --world-size 128": (["demo", "--world-size", "128"], "--world-size: must be a power of two"),
    "bench --size 0": (["bench", "--size", "0"], "--size: must be a positive multiple of 128"),
    "bench --size -5": (["bench", "--size", "-5"], "--size: must be a positive multiple of 128"),
    "bench --size 100": (["bench", "--size", "100"], "--size: must be a positive multiple of 128"),
    "bench --min-run-time 0": (["bench", "--min-run-time", "0"], "--min-run-time: must be > 0"),
    "bench --min-run-time nan": (["bench", "--min-run-time", "nan"], "--min-run-time: must be > 0"),
    "bench --e2e --steps 0": (["bench", "--e2e", "--steps", "0"], "--steps: must be >= 1"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_values_exit_2_with_one_line_and_write_nothing(case, tmp_path, capsys):
    argv, message = BAD[case]
    out = tmp_path / "results"
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--out", str(out)])
    assert exit_info.value.code == 2
    last_line = capsys.readouterr().err.strip().splitlines()[-1]
    assert message in last_line
    assert not out.exists()


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
        main(["bench", "--out", str(parent / "sub")])
    assert exit_info.value.code == 2
    assert "cannot create folders under" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == [parent]  # the probe folder is gone


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"quant-fsdp {__version__}"


def test_a_good_out_is_not_created_before_work_starts(tmp_path):
    # The check probes with a temporary folder it removes again: a run refused for another reason
    # (here the e2e options given without --e2e) leaves nothing behind.
    out: pathlib.Path = tmp_path / "new" / "results"
    with pytest.raises(SystemExit):
        main(["bench", "--runs", "bf16", "--out", str(out)])
    assert not (tmp_path / "new").exists()
    assert list(tmp_path.iterdir()) == []


def _fake_bench(fail: bool):
    def run_bench(out: pathlib.Path, **options) -> int:
        (out / "bench.json").write_text("{}")
        if fail:
            raise KeyboardInterrupt  # interrupted halfway
        (out / "bench.md").write_text("done")
        return 0

    return run_bench


def test_results_move_into_out_only_when_the_command_returns(tmp_path, monkeypatch, capsys):
    import quant_fsdp._bench

    out = tmp_path / "results"
    out.mkdir()
    (out / "bench.json").write_text("previous run")
    monkeypatch.setattr(quant_fsdp._bench, "run_bench", _fake_bench(fail=True))
    with pytest.raises(KeyboardInterrupt):
        main(["bench", "--out", str(out)])
    assert [p.name for p in out.iterdir()] == ["bench.json"]
    assert (out / "bench.json").read_text() == "previous run"  # as it was

    monkeypatch.setattr(quant_fsdp._bench, "run_bench", _fake_bench(fail=False))
    assert main(["bench", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["bench.json", "bench.md"]
    assert (out / "bench.json").read_text() == "{}"
    assert f"wrote bench.json, bench.md to {out}" in capsys.readouterr().out
