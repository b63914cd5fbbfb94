"""CUTLASS grouped GEMM backend without a GPU: the build plan, the compiled module's SASS, and
the torch glue's argument checks (mtp/ops/grouped_gemm/cutlass.py).

The compile itself is `make cuda-ext`, which `make test` runs first when nvcc is present (and
then sets MTP_REQUIRE_CUDA_EXT=1 so that a missing module fails here instead of skipping).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mtp.ops.grouped_gemm import cutlass
from mtp.utils import simulated_capture

ROOT = Path(__file__).resolve().parent.parent


def _load_build_ext():
    spec = importlib.util.spec_from_file_location("_mtp_build_ext_test", ROOT / "csrc" / "build_ext.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


build_ext = _load_build_ext()


# ----------------------------------------------------------------------------------------------
# Build plan (csrc/build_ext.py)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, expected",
    [
        (None, ["sm90", "sm100"]),
        ("", ["sm90", "sm100"]),
        ("9.0a;10.0a", ["sm90", "sm100"]),
        ("10.0a 9.0a", ["sm90", "sm100"]),
        ("9.0", ["sm90"]),
        ("8.0;8.6;9.0+PTX", ["sm90"]),
        ("sm_100a", ["sm100"]),
        ("100a,90", ["sm90", "sm100"]),
        ("8.0;8.9", []),
        ("10.3a;12.0", []),
    ],
)
def test_parse_arch_list(value, expected):
    assert build_ext.parse_arch_list(value) == expected


def test_requested_archs_prefers_mtp_variable(monkeypatch):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    monkeypatch.setenv("MTP_CUDA_ARCH_LIST", "10.0a")
    archs, source = build_ext.requested_archs()
    assert archs == ["sm100"] and source == "MTP_CUDA_ARCH_LIST=10.0a"
    monkeypatch.delenv("MTP_CUDA_ARCH_LIST")
    assert build_ext.requested_archs()[0] == ["sm90"]
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST")
    assert build_ext.requested_archs() == (["sm90", "sm100"], "default")


def test_default_jobs(monkeypatch):
    monkeypatch.setenv("MAX_JOBS", "3")
    assert build_ext.default_jobs() == 3
    monkeypatch.delenv("MAX_JOBS")
    assert build_ext.default_jobs() in (1, 2)


def _config(tmp_path: Path, archs: list[str]):
    return build_ext.BuildConfig(
        root=ROOT, build_dir=tmp_path, nvcc=Path("/opt/cuda/bin/nvcc"), cuda=Path("/opt/cuda"),
        cutlass=Path("/opt/cutlass include"), pybind11=Path("/opt/pybind11"), archs=archs,
    )  # fmt: skip


def test_ninja_file_one_object_per_instantiation(tmp_path):
    text = build_ext.ninja_file(_config(tmp_path, ["sm90", "sm100"]))
    edges = re.findall(r"^build (obj/\S+\.o): nvcc .*\n  defines = (.*)\n  gencode = (.*)$",
                       text, flags=re.M)  # fmt: skip
    # 2 archs x 3 ops x 2 dtypes, plus each arch's small-group family (2 forward ops x 2 dtypes),
    # each its own compiler process
    assert len(edges) == 20
    for obj, defines, gencode in edges:
        arch = re.search(r"-DMTP_ARCH=(\w+)", defines).group(1)
        assert obj.startswith(f"obj/{arch}_")
        want = ("arch=compute_90a,code=sm_90a" if arch.startswith("sm90")
                else "arch=compute_100a,code=sm_100a")  # fmt: skip
        assert gencode == want, (obj, gencode)
    names = {obj for obj, _, _ in edges}
    assert "obj/sm100_wgrad_fp16.o" in names and "obj/sm90_fwdtransb_bf16.o" in names
    for arch in ("sm90", "sm100"):
        small = {n for n in names if n.startswith(f"obj/{arch}_small_")}
        assert small == {f"obj/{arch}_small_{op}_{dt}.o" for op in ("fwd", "fwdtransb")
                         for dt in ("bf16", "fp16")}, small  # fmt: skip
    # Bindings see only the compiled architectures; the CUDA runtime is linked statically.
    assert "-DMTP_WITH_SM90 -DMTP_WITH_SM100" in text
    assert "-lcudart_static" in text
    # A path with a space is shell-quoted in commands.
    assert "'-I/opt/cutlass include'" in text


def test_ninja_file_single_arch(tmp_path):
    text = build_ext.ninja_file(_config(tmp_path, ["sm100"]))
    assert "sm90" not in text.replace("MTP_WITH_SM100", "")
    assert text.count(": nvcc ") == 10  # 3 ops x 2 dtypes + the small family's 2 x 2
    assert "-DMTP_WITH_SM100" in text and "-DMTP_WITH_SM90" not in text


def test_extensions_skip_and_force(monkeypatch, capsys):
    def missing():
        raise build_ext.BuildInputError("CUTLASS headers not found")

    monkeypatch.setattr(build_ext, "find_cutlass", missing)
    monkeypatch.setenv("MTP_BUILD_CUDA", "0")
    assert build_ext.extensions(ROOT) == []
    monkeypatch.delenv("MTP_BUILD_CUDA")
    if build_ext.find_nvcc() is not None:
        assert build_ext.extensions(ROOT) == []  # auto: skipped with a message, install goes on
        assert "skipping the CUDA extension" in capsys.readouterr().err
    monkeypatch.setenv("MTP_BUILD_CUDA", "1")
    with pytest.raises(build_ext.BuildInputError, match="MTP_BUILD_CUDA=1 but"):
        build_ext.extensions(ROOT)


def test_configure_rejects_unsupported_arch_list(monkeypatch):
    if build_ext.find_nvcc() is None:
        pytest.skip("nvcc not found")
    monkeypatch.setenv("MTP_CUDA_ARCH_LIST", "8.0")
    with pytest.raises(build_ext.BuildInputError, match="no architecture"):
        build_ext.configure(ROOT)


def test_cutlass_dir_override(monkeypatch, tmp_path):
    inc = tmp_path / "include"
    (inc / "cutlass").mkdir(parents=True)
    (inc / "cute").mkdir()
    (inc / "cutlass" / "version.h").write_text(
        "#define CUTLASS_MAJOR 3\n#define CUTLASS_MINOR 5\n#define CUTLASS_PATCH 1\n"
    )
    monkeypatch.setenv("CUTLASS_DIR", str(tmp_path))
    with pytest.raises(build_ext.BuildInputError, match="too old"):
        build_ext.find_cutlass()
    (inc / "cutlass" / "version.h").write_text(
        "#define CUTLASS_MAJOR 4\n#define CUTLASS_MINOR 2\n#define CUTLASS_PATCH 0\n"
    )
    assert build_ext.find_cutlass() == inc
    monkeypatch.setenv("CUTLASS_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(build_ext.BuildInputError, match="CUTLASS_DIR="):
        build_ext.find_cutlass()


# ----------------------------------------------------------------------------------------------
# The compiled module (built by `make cuda-ext`)
# ----------------------------------------------------------------------------------------------


def _module_path() -> Path:
    spec = importlib.util.find_spec("mtp._cuda_gemm")
    if spec is None or spec.origin is None:
        reason = f"mtp._cuda_gemm is not built ({cutlass.BUILD_HINT})"
        if os.environ.get("MTP_REQUIRE_CUDA_EXT") == "1":
            pytest.fail(f"make cuda-ext ran but {reason}")
        pytest.skip(reason)
    return Path(spec.origin)


def _cuobjdump() -> tuple[str, dict[str, str]]:
    """cuobjdump and the environment that lets it find nvdisasm."""
    folders = []
    spec = importlib.util.find_spec("nvidia")
    if spec is not None and spec.submodule_search_locations:
        folders += [Path(p) / sub / "bin" for p in spec.submodule_search_locations
                    for sub in ("cu13", "cu12", "cuda_cuobjdump")]  # fmt: skip
    nvcc = build_ext.find_nvcc()
    if nvcc is not None:
        folders.append(build_ext.cuda_root(nvcc) / "bin")
    env = dict(os.environ)
    for folder in folders:
        exe = folder / "cuobjdump"
        if exe.exists():
            if (folder / "nvdisasm").exists():
                env["NVDISASM_PATH"] = str(folder / "nvdisasm")
                env["PATH"] = f"{folder}{os.pathsep}{env.get('PATH', '')}"
            return str(exe), env
    found = shutil.which("cuobjdump")
    if found:
        return found, env
    if os.environ.get("MTP_REQUIRE_CUDA_EXT") == "1":
        pytest.fail("cuobjdump not found (make cuda-ext installs nvidia-cuda-cuobjdump)")
    pytest.skip("cuobjdump not found: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm")


def sass_by_function(path: Path) -> dict[str, dict[str, str]]:
    """{arch: {function name: SASS text}} from ``cuobjdump -sass``."""
    exe, env = _cuobjdump()
    out = subprocess.run([exe, "-sass", str(path)], capture_output=True, text=True, env=env,
                         check=True, timeout=600).stdout  # fmt: skip
    result: dict[str, dict[str, str]] = {}
    arch = None
    function = None
    for line in out.splitlines():
        head = re.match(r"\s*arch = (sm_\w+)", line)
        if head:
            arch, function = head.group(1), None
            result.setdefault(arch, {})
            continue
        name = re.match(r"\s*Function : (\S+)", line)
        if name and arch is not None:
            function = name.group(1)
            result[arch][function] = ""
            continue
        if function is not None:
            result[arch][function] += line + "\n"
    return result


def test_module_sass_uses_tensor_cores():
    """sm_90a GEMM kernels issue HGMMA (wgmma); sm_100a ones UTC*MMA (tcgen05.mma)."""
    path = _module_path()
    sass = sass_by_function(path)
    assert set(sass) == {"sm_90a", "sm_100a"}, f"cubins found: {sorted(sass)}"
    wanted = {"sm_90a": r"\bHGMMA\.", "sm_100a": r"\bUTC\w*MMA\b"}
    for arch, pattern in wanted.items():
        gemms = {f: s for f, s in sass[arch].items() if "GemmUniversal" in f}
        count = 10  # 6 + the small-group family's 4
        assert len(gemms) == count, f"{arch}: expected {count} GEMM kernels, got {len(gemms)}"
        for function, text in gemms.items():
            assert re.search(pattern, text), f"{arch}: no {pattern} in {function[:120]}"
            assert "UTMALDG" in text, f"{arch}: no TMA load in {function[:120]}"
        prepare = [f for f in sass[arch] if "prepare_groups" in f]
        assert len(prepare) == count, f"{arch}: expected one problem-description kernel per GEMM"
    small = [f for f in sass["sm_90a"] if "GemmUniversal" in f and "Pingpong" in f]
    assert len(small) == 4, "the small-group family: fwd and fwd-transposed, bf16 and fp16"
    # sm_100a's small family: the 1-SM UMMA atom with a 64 x 128 tile (the default is 128 x 256)
    small = [f for f in sass["sm_100a"] if "GemmUniversal" in f and "Li64ELi128ELNS" in f]
    assert len(small) == 4, "sm_100a small-group family: fwd and fwd-transposed, bf16 and fp16"


def test_module_interface_without_gpu():
    _module_path()
    ext = cutlass.extension()
    assert sorted(ext.compiled_archs()) == [90, 100]
    # forward ops under 256 rows per expert (sm_90a; 128 on sm_100a) take the small-group
    # family; the wgrad never does
    assert ext.SMALL_ROWS_PER_GROUP == ext.small_rows_per_group(90) == 256
    assert ext.small_rows_per_group(100) == 128
    assert ext.small_groups(ext.OP_FWD, 8 * 255, 8) and ext.small_groups(ext.OP_FWD_TRANS_B, 0, 8)
    assert not ext.small_groups(ext.OP_FWD, 8 * 256, 8)
    assert not ext.small_groups(ext.OP_WGRAD, 10, 8)
    assert ext.small_groups(ext.OP_FWD, 8 * 127, 8, 100)
    assert not ext.small_groups(ext.OP_FWD, 8 * 128, 8, 100)
    assert not ext.small_groups(ext.OP_WGRAD, 10, 8, 100)
    setups = ext.kernel_setups()  # kernels are configured on their first launch only
    assert setups == 0 if not torch.cuda.is_available() else setups >= 0
    assert (ext.OP_FWD, ext.OP_FWD_TRANS_B, ext.OP_WGRAD) == (0, 1, 2)
    assert (ext.DTYPE_BF16, ext.DTYPE_FP16) == (cutlass._DTYPE_CODE[torch.bfloat16],
                                                cutlass._DTYPE_CODE[torch.float16])  # fmt: skip
    with pytest.raises(ValueError, match="op must be"):
        ext.workspace_size(7, 0, 4, 0)
    with pytest.raises(ValueError, match="dtype must be"):
        ext.workspace_size(0, 5, 4, 0)
    if not torch.cuda.is_available():
        ok, reason = cutlass.is_available()
        assert not ok and "no CUDA device" in reason


# ----------------------------------------------------------------------------------------------
# Torch glue: argument checks (no GPU needed: they run before the device is touched)
# ----------------------------------------------------------------------------------------------


def _fwd_args(m=32, k=16, n=24, e=3, dtype=torch.bfloat16, trans_b=False):
    x = torch.randn(m, k).to(dtype)
    w = torch.randn(e, n, k).to(dtype) if trans_b else torch.randn(e, k, n).to(dtype)
    tokens = torch.tensor([5, 0, 9][:e] + [0] * max(0, e - 3), dtype=torch.int32)
    out = torch.empty(m, n, dtype=dtype)
    return x, w, tokens, out


def test_is_available_names_what_to_do():
    ok, reason = cutlass.is_available()
    if not ok:
        assert "make cuda-ext" in reason or "backend=" in reason


@pytest.mark.parametrize(
    "change, exc, pattern",
    [
        (lambda a: {**a, "x": a["x"].float()}, TypeError, r"^x must have dtype"),
        (lambda a: {**a, "x": a["x"][None]}, ValueError, r"^x must be 2-D"),
        (lambda a: {**a, "w": a["w"].half()}, TypeError, r"^w must have dtype in \(bfloat16\)"),
        (lambda a: {**a, "w": a["w"][:, :8]}, ValueError, r"^w must have shape \[E, K, N\]"),
        (lambda a: {**a, "out": a["out"][:, :16]}, ValueError, r"^out must have shape"),
        (lambda a: {**a, "tokens_per_expert": a["tokens_per_expert"].float()}, TypeError,
         r"^tokens_per_expert must have dtype"),
        (lambda a: {**a, "tokens_per_expert": a["tokens_per_expert"][:2]}, ValueError,
         r"^tokens_per_expert must have shape \[3\]"),
        (lambda a: {**a, "x": torch.randn(16, 32).bfloat16().t()}, ValueError,
         r"^x must be contiguous"),
        (lambda a: {**a, "trans_b": 1}, TypeError, r"^trans_b must be a bool"),
        (lambda a: {**a, "x": torch.randn(32, 12).bfloat16(),
                    "w": torch.randn(3, 12, 24).bfloat16()}, ValueError,
         r"^x: rows must be 16-byte aligned .* K=12 is not a multiple of 8"),
        (lambda a: {**a, "w": torch.randn(3, 16, 20).bfloat16(),
                    "out": torch.empty(32, 20, dtype=torch.bfloat16)}, ValueError,
         r"^w: rows must be 16-byte aligned .* N=20"),
        (lambda a: a, ValueError, r"^x must be a CUDA tensor"),
    ],
)  # fmt: skip
def test_grouped_gemm_argument_errors(change, exc, pattern):
    x, w, tokens, out = _fwd_args()
    args = change({"x": x, "w": w, "tokens_per_expert": tokens, "trans_b": False, "out": out})
    with pytest.raises(exc, match=pattern):
        cutlass.grouped_gemm(**args)


def test_grouped_gemm_trans_b_shape_message():
    x, w, tokens, out = _fwd_args(trans_b=False)
    with pytest.raises(ValueError, match=r"^w must have shape \[E, N, K\] with K = x.shape\[1\] = 16"):
        cutlass.grouped_gemm(x, w, tokens, True, out)


@pytest.mark.parametrize(
    "change, exc, pattern",
    [
        (lambda a: {**a, "dy": a["dy"][:10]}, ValueError, r"^dy must have the rows of x"),
        (lambda a: {**a, "dy": a["dy"].half()}, TypeError, r"^dy must have dtype"),
        (lambda a: {**a, "out": a["out"][:, :, :8]}, ValueError, r"^out must have shape \[E, K, N\]"),
        (lambda a: {**a, "out": a["out"][0]}, ValueError, r"^out must be 3-D"),
        (lambda a: {**a, "dy": torch.randn(32, 20).bfloat16(),
                    "out": torch.empty(3, 16, 20, dtype=torch.bfloat16)}, ValueError,
         r"^dy: rows must be 16-byte aligned"),
        (lambda a: a, ValueError, r"^x must be a CUDA tensor"),
    ],
)  # fmt: skip
def test_wgrad_argument_errors(change, exc, pattern):
    x = torch.randn(32, 16).bfloat16()
    dy = torch.randn(32, 24).bfloat16()
    tokens = torch.tensor([5, 0, 9])
    out = torch.empty(3, 16, 24, dtype=torch.bfloat16)
    args = change({"x": x, "dy": dy, "tokens_per_expert": tokens, "out": out})
    with pytest.raises(exc, match=pattern):
        cutlass.grouped_gemm_wgrad(**args)


def test_check_routing():
    cutlass.check_routing(torch.tensor([3, 0, 5]), 8)  # exact fill is fine
    cutlass.check_routing(torch.tensor([1, 2], dtype=torch.int32), 8)
    with pytest.raises(ValueError, match="tokens_per_expert must be >= 0, got a count of -1"):
        cutlass.check_routing(torch.tensor([3, -1, 5]), 8)
    with pytest.raises(ValueError, match="sums to 9 but x has only 8 rows"):
        cutlass.check_routing(torch.tensor([4, 5]), 8)
    cutlass.check_routing(torch.tensor([4, 5]), 8, validate=False)
    with simulated_capture():  # as during a CUDA graph capture: no host sync, no check
        cutlass.check_routing(torch.tensor([4, 5]), 8)


def test_check_pointer_alignment():
    flat = torch.zeros(64 + 8, dtype=torch.bfloat16)
    aligned = flat[: 64].view(8, 8) if flat.data_ptr() % 16 == 0 else flat[8:].view(8, 8)
    cutlass.check_pointer_alignment("x", aligned)
    shifted = torch.zeros(64 + 8, dtype=torch.bfloat16)[1:65].view(8, 8)
    if shifted.data_ptr() % 16:
        with pytest.raises(ValueError, match=r"^x must start at a 16-byte aligned address"):
            cutlass.check_pointer_alignment("x", shifted)


def test_custom_ops_have_fake_implementations():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x, w, tokens, out = _fwd_args()
        assert torch.ops.mtp.cutlass_grouped_gemm(x, w, tokens, False, out) is None
        dy = torch.empty(32, 24, dtype=torch.bfloat16)
        dw = torch.empty(3, 16, 24, dtype=torch.bfloat16)
        assert torch.ops.mtp.cutlass_grouped_gemm_wgrad(x, dy, tokens, dw) is None
