"""``mtp-bench``'s progress (a counter that reaches its total, never long without a line, also
in the phases after the smoke runs) and where a run writes by default (a folder git ignores,
so a run leaves the committed results and ``git status`` as they were)."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mtp.bench import cli, runner
from mtp.bench.progress import HEARTBEAT_S, Progress

ROOT = Path(__file__).resolve().parent.parent
COUNTER = re.compile(r"^\[(\d+)/(\d+)\] ")
#: The longest a run may go without a line (the heartbeat comes after HEARTBEAT_S).
MAX_SILENCE_S = 15.0


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)


def _in_git_checkout() -> bool:
    try:
        return _git("rev-parse", "--is-inside-work-tree").stdout.strip() == "true"
    except (OSError, subprocess.SubprocessError):
        return False


def _timed_lines(cmd: list[str], timeout: float, **kw) -> tuple[int, list[tuple[float, str]]]:
    """Run ``cmd``: its exit code and its output lines (stdout and stderr together), each
    with the seconds since the start at which it arrived."""
    start = time.monotonic()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, **kw)  # fmt: skip
    lines = []
    for line in proc.stdout:
        lines.append((time.monotonic() - start, line.rstrip("\n")))
        assert time.monotonic() - start < timeout, lines[-5:]
    lines.append((time.monotonic() - start, ""))  # the end of the output
    return proc.wait(timeout=60), lines


def check_progress(lines: list[tuple[float, str]], max_silence: float) -> int:
    """No gap over ``max_silence`` seconds between lines (from the start to the end of the
    output); the counter never goes back and ends at ``[total/total] done``. Returns total."""
    stamps = [0.0] + [t for t, _ in lines]
    gaps = [(b - a, lines[i - 1][1] if i else "(start)") for i, (a, b) in
            enumerate(zip(stamps, stamps[1:]))]  # fmt: skip
    worst = max(gaps)
    assert worst[0] <= max_silence, f"{worst[0]:.1f} s without a line after: {worst[1]}"
    counters = [(int(m[1]), int(m[2])) for _, text in lines if (m := COUNTER.match(text))]
    assert counters, [text for _, text in lines][:20]
    totals = {total for _, total in counters}
    assert len(totals) == 1, totals
    total = totals.pop()
    done = [i for i, _ in counters]
    assert done == sorted(done) and done[0] == 1, done
    finals = [text for _, text in lines if text.startswith(f"[{total}/{total}] done in")]
    assert len(finals) == 1, [text for _, text in lines if COUNTER.match(text)][-5:]
    return total


def test_cli_reports_progress_and_writes_outside_the_committed_results():
    """``python -m bench bias_gelu --backends reference`` as ``make bench`` runs it (no
    ``--out``; the reference backend: no bytes-by-address run, so it is quick): never 15 s
    without a line, the counter at its total; the results in the ignored default folder,
    ``git status`` unchanged."""
    git = _in_git_checkout()
    before = _git("status", "--porcelain").stdout if git else None
    started = time.time()
    code, lines = _timed_lines([sys.executable, "-m", "bench", "bias_gelu", "--quick",
                                "--no-plots", "--backends", "reference"], timeout=300,
                               cwd=ROOT)  # fmt: skip
    assert code == 0, [text for _, text in lines][-20:]
    total = check_progress(lines, MAX_SILENCE_S)
    planned = runner.plan(runner.load_modules(), ["bias_gelu"], "smoke", torch.bfloat16,
                          ["reference"])  # fmt: skip
    assert total == runner.total_steps(planned, cpu=True) + 1  # + writing the results
    written = cli.default_out() / "cpu-structural" / "results.json"
    assert written.stat().st_mtime >= started - 1
    if git:
        assert _git("status", "--porcelain").stdout == before


def test_heartbeat_inside_a_long_phase(monkeypatch, tmp_path, capsys):
    """A phase after the smoke runs (a family's structure) that takes longer than
    ``--heartbeat-s`` gets lines saying it is still running."""
    from mtp.bench import bench_bias_act

    monkeypatch.setattr(bench_bias_act, "structure", lambda size: time.sleep(1.6) or {},
                        raising=False)  # fmt: skip
    code = cli.main(["bias_gelu", "--quick", "--mode", "cpu", "--no-plots", "--backends",
                     "reference", "--heartbeat-s", "0.5", "--out", str(tmp_path)])  # fmt: skip
    assert code == 0
    lines = capsys.readouterr().err.splitlines()
    total = int(COUNTER.match(lines[0])[2])
    begun = f"[{total - 1}/{total}] bias_act structure ..."
    assert begun in lines
    beats = lines[lines.index(begun) + 1 : lines.index(f"[{total}/{total}] writing results.json,"
                                                       " results.md ...")]  # fmt: skip
    assert beats and all(b.startswith(f"{begun} still running (") for b in beats), beats
    assert lines[-1].startswith(f"[{total}/{total}] done in ")


def test_default_out_is_ignored_by_git():
    out = cli.default_out()
    assert out.is_relative_to(ROOT / "bench" / "results") and out != ROOT / "bench" / "results"
    if not _in_git_checkout():
        pytest.skip("not a git checkout")
    probe = out / "cpu-structural" / "results.json"
    assert _git("check-ignore", "-q", str(probe)).returncode == 0, f"{probe} is not ignored"
    assert _git("ls-files", str(out)).stdout == ""


def test_every_phase_is_a_counted_step():
    """The total counts each provider, each bytes-by-address run (of the planned ops only) and
    each family's structure."""
    modules = runner.load_modules()
    planned = runner.plan(modules, ["bias_gelu"], "smoke", torch.bfloat16)
    traffic = runner.traffic_runs(planned)
    assert traffic and {case.op for _, case, _ in traffic} == {"bias_gelu"}
    providers = sum(len(p) for _, _, p in planned)
    assert runner.total_steps(planned, cpu=True) == providers + len(traffic)
    no_triton = runner.plan(modules, ["bias_gelu"], "smoke", torch.bfloat16, ["reference"])
    assert runner.traffic_runs(no_triton) == []  # only the planned mtp backends are measured
    everything = runner.plan(modules, None, "smoke", torch.bfloat16)
    families = {m.FAMILY for m, _, _ in everything if hasattr(m, "structure")}
    assert families == {"cross_entropy", "linear_cross_entropy", "moe_layer"}
    assert runner.total_steps(everything, cpu=True) == (
        sum(len(p) for _, _, p in everything) + len(runner.traffic_runs(everything))
        + len(families)
    )  # fmt: skip
    assert runner.total_steps(everything, cpu=False) == sum(len(p) for _, _, p in everything)


def test_heartbeat_names_what_is_still_running():
    stream = io.StringIO()
    progress = Progress(2, heartbeat_s=0.2, stream=stream)
    progress.begin("slow step")
    time.sleep(0.9)
    progress.step("slow step")
    progress.begin("fast step")
    progress.step("fast step")
    progress.close()
    progress.close()  # once
    lines = stream.getvalue().splitlines()
    assert lines[0] == "[1/2] slow step ..."
    beats = [line for line in lines if "still running" in line]
    assert beats and all(line.startswith("[1/2] slow step ... still running (") for line in beats)
    assert lines[-2:] == ["[2/2] fast step ...", lines[-1]]
    assert re.fullmatch(r"\[2/2\] done in \d+ s", lines[-1])
    assert HEARTBEAT_S < MAX_SILENCE_S


def test_no_heartbeat_when_progress_is_off():
    stream = io.StringIO()
    progress = Progress(1, enabled=False, heartbeat_s=0.05, stream=stream)
    progress.begin("x")
    time.sleep(0.2)
    progress.step("x")
    progress.close()
    assert stream.getvalue() == ""


@pytest.mark.slow
def test_full_quick_run_reports_progress(tmp_path):
    """``make bench``'s run, every family (about 3 minutes on 2 cores)."""
    code, lines = _timed_lines([sys.executable, "-m", "bench", "--quick", "--no-plots", "--out",
                                str(tmp_path)], timeout=1200, cwd=ROOT)  # fmt: skip
    assert code == 0, [text for _, text in lines][-20:]
    check_progress(lines, MAX_SILENCE_S)
