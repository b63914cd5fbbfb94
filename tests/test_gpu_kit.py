"""The GPU run kit, checked without a GPU.

* ``tools/gpu_bundle.py``: the CUTLASS header closure of csrc/, copied into a folder that then
  alone (no other CUTLASS on any include path) satisfies nvcc's preprocessor for the sm_90a and
  sm_100a passes; what travels to the GPU machine stays under the device tool's 64 MiB.
* ``tools/gpu_check.py``: ``--dry-run`` walks every step and writes the table with "not run: no
  GPU"; the time box kills a step's whole process group; the JUnit and bench summaries.
* ``tools/triton_min_check.py``: which test files and tests it selects, which kernels it counts
  as covered, and that its pytest plugin fails the run when a kernel does not compile.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import textwrap
import time
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_mtp_kit_{name}", ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


gpu_bundle = _load("gpu_bundle")
gpu_check = _load("gpu_check")
triton_min = _load("triton_min_check")


def _clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("OUT", "TRITON_INTERPRET", "CPATH", "CPLUS_INCLUDE_PATH", "C_INCLUDE_PATH")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tools")]))
    env.update(extra)
    return env


# ----------------------------------------------------------------------------------------------
# The bundle
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cutlass_include():
    build_ext = gpu_bundle.load_build_ext()
    try:
        return build_ext.find_cutlass()
    except build_ext.BuildInputError as err:
        pytest.skip(f"no CUTLASS headers to bundle here: {err}")


@pytest.fixture(scope="module")
def bundle(cutlass_include, tmp_path_factory):
    """A fresh header bundle (what `make gpu-bundle` puts in .gpu/cutlass) in a temp folder."""
    dest = tmp_path_factory.mktemp("gpu") / "cutlass"
    files = gpu_bundle.copy_headers(cutlass_include, dest / "include")
    return dest, files


def test_bundle_main_writes_manifest_and_prints_the_command(cutlass_include, tmp_path, capsys):
    """`make gpu-bundle` end to end (headers only): the manifest, the size and the command."""
    out = tmp_path / "gpu"
    args = ["--out", str(out), "--no-wheels", "--no-ext", "--no-triton-cache"]
    assert gpu_bundle.main(args) == 0
    printed = capsys.readouterr().out
    manifest = json.loads((out / "MANIFEST.json").read_text())
    headers = [p for p in (out / "cutlass").rglob("*") if p.is_file()]
    assert manifest["headers"] == len(headers) > 100
    assert manifest["header_bytes"] == sum(p.stat().st_size for p in headers)
    assert manifest["wheels"] == [] and manifest["wheel_bytes"] == 0
    assert manifest["extension"] == [] and manifest["extension_archs"] is None  # --no-ext
    assert manifest["triton_cache"] is None  # --no-triton-cache
    assert manifest["total_bytes"] < manifest["limit_bytes"] == 64 * 2**20
    assert f"tools/gpu_check.py --bundle {os.path.relpath(out, ROOT)}" in printed
    assert (out / "cutlass" / "include" / "cutlass" / "version.h").is_file()
    # every wheel the bundle downloads maps to the module gpu_check probes before installing it
    for spec in gpu_bundle.WHEELS:
        assert spec.split("==")[0].replace("-", "_") in gpu_check.WHEEL_MODULES, spec


def test_header_closure_follows_includes_regardless_of_conditionals(tmp_path):
    inc = tmp_path / "include"
    (inc / "lib" / "detail").mkdir(parents=True)
    (inc / "lib" / "a.h").write_text('#include "detail/b.h"\n#include <vector>\n')
    (inc / "lib" / "detail" / "b.h").write_text('#if 0\n#  include "lib/c.h"\n#endif\n')
    (inc / "lib" / "c.h").write_text("// leaf\n")
    (inc / "lib" / "unused.h").write_text("// never included\n")
    src = tmp_path / "k.cu"
    src.write_text('#include "lib/a.h"\n#include <cuda_runtime_api.h>\n')
    closure = gpu_bundle.header_closure([src], inc)
    assert closure == [Path("lib/a.h"), Path("lib/c.h"), Path("lib/detail/b.h")]
    copied = gpu_bundle.copy_headers(inc, tmp_path / "out", sources=[src])
    out = tmp_path / "out"
    assert sorted(p.relative_to(out) for p in out.rglob("*.h")) == copied


def test_bundle_has_every_header_csrc_names(bundle, cutlass_include):
    dest, files = bundle
    inc = dest / "include"
    direct = set()
    for src in gpu_bundle.csrc_sources():
        direct |= set(re.findall(r'#include\s+"((?:cutlass|cute)/[^"]+)"', src.read_text()))
    assert direct, "csrc/ includes no CUTLASS header?"
    for name in sorted(direct) + ["cutlass/version.h"]:
        assert (inc / name).is_file(), name
    # The build's own finder accepts the bundle, and it is a pruned copy of the package.
    env_before = os.environ.get("CUTLASS_DIR")
    os.environ["CUTLASS_DIR"] = str(dest)
    try:
        assert gpu_bundle.load_build_ext().find_cutlass() == dest / "include"
    finally:
        os.environ.pop("CUTLASS_DIR")
        if env_before is not None:
            os.environ["CUTLASS_DIR"] = env_before
    total = sum(1 for p in cutlass_include.rglob("*") if p.is_file())
    assert len(files) < total


def test_what_travels_fits_the_device_limit(bundle):
    dest, _ = bundle
    headers = gpu_bundle.folder_bytes(dest)
    # The wheels as `make gpu-bundle` downloaded them, else an allowance for them (~1.2 MiB).
    wheels = gpu_bundle.folder_bytes(ROOT / ".gpu" / "wheels") or 4 * 2**20
    tree = gpu_bundle.tree_bytes(gpu_bundle.travelling_files())
    total = headers + wheels + tree
    assert total < gpu_bundle.LIMIT_BYTES, f"{total / 2**20:.1f} MiB travels"
    assert headers < 32 * 2**20, f"headers alone {headers / 2**20:.1f} MiB"


def _nvcc():
    path = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    return path if os.path.exists(path) else None


GENCODES = {"sm90": "arch=compute_90a,code=sm_90a", "sm100": "arch=compute_100a,code=sm_100a"}


def _instance_cmd(nvcc, include: Path, arch: str, *extra) -> list[str]:
    return [nvcc, "-std=c++17", "--expt-relaxed-constexpr", f"-I{ROOT / 'csrc'}", f"-I{include}",
            f"-DMTP_ARCH={arch}", "-DMTP_OP=kFwd", "-DMTP_DTYPE=kBF16", "-gencode", GENCODES[arch],
            *extra, str(ROOT / "csrc" / "grouped_gemm_instance.cu")]  # fmt: skip


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_bundle_alone_satisfies_the_preprocessor(bundle, cutlass_include, tmp_path, arch):
    """nvcc -M runs the host and the device pass's preprocessor: a header missing from the
    bundle is a fatal error, and every CUTLASS dependency must come from the bundle."""
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("no nvcc")
    dest, _ = bundle
    deps = tmp_path / "deps.d"
    cmd = _instance_cmd(nvcc, dest / "include", arch, "-M", "-o", str(deps))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_clean_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    paths = deps.read_text().replace("\\\n", " ").split()[1:]
    ours = [p for p in paths if re.search(r"/(cutlass|cute)/", p) and "/csrc/" not in p]
    assert len(ours) > 100
    outside = [p for p in ours if not Path(p).resolve().is_relative_to(dest.resolve())]
    assert not outside, outside[:5]
    assert not any(str(cutlass_include) in p for p in paths)


@pytest.mark.slow
def test_bundle_alone_compiles_one_instantiation(bundle, tmp_path):
    """The real thing for sm_90a (one instantiation: about a minute and 3.6 GiB)."""
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("no nvcc")
    dest, _ = bundle
    cmd = _instance_cmd(nvcc, dest / "include", "sm90", "-O3",
                        "-DNDEBUG", "-Xcompiler", "-fPIC", "-c", "-o", str(tmp_path / "k.o"))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_clean_env(), timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "k.o").stat().st_size > 10_000


# ----------------------------------------------------------------------------------------------
# gpu_check
# ----------------------------------------------------------------------------------------------


def _dry_run(bundle_dir, out, *extra, wait=True):
    cmd = [sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--dry-run", "--out", str(out),
           "--bundle", str(bundle_dir), *extra]  # fmt: skip
    if not wait:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=_clean_env(), cwd=ROOT)  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, env=_clean_env(), timeout=600,
                          cwd=ROOT)  # fmt: skip


def test_plan_orders_steps_by_value_within_540_s():
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--plan"],
                          capture_output=True, text=True, env=_clean_env(), timeout=60)
    lines = [line.split() for line in proc.stdout.strip().splitlines()]
    steps = [name for name, _ in lines[:-1]]
    assert steps == ["env", "sweep", "smoke", "build", "grouped_gemm", "moe_layer", "pytest",
                     "linear_cross_entropy", "graphs", "cross_entropy", "bias_act", "permute",
                     "quantize", "ncu"]  # the tuning sweep first: the most valuable use of a lease
    assert int(dict(lines[:-1])["sweep"]) == max(int(s) for _, s in lines[:-1])
    total = sum(int(s) for _, s in lines[:-1])
    assert lines[-1] == ["total", str(total)] and total <= 540
    assert int(dict(lines[:-1])["build"]) == 0  # only when the carried module fails to load
    assert int(dict(lines[:-1])["ncu"]) == 0  # only on time left over


def test_dry_run_walks_every_step(bundle, tmp_path):
    dest, _ = bundle
    out = tmp_path / "out"
    proc = _dry_run(dest.parent, out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = proc.stdout[proc.stdout.index("== mtp gpu-check") :]
    rows = {line.split()[0]: line for line in table.splitlines()[2:2 + len(gpu_check.PLAN)]}
    assert list(rows) == [name for name, _ in gpu_check.PLAN], table
    for name in gpu_check.BENCH_STEPS + ("graphs", "ncu", "sweep"):
        assert "not run: no GPU" in rows[name], rows[name]
    assert "tests: not run: no GPU" in table and "bench: not run: no GPU" in table
    collected = re.search(r"\((\d+) of (\d+) tests collected with -m gpu\)", rows["pytest"])
    assert collected and 0 < int(collected.group(1)) < int(collected.group(2)), rows["pytest"]
    assert "modules imported, 0 failed" in rows["smoke"], rows["smoke"]
    if _nvcc():  # the build plan was made against the bundle, for sm_90a only
        assert rows["build"].split()[1:3] == ["dry-run", "ok"], rows["build"]
    assert sorted(p.name for p in out.iterdir()) == [
        "env.json", "failures.txt", "gpu-check.tar.gz", "pytest.log", "summary.txt"]
    assert (out / "summary.txt").read_text().strip() == table.split("\n(unpack")[0].strip()
    env = json.loads((out / "env.json").read_text())
    import torch
    import triton

    assert (env["torch"], env["triton"], env["dry_run"]) == (torch.__version__, triton.__version__,
                                                             True)  # fmt: skip
    with tarfile.open(out / "gpu-check.tar.gz") as tar:
        names = set(tar.getnames())
        build_log = tar.extractfile("dry-run/gpu-check/build.log").read().decode()
        bench_log = tar.extractfile("dry-run/gpu-check/bench-grouped_gemm.log").read().decode()
    assert {"dry-run/gpu-check/summary.txt", "dry-run/gpu-check/steps.json",
            "dry-run/gpu-check/pytest.log", "dry-run/gpu-check/smoke.json"} <= names
    assert "--quick" in bench_log and "--no-plots" in bench_log and "--budget-s" in bench_log
    if _nvcc():
        assert f"-I{dest / 'include'}" in build_log and "code=sm_90a" in build_log
        assert "sm_100" not in build_log


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_killed_dry_run_keeps_its_finished_steps(tmp_path, sig):
    """Killed in the middle of a step (SIGTERM: packs on the way out; SIGKILL: nothing runs on
    the way out), --out still holds every step finished before."""
    out = tmp_path / "out"
    proc = _dry_run(tmp_path / "no-bundle", out, "--dry-step-s", "4", "--only", "smoke",
                    "grouped_gemm", "moe_layer", "graphs", wait=False)  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:  # wait until grouped_gemm is packed, moe_layer running
            steps = _packed_steps(out)
            if "grouped_gemm" in steps:
                break
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.2)
        time.sleep(1)
        proc.send_signal(sig)
        proc.wait(timeout=60)
    finally:
        proc.kill()
    steps = _packed_steps(out)
    assert steps[:3] == ["env", "smoke", "grouped_gemm"], steps
    assert "moe_layer" not in steps and "graphs" not in steps
    if sig == signal.SIGTERM:
        assert steps[-1] == "(signal)" and proc.returncode == 128 + signal.SIGTERM
    assert (out / "summary.txt").exists() and "grouped_gemm" in (out / "summary.txt").read_text()


def _packed_steps(out: Path) -> list[str]:
    try:
        with tarfile.open(out / "gpu-check.tar.gz") as tar:
            data = tar.extractfile("dry-run/gpu-check/steps.json").read()
    except (FileNotFoundError, KeyError, tarfile.TarError, EOFError):
        return []
    return [s["step"] for s in json.loads(data)]


def test_venv_mode_detection():
    venv_mode = _load("venv_mode")
    assert venv_mode.mode("/opt/torch/.venv", "/usr", has_gpu=True) == "reuse"
    assert venv_mode.mode("/usr", "/usr", has_gpu=True) == "system-site"
    assert venv_mode.mode("/work/.venv", "/usr", has_gpu=False) == "create"
    assert venv_mode.mode("/usr", "/usr", has_gpu=False) == "create"


def _checker(tmp_path):
    return gpu_check.Checker(gpu_check.parse_args(["--dry-run", "--out", str(tmp_path / "o")]))


def test_time_box_kills_the_whole_step(tmp_path):
    checker = _checker(tmp_path)
    log, pidfile = tmp_path / "step.log", tmp_path / "pid"
    t0 = time.monotonic()
    status, rc, seconds = checker.run(
        ["bash", "-c", f"sleep 60 & echo $! > {pidfile}; echo started; wait"], log, cap=1.5,
        reserve=0,
    )  # fmt: skip
    assert status.startswith("timeout") and rc is None
    assert time.monotonic() - t0 < 15 and 1.4 < seconds < 15
    assert "started" in log.read_text() and "killed after" in log.read_text()
    grandchild = int(pidfile.read_text())
    for _ in range(50):  # the background sleep went with its process group
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the step's background process survived the time box")
    # The next step runs; a step with no budget left is skipped, not started.
    assert checker.run([sys.executable, "-c", "print(7)"], log, cap=30, reserve=0)[:2] == ("ok", 0)
    assert checker.run(["false"], log, cap=30, reserve=0)[0] == "failed (rc 1)"
    checker.deadline = time.monotonic()
    assert checker.run(["true"], log, cap=30)[0] == "skipped (budget)"


def test_step_deadlines_are_cumulative_shares(tmp_path):
    """A step that ends early gives its time to the next: each deadline is the start plus the
    shares up to and including the step."""
    checker = _checker(tmp_path)
    total = 0
    for name, seconds in gpu_check.PLAN:
        total += seconds
        assert checker.step_deadline(name) == pytest.approx(checker.start + total)
    assert checker.deadline == pytest.approx(checker.start + total)


def test_junit_counts(tmp_path):
    xml = tmp_path / "j.xml"
    xml.write_text(textwrap.dedent("""\
        <?xml version="1.0" encoding="utf-8"?>
        <testsuites><testsuite name="pytest" tests="5">
          <testcase classname="tests.test_a" name="test_ok"/>
          <testcase classname="tests.test_a" name="test_ok2"/>
          <testcase classname="tests.test_b" name="test_bad"><failure message="x"/></testcase>
          <testcase classname="tests.test_b" name="test_err"><error message="y"/></testcase>
          <testcase classname="tests.test_c" name="test_skip"><skipped message="z"/></testcase>
        </testsuite></testsuites>"""))
    counts = gpu_check.junit_counts(xml)
    assert (counts["tests"], counts["passed"], counts["failed"], counts["errors"],
            counts["skipped"]) == (5, 2, 1, 1, 1)  # fmt: skip
    assert counts["first_failure"] == "tests.test_b::test_bad"
    assert gpu_check.tests_text(counts).startswith("2 passed, 1 failed, 1 errors, 1 skipped")


def _rec(case, provider, kind, ms=None, status="ok", op="grouped_gemm", pas="fwd"):
    rec = dict(op=op, case=case, provider=provider, kind=kind, status=status, note="")
    rec["pass"] = pas
    if ms is not None:
        rec["timing"] = {"median_ms": ms}
    return rec


def test_bench_table_best_backend_and_ratios():
    records = [
        _rec("a", "triton", "mtp", 2.0), _rec("a", "multistream", "mtp", 3.0),
        _rec("a", "reference", "baseline", 4.0), _rec("a", "torch.compile", "baseline", 1.0),
        _rec("a", "te", "peer", status="failed"),
        _rec("b", "triton", "mtp", 5.0), _rec("b", "multistream", "mtp", 4.0),
        _rec("b", "reference", "baseline", 12.0), _rec("b", "torch.compile", "baseline", 8.0),
        _rec("c", "triton", "mtp", status="skipped"), _rec("c", "reference", "baseline", 1.0),
        _rec("x", "fused", "mtp", 0.5, op="bias_act"), _rec("x", "reference", "baseline", 1.5,
                                                            op="bias_act"),
    ]  # fmt: skip
    lines = gpu_check.bench_table({"gpu_timing": True, "records": records})
    rows = {tuple(line.split()[:2]): line for line in lines[2:] if line.split()}
    gg = rows[("grouped_gemm", "fwd")]
    # case a: best triton 2 ms (reference 2x, compile 0.5x); case b: best multistream 4 ms
    # (reference 3x, compile 2x); case c has no timed mtp backend and is left out.
    assert re.search(r"\s2\s+multistream 1, triton 1\s", gg), gg
    assert f"{math.sqrt(2.0 * 4.0):.4g}" in gg
    assert f"reference {math.sqrt(2.0 * 3.0):.2f}x" in gg and "torch.compile 1.00x" in gg
    ba = rows[("bias_act", "fwd")]
    assert "fused 1" in ba and "0.5" in ba and "reference 3.00x" in ba
    assert lines[-1] == "failed records: grouped_gemm/te"
    assert gpu_check.bench_table({"gpu_timing": False, "records": []}) == [
        "bench: not run: no GPU"]


def test_check_failed_rows_never_reach_the_summary():
    """A provider whose check failed is timed (for the record) but can top nothing."""
    records = [_rec("a", "triton", "mtp", 2.0), _rec("a", "cutlass", "mtp", 0.1, status="failed"),
               _rec("a", "F.grouped_mm", "baseline", 0.05, status="failed"),
               _rec("a", "torch", "mtp", 3.0)]  # fmt: skip
    lines = gpu_check.bench_table({"gpu_timing": True, "records": records})
    row = next(line for line in lines if line.startswith("grouped_gemm"))
    assert "triton 1" in row and "cutlass" not in row and "F.grouped_mm" not in row, row
    assert lines[-1] == "failed records: grouped_gemm/F.grouped_mm, grouped_gemm/cutlass"


def test_live_failures_plugin_writes_failing_ids_as_they_happen(tmp_path):
    (tmp_path / "test_x.py").write_text(
        "def test_ok():\n    pass\n\ndef test_bad():\n    assert 1 == 2, 'boom'\n")
    failures = tmp_path / "failures.txt"
    env = _clean_env(MTP_FAILURES_FILE=str(failures))
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(ROOT / "tools")])
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "pytest_live_failures",
                           "-p", "no:cacheprovider", "-n", "2", str(tmp_path / "test_x.py")],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 1, proc.stdout[-2000:]
    lines = failures.read_text().splitlines()
    assert len(lines) == 1 and lines[0].startswith("test_x.py::test_bad [call]"), lines
    text = gpu_check.failures_text(failures)
    assert text[0] == "failing tests (1):" and "test_bad" in text[1]


def test_graphs_table_reads_the_bench_json():
    data = {"device": "x", "rows": [
        {"model": "dense", "tokens": 128, "mode": "eager", "host_ms": 6.0, "device_ms": 2.0,
         "launches": 400},
        {"model": "dense", "tokens": 128, "mode": "graphed", "host_ms": 1.5, "device_ms": 1.0,
         "launches": 8}]}  # fmt: skip
    lines = gpu_check.graphs_table(data)
    assert lines[0].startswith("graphs") and "4.0x host" in lines[-1] and " 8 " in lines[-1]
    assert gpu_check.graphs_table({"rows": []}) == []


# ----------------------------------------------------------------------------------------------
# triton_min_check
# ----------------------------------------------------------------------------------------------


def test_selects_aot_test_files_and_their_importers(tmp_path):
    (tmp_path / "test_a.py").write_text("from mtp.testing import compile_for_targets\n")
    (tmp_path / "test_b.py").write_text("from test_a import helper\n")
    (tmp_path / "test_c.py").write_text("from test_b import other\n")
    (tmp_path / "test_d.py").write_text("import torch\n")
    (tmp_path / "helpers.py").write_text("compile_for_targets\n")
    names = [p.name for p in triton_min.aot_test_files(tmp_path)]
    assert names == ["test_a.py", "test_b.py", "test_c.py"]
    real = [p.name for p in triton_min.aot_test_files()]
    assert "test_ops_grouped_gemm.py" in real and "test_gpu_kit.py" not in real


def test_jit_kernels_and_coverage(tmp_path):
    (tmp_path / "m.py").write_text(textwrap.dedent("""\
        import triton
        from triton import jit

        @triton.jit
        def _leaf(x):
            return x

        @jit
        def _helper(x):
            return _leaf(x) + 1

        @triton.jit
        def kernel(p):
            _helper(p)

        @triton.jit
        def lonely(p):
            pass

        def host():
            kernel[(1,)](0)
        """))
    found = triton_min.jit_kernels(tmp_path)
    assert sorted(found) == ["m._helper", "m._leaf", "m.kernel", "m.lonely"]
    assert triton_min.covered_kernels(found, {"m.kernel": {90}}) == {"m.kernel", "m._helper",
                                                                    "m._leaf"}  # fmt: skip
    stems = {p.stem for p in (ROOT / "kernels").rglob("*.py")}  # subpackages too
    assert all(k.split(".")[0] in stems for k in triton_min.jit_kernels())


def _target():
    pass


def _calls_target():
    return _target()


def _indirect():
    return [_calls_target() for _ in range(1)]


def _unrelated():
    return len("x")


def test_reaches_follows_helpers():
    assert triton_min.reaches(_indirect, _target)
    assert triton_min.reaches(_calls_target, _target)
    assert not triton_min.reaches(_unrelated, _target)


PLANTED = '''
import triton
import triton.language as tl

from mtp.testing import compile_for_targets


@triton.jit
def _good_kernel(x_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs) * 2.0)


@triton.jit
def _bad_kernel(x_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.sum(tl.{api}(tl.load(x_ptr + offs), 0), 0))


def _build(kernel):
    return compile_for_targets(kernel, {{"x_ptr": "*fp32"}}, {{"BLOCK": 16}}, targets=(90,))


def test_good():
    assert _build(_good_kernel)[90].arch == "sm_90a"


def test_bad():
    _build(_bad_kernel)


def test_not_a_compile_test():
    pass
'''


def _run_plugin(python, folder: Path, api: str, want: str):
    (folder / "test_planted.py").write_text(PLANTED.format(api=api))
    cmd = [python, "-m", "pytest", "-p", "triton_min_check", "-p", "no:cacheprovider", "-q",
           "test_planted.py"]  # fmt: skip
    return subprocess.run(cmd, cwd=folder, capture_output=True, text=True, timeout=600,
                          env=_clean_env(MTP_MIN_TRITON=want))  # fmt: skip


def test_plugin_fails_when_a_kernel_does_not_compile(tmp_path):
    import triton

    version = ".".join(triton.__version__.split(".")[:2])
    proc = _run_plugin(sys.executable, tmp_path, "not_an_api_in_any_triton", version)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert "1 failed, 1 passed, 1 deselected" in out, out[-3000:]
    assert "not_an_api_in_any_triton" in out
    assert f"AOT compile under triton {triton.__version__}" in out
    proc = _run_plugin(sys.executable, tmp_path, "not_an_api_in_any_triton", "2.0")
    assert proc.returncode != 0 and "is not the minimum 2.0.x" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_min_venv_rejects_an_api_newer_than_triton_3_6(tmp_path):
    """tl.unsqueeze (triton >= 3.7) compiles under the newest triton, not under 3.6."""
    python = ROOT / ".venv-min" / "bin" / "python"
    if not python.exists():
        pytest.skip("no .venv-min (make test-triton-min creates it)")
    proc = _run_plugin(str(python), tmp_path, "unsqueeze", triton_min.MIN_TRITON)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "1 failed, 1 passed" in out, out[-3000:]
    assert "has no attribute 'unsqueeze'" in out


def test_progress_of_a_killed_pytest(tmp_path):
    log = tmp_path / "pytest.log"
    log.write_text("$ python -m pytest -m gpu -x -q\n..s.F                  [ 40%]\n"
                   "..E.ss                 [ 90%]\nsomething else .F\n")
    assert gpu_check.progress_text(log) == "6 passed, 1 failed, 1 errors, 3 skipped (from the log)"


def test_smoke_imports_everything_and_runs_one_call_per_family(tmp_path):
    """tools/gpu_smoke.py, here under the interpreter (on the GPU: the first seconds of a lease)."""
    report = tmp_path / "smoke.json"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_smoke.py"), "--json",
                           str(report)], capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env=_clean_env(TRITON_INTERPRET="1"))  # fmt: skip
    data = json.loads(report.read_text())
    assert not data["imports"]["failed"] and len(data["imports"]["ok"]) > 60, data["imports"]
    assert {"mtp.kernels.grouped_gemm_details.fill", "mtp.bench.cli"} <= set(data["imports"]["ok"])
    families = {c["family"] for c in data["calls"]}
    assert families == {"bias_act", "cross_entropy", "linear_cross_entropy", "permute",
                        "quantize", "grouped_gemm", "moe_layer"}  # fmt: skip
    assert all(c["ok"] for c in data["calls"]), [c for c in data["calls"] if not c["ok"]]
    assert proc.returncode == 0, proc.stdout[-2000:]


def test_bundle_builds_the_cuda_module_for_the_gpu_python(tmp_path, monkeypatch):
    """`make gpu-bundle` builds csrc/ with a CPython 3.12 (the GPU machines') for sm_90a and
    sm_100a and carries the module in .gpu/ext/ (the lease then runs no nvcc); the manifest
    lists it with its architectures. The nvcc build itself is stood in for here."""
    calls = []

    def fake_run(cmd, check=False, env=None, cwd=None, **kw):
        calls.append((cmd, env))
        build_dir = Path(cmd[cmd.index("--build-dir") + 1])
        build_dir.mkdir(parents=True, exist_ok=True)
        (build_dir / "_cuda_gemm.cpython-312-x86_64-linux-gnu.so").write_bytes(b"\x7fELF fake")
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(gpu_bundle.subprocess, "run", fake_run)
    monkeypatch.setattr(gpu_bundle, "ROOT", tmp_path)
    so = gpu_bundle.build_extension(tmp_path / "gpu", Path("/opt/py312/bin/python"))
    (cmd, env), = calls
    assert cmd[0] == "/opt/py312/bin/python" and cmd[1].endswith("csrc/build_ext.py")
    assert env["MTP_CUDA_ARCH_LIST"] == "9.0a;10.0a"
    assert so == tmp_path / "gpu" / "ext" / "_cuda_gemm.cpython-312-x86_64-linux-gnu.so"
    assert so.read_bytes() == b"\x7fELF fake"
    assert gpu_bundle.EXT_FOLDER == "ext" and gpu_check.EXT_FOLDER == "ext"


def test_find_python_prefers_gpu_python_then_pyenv(tmp_path, monkeypatch):
    monkeypatch.setenv("GPU_PYTHON", "/somewhere/python3.12")
    assert gpu_bundle.find_python() == Path("/somewhere/python3.12")
    monkeypatch.delenv("GPU_PYTHON")
    exe = tmp_path / "versions" / "3.12.1" / "bin" / "python3.12"
    exe.parent.mkdir(parents=True)
    exe.write_text("")
    monkeypatch.setenv("PYENV_ROOT", str(tmp_path))
    assert gpu_bundle.find_python() == exe


# --------------------------------------------------------------------------------------------
# tools/gpu_ncu.py: one profiler reading per slow kernel
# --------------------------------------------------------------------------------------------

NCU_DETAILS = '''==PROF== Connected to process 1
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","1","python3","h","_permute_rows","1","7","(256, 1, 1)","(8192, 1, 1)","0","9.0","GPU Speed Of Light Throughput","DRAM Throughput","%","41.20"
"0","1","python3","h","_permute_rows","1","7","(256, 1, 1)","(8192, 1, 1)","0","9.0","GPU Speed Of Light Throughput","Duration","us","98.1"
"0","1","python3","h","_permute_rows","1","7","(256, 1, 1)","(8192, 1, 1)","0","9.0","Launch Statistics","Registers Per Thread","register/thread","38"
"1","1","python3","h","_histogram","1","7","(128, 1, 1)","(1, 1, 1)","0","9.0","Occupancy","Achieved Occupancy","%","6.1"
'''


def test_ncu_summary_keeps_one_row_per_launch_with_units():
    ncu = _load("gpu_ncu")
    rows = ncu.summarise(NCU_DETAILS)
    assert rows == [
        {"kernel": "_permute_rows", "dram_pct": "41.20 %", "duration": "98.1 us",
         "registers": "38 register/thread"},
        {"kernel": "_histogram", "occupancy_pct": "6.1 %"},
    ]
    assert ncu.summarise("==ERROR== no kernels were profiled") == []


def test_ncu_targets_are_bench_cases_and_bad_ones_are_named():
    ncu = _load("gpu_ncu")
    for target in ncu.DEFAULT_TARGETS:
        _, case = ncu._case(*ncu.parse_target(target))
        assert case.bytes and case.pass_ == ncu.parse_target(target)[1]
    with pytest.raises(ValueError, match="target must be op:pass"):
        ncu.parse_target("permute:backward")


def test_ncu_without_ncu_profiles_the_smoke_case_on_cpu(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run(
        [sys.executable, "tools/gpu_ncu.py", "--out", str(tmp_path), "--no-ncu", "--size",
         "smoke", "--targets", "unpermute:fwd", "--timeout", "120"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    (row,) = json.loads((tmp_path / "kernels.json").read_text())
    assert row["rc"] == 0 and row["tool"] == "torch.profiler", row
    # On CPU the profiler sees the call's range and its aten ops (the eager path calls the
    # Triton kernels directly, without the custom op's record; the interpreter has no kernels)
    names = [k["kernel"] for k in row["kernels"]]
    assert "unpermute:fwd" in names and len(names) > 1, row


def test_smoke_counts_a_missing_peer_as_skipped_and_a_broken_module_as_failed(monkeypatch):
    """A GPU machine without torchtitan: ``mtp.integrations.torchtitan`` is skipped (the first
    H200 run of this module counted it as a failed import, and the step as failed)."""
    smoke = _load("gpu_smoke")
    real = smoke.importlib.import_module

    def fake_import(name, *args):
        if name == "mtp.integrations.torchtitan":
            raise ModuleNotFoundError("No module named 'torchtitan'", name="torchtitan")
        if name == "mtp.ops.bias_act":
            raise ModuleNotFoundError("No module named 'mtp.ops._gone'", name="mtp.ops._gone")
        return real(name, *args)

    monkeypatch.setattr(smoke, "importlib", types.SimpleNamespace(import_module=fake_import))
    report = smoke.import_all()
    assert set(report["skipped"]) == {"mtp.integrations.torchtitan"}
    assert set(report["failed"]) == {"mtp.ops.bias_act"}
