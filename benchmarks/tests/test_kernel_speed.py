"""benchmarks/kernel_speed.py refuses bad values before any work starts: exit code 2, one line naming the
option and the fix, nothing written."""

from __future__ import annotations

import pytest
from kernel_speed import main

BAD = {
    "--size 0": (["--size", "0"], "--size: must be a positive multiple of 128"),
    "--size -5": (["--size", "-5"], "--size: must be a positive multiple of 128"),
    "--size 100": (["--size", "100"], "--size: must be a positive multiple of 128"),
    "--min-run-time 0": (["--min-run-time", "0"], "--min-run-time: must be > 0"),
    "--min-run-time nan": (["--min-run-time", "nan"], "--min-run-time: must be > 0"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_values_exit_2_with_one_line_and_write_nothing(case, tmp_path, capsys):
    argv, message = BAD[case]
    out = tmp_path / "results"
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--out", str(out)])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert len(error.splitlines()) == 1, error
    assert message in error
    assert not out.exists()
