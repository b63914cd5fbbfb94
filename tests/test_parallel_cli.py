"""python -m mtp.parallel: tables, grid, JSON, node-span warnings, errors."""

import json
import subprocess
import sys

import pytest

from mtp.parallel import make_rank_generators
from mtp.parallel.__main__ import main


def test_json_matches_generators(capsys):
    assert main(["--world-size", "16", "--tp", "4", "--pp", "2", "--ep", "4", "--etp", "1",
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    dense, expert = make_rank_generators(16, tp=4, pp=2, ep=4, etp=1)
    assert data["dense"]["tp"] == dense.get_ranks("tp") == [
        [0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]
    ]
    assert data["dense"]["dp"] == dense.get_ranks("dp")
    assert data["dense"]["pp"] == dense.get_ranks("pp")
    assert data["dense"]["tp-pp"] == dense.get_ranks("tp-pp")
    assert data["expert"]["ep"] == expert.get_ranks("ep")
    assert data["expert"]["edp"] == expert.get_ranks("dp")
    assert data["expert"]["etp"] == expert.get_ranks("tp")


def test_text_report_has_tables_and_grid(capsys):
    assert main(["--world-size", "16", "--tp", "4", "--pp", "2"]) == 0
    out = capsys.readouterr().out
    assert "Dense layout, order tp-cp-ep-dp-pp: world 16 = tp 4 x cp 1 x dp 2 x pp 2" in out
    assert "[0,4] [1,5]" in out  # dp groups
    # grid: pipeline stage 1, data parallel row 1 holds ranks 12..15
    grid = out.split("Dense rank grid")[1].split("Expert rank grid")[0]
    rows = [line.split() for line in grid.splitlines() if line.strip().startswith("dp")]
    assert rows[-1] == ["dp", "1", "12", "13", "14", "15"]


def test_node_span_warning(capsys):
    assert main(["--world-size", "16", "--tp", "16", "--gpus-per-node", "8"]) == 0
    err = capsys.readouterr().err
    assert "tp group(s) span nodes" in err and "nodes [0, 1]" in err
    assert main(["--world-size", "16", "--tp", "8", "--gpus-per-node", "8"]) == 0
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--world-size", "16", "--tp", "3"], "not divisible by tp*cp*pp"),
        (["--world-size", "16", "--tp", "zero"], "invalid int value"),
        (["--tp", "2"], "required"),
        (["--world-size", "8", "--ep", "2", "--order", "tp-dp-pp"], "lacks ['ep']"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(argv, match, capsys):
    with pytest.raises(SystemExit) as info:
        code = main(argv)
        raise SystemExit(code)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and match in err


def test_module_entry_point():
    proc = subprocess.run(
        [sys.executable, "-m", "mtp.parallel", "--world-size", "8", "--tp", "2", "--json"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["dense"]["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    proc = subprocess.run(
        [sys.executable, "-m", "mtp.parallel", "--world-size", "8", "--tp", "3"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
