"""Build of the optional CUDA extension ``mtp._cuda_gemm`` (CUTLASS grouped GEMM, csrc/).

One code path serves three callers:

* ``setup.py`` (``extensions(root)`` + ``cmdclass()``): ``pip install`` builds the extension when
  nvcc is found and its build inputs are importable (``pip install --no-build-isolation -e .``
  in an environment with ``nvidia-cutlass``, ``pybind11`` and ``ninja``), or always with
  ``MTP_BUILD_CUDA=1`` (then a missing input is an error). Otherwise it is skipped with a
  message and the install stays pure Python/Triton.
* ``make cuda-ext`` / ``python csrc/build_ext.py --inplace``: the same build, placed next to
  ``mtp/__init__.py``; incremental (ninja), used by ``make test`` for the compile check.
* the tests (``tests/test_cutlass_build.py``), which call the pure helpers below.

Inputs: nvcc (``CUDA_HOME``/``CUDA_PATH``, ``PATH``, ``/usr/local/cuda``), CUTLASS headers from
``CUTLASS_DIR`` or the ``nvidia-cutlass`` wheel (``cutlass_library/source/include``), pybind11
headers (the ``pybind11`` package, else the copy inside torch), ninja (the ``ninja`` package or
``PATH``). Architectures: ``MTP_CUDA_ARCH_LIST`` (or ``TORCH_CUDA_ARCH_LIST``), e.g. ``"9.0a;10.0a"``;
only 9.0(a) and 10.0(a) have kernels, other entries are ignored. Parallel compiler processes:
``MAX_JOBS`` (default: 2 when the machine has >= 2 cores and >= 16 GiB, else 1; one
instantiation needs about 3.6 GiB). ``MTP_NVCC_LAUNCHER`` prefixes every nvcc command (e.g.
``"/usr/bin/time -f '%e s %M KiB'"`` to measure each instantiation).

Each (architecture, op, dtype) instantiation is its own object built from
``csrc/grouped_gemm_instance.cu`` with ``-D`` flags, for its own architecture only.
This file must not import torch (setup.py runs it in an isolated build environment).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

MODULE = "_cuda_gemm"  # imported as mtp._cuda_gemm
OPS = ("kFwd", "kFwdTransB", "kWgrad")
DTYPES = ("kBF16", "kFP16")
#: Second kernel families built with an architecture: name and ops. The small-group families
#: (``Sm90SmallConfig``: ping-pong, 64-row tiles, no cluster; ``Sm100SmallConfig``: 1-SM UMMA,
#: 64 x 128 tiles) cover the forward / data-gradient ops; the weight gradient's tiles span the
#: weights, not the experts' rows.
SMALL_FAMILIES = {
    "sm90": ("sm90_small", ("kFwd", "kFwdTransB")),
    "sm100": ("sm100_small", ("kFwd", "kFwdTransB")),
}
# arch name -> (nvcc -gencode value, compute capability). "a" targets: TMA/WGMMA/tcgen05 need them.
ARCHS = {
    "sm90": ("arch=compute_90a,code=sm_90a", "9.0a"),
    "sm100": ("arch=compute_100a,code=sm_100a", "10.0a"),
}
MIN_NVCC = {"sm90": (12, 3), "sm100": (12, 8)}
MIN_CUTLASS = (3, 9)  # sm100 pointer-array grouped GEMM
ENV_ARCHS = ("MTP_CUDA_ARCH_LIST", "TORCH_CUDA_ARCH_LIST")


class BuildInputError(RuntimeError):
    """A build input (nvcc, CUTLASS, pybind11, ninja) is missing or too old."""


# ----------------------------------------------------------------------------------------------
# Finding the inputs
# ----------------------------------------------------------------------------------------------


def find_nvcc() -> Path | None:
    """nvcc from CUDA_HOME / CUDA_PATH, then PATH, then /usr/local/cuda; None if absent."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home and (Path(home) / "bin" / "nvcc").exists():
            return Path(home) / "bin" / "nvcc"
    found = shutil.which("nvcc")
    if found:
        return Path(found)
    default = Path("/usr/local/cuda/bin/nvcc")
    return default if default.exists() else None


def nvcc_version(nvcc: Path) -> tuple[int, int]:
    """(major, minor) of the CUDA release nvcc reports."""
    out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, check=True)
    match = re.search(r"release (\d+)\.(\d+)", out.stdout)
    if not match:
        raise BuildInputError(f"cannot read the CUDA release from `{nvcc} --version`")
    return int(match.group(1)), int(match.group(2))


def cuda_root(nvcc: Path) -> Path:
    """The toolkit folder (with include/ and lib64/) of an nvcc, following wrapper scripts."""
    real = Path(os.path.realpath(nvcc))
    root = real.parent.parent
    if (root / "include" / "cuda_runtime_api.h").exists():
        return root
    # /usr/local/bin/nvcc may be a shell wrapper: `exec /usr/local/cuda-13.0/bin/nvcc "$@"`.
    try:
        text = real.read_text(errors="ignore")[:4096]
    except OSError:
        text = ""
    match = re.search(r"(/\S+)/bin/nvcc", text)
    if match and (Path(match.group(1)) / "include" / "cuda_runtime_api.h").exists():
        return Path(match.group(1))
    fallback = Path("/usr/local/cuda")
    if (fallback / "include" / "cuda_runtime_api.h").exists():
        return fallback
    raise BuildInputError(f"cannot find the CUDA toolkit headers next to {nvcc}; set CUDA_HOME")


def cutlass_version(include: Path) -> tuple[int, int, int]:
    """CUTLASS (major, minor, patch) from cutlass/version.h."""
    text = (include / "cutlass" / "version.h").read_text()
    parts = [re.search(rf"#define CUTLASS_{k}\s+(\d+)", text) for k in ("MAJOR", "MINOR", "PATCH")]
    if not all(parts):
        raise BuildInputError(f"cannot read the CUTLASS version from {include}/cutlass/version.h")
    return tuple(int(p.group(1)) for p in parts)  # type: ignore[return-value]


def find_cutlass() -> Path:
    """CUTLASS include folder: CUTLASS_DIR (repo root or include/), else the nvidia-cutlass wheel."""
    candidates = []
    env = os.environ.get("CUTLASS_DIR")
    if env:
        candidates += [Path(env) / "include", Path(env)]
    else:
        spec = importlib.util.find_spec("cutlass_library")
        if spec is not None and spec.origin:
            candidates.append(Path(spec.origin).parent / "source" / "include")
    for inc in candidates:
        if (inc / "cutlass" / "version.h").exists() and (inc / "cute").is_dir():
            version = cutlass_version(inc)
            if version[:2] < MIN_CUTLASS:
                raise BuildInputError(
                    f"CUTLASS {'.'.join(map(str, version))} at {inc} is too old: the sm100 "
                    f"grouped GEMM needs >= {'.'.join(map(str, MIN_CUTLASS))} "
                    "(pip install 'nvidia-cutlass==4.2.*')"
                )
            return inc
    where = f"CUTLASS_DIR={env}" if env else "the nvidia-cutlass package"
    raise BuildInputError(
        f"CUTLASS headers not found in {where}: `pip install 'nvidia-cutlass==4.2.*'` "
        "or set CUTLASS_DIR to a CUTLASS checkout"
    )


def find_pybind11() -> Path:
    """pybind11 include folder: the pybind11 package, else the copy torch ships (not imported)."""
    spec = importlib.util.find_spec("pybind11")
    if spec is not None and spec.origin:
        pkg = Path(spec.origin).parent
        for inc in (pkg / "include", pkg.parent / "include"):
            if (inc / "pybind11" / "pybind11.h").exists():
                return inc
    spec = importlib.util.find_spec("torch")
    if spec is not None and spec.origin:
        inc = Path(spec.origin).parent / "include"
        if (inc / "pybind11" / "pybind11.h").exists():
            return inc
    raise BuildInputError("pybind11 headers not found: `pip install pybind11`")


def find_ninja() -> Path:
    """The ninja executable: the one the ninja package put next to this Python, else PATH."""
    exe = "ninja" + (sysconfig.get_config_var("EXE") or "")
    for folder in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        if folder and (Path(folder) / exe).is_file():
            return Path(folder) / exe
    found = shutil.which("ninja")
    if found:
        return Path(found)
    raise BuildInputError("ninja not found: `pip install ninja`")


def parse_arch_list(value: str | None) -> list[str]:
    """Architectures to build from a TORCH_CUDA_ARCH_LIST-style string.

    ``"9.0a;10.0a"`` -> ``["sm90", "sm100"]``. ``9.0``/``sm_90``/``90`` (with or without ``a``)
    select sm90; ``10.0``/``sm_100``/``100`` select sm100; ``+PTX`` suffixes and other
    architectures are ignored (no kernels exist for them). None or empty -> both.
    """
    if value is None or not value.strip():
        return list(ARCHS)
    picked = []
    for raw in re.split(r"[;,\s]+", value.strip()):
        token = raw.lower().replace("+ptx", "").replace("sm_", "").replace("compute_", "")
        token = token.rstrip("af")
        if token in ("9.0", "90"):
            name = "sm90"
        elif token in ("10.0", "100"):
            name = "sm100"
        else:
            continue
        if name not in picked:
            picked.append(name)
    return [a for a in ARCHS if a in picked]


def requested_archs() -> tuple[list[str], str]:
    """(archs, source) from MTP_CUDA_ARCH_LIST, else TORCH_CUDA_ARCH_LIST, else both."""
    for var in ENV_ARCHS:
        value = os.environ.get(var)
        if value and value.strip():
            return parse_arch_list(value), f"{var}={value}"
    return list(ARCHS), "default"


def default_jobs() -> int:
    """Parallel nvcc processes: MAX_JOBS, else 2 if cores and memory allow (3.6 GiB each)."""
    env = os.environ.get("MAX_JOBS", "").strip()
    if env:
        return max(1, int(env))
    cores = os.cpu_count() or 1
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem_gib = 8.0
    return 2 if cores >= 2 and mem_gib >= 16 else 1


# ----------------------------------------------------------------------------------------------
# The build plan and its ninja file
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Instance:
    """One kernel instantiation: an object file built from grouped_gemm_instance.cu."""

    arch: str  # "sm90", "sm100", or a second family "sm90_small" / "sm100_small"
    op: str
    dtype: str

    @property
    def name(self) -> str:
        return f"{self.arch}_{self.op[1:].lower()}_{self.dtype[1:].lower()}"

    @property
    def target(self) -> str:
        """The architecture it is compiled for (a key of :data:`ARCHS`)."""
        return self.arch.removesuffix("_small")


def instances(archs: list[str]) -> list[Instance]:
    out = [Instance(a, op, dt) for a in archs for op in OPS for dt in DTYPES]
    for a in archs:
        if a in SMALL_FAMILIES:
            family, ops = SMALL_FAMILIES[a]
            out += [Instance(family, op, dt) for op in ops for dt in DTYPES]
    return out


@dataclass
class BuildConfig:
    root: Path
    build_dir: Path
    nvcc: Path
    cuda: Path
    cutlass: Path
    pybind11: Path
    archs: list[str]
    debug: bool = False

    @property
    def ext_suffix(self) -> str:
        return sysconfig.get_config_var("EXT_SUFFIX") or ".so"

    @property
    def output(self) -> Path:
        return self.build_dir / f"{MODULE}{self.ext_suffix}"


def nvcc_flags(cfg: BuildConfig) -> list[str]:
    opt = ["-O0", "-g", "-lineinfo"] if cfg.debug else ["-O3", "-DNDEBUG"]
    return [
        "-std=c++17", *opt, "--expt-relaxed-constexpr",
        "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden",
        f"-I{cfg.root / 'csrc'}", f"-I{cfg.cutlass}",
    ]  # fmt: skip


def cxx_flags(cfg: BuildConfig) -> list[str]:
    defines = [f"-DMTP_WITH_{a.upper()}" for a in cfg.archs]
    return [
        "-std=c++17", "-O2", "-fPIC", "-fvisibility=hidden", *defines,
        f"-I{cfg.root / 'csrc'}", f"-I{cfg.pybind11}", f"-I{sysconfig.get_paths()['include']}",
        f"-I{cfg.cuda / 'include'}",
    ]  # fmt: skip


def link_flags(cfg: BuildConfig) -> list[str]:
    # The CUDA runtime is linked statically: the module then loads next to any torch build
    # (torch's own libcudart is not on the loader path), and only needs the driver.
    libdir = cfg.cuda / "lib64"
    if not (libdir / "libcudart_static.a").exists():
        libdir = cfg.cuda / "lib"
    return ["-shared", f"-L{libdir}", "-lcudart_static", "-ldl", "-lrt", "-lpthread"]


def _q(args: list[str] | tuple[str, ...]) -> str:
    """Shell-quoted words for a ninja variable used in a command."""
    return " ".join(shlex.quote(str(a)).replace("$", "$$") for a in args)


def _p(paths: list[Path] | tuple[Path, ...]) -> str:
    """Paths on a ninja build line (ninja escaping, not shell quoting)."""
    return " ".join(str(p).replace("$", "$$").replace(" ", "$ ").replace(":", "$:") for p in paths)


def ninja_file(cfg: BuildConfig) -> str:
    """The build.ninja text: one nvcc edge per instance, the bindings, the link."""
    cxx = os.environ.get("CXX", "c++")
    csrc = cfg.root / "csrc"
    headers = [csrc / "grouped_gemm.h", csrc / "grouped_gemm.cuh"]
    lines = [
        "# generated by csrc/build_ext.py; do not edit",
        "ninja_required_version = 1.5",
        f"nvcc = {_q(shlex.split(os.environ.get('MTP_NVCC_LAUNCHER', '')) + [str(cfg.nvcc)])}",
        f"cxx = {shlex.quote(cxx)}",
        f"nvcc_flags = {_q(nvcc_flags(cfg))}",
        f"cxx_flags = {_q(cxx_flags(cfg))}",
        f"link_flags = {_q(link_flags(cfg))}",
        "",
        "rule nvcc",
        "  command = $nvcc $nvcc_flags $defines -gencode $gencode -MD -MF $out.d -c $in -o $out",
        "  depfile = $out.d",
        "  deps = gcc",
        "  description = nvcc $out",
        "",
        "rule cxx",
        "  command = $cxx $cxx_flags -MD -MF $out.d -c $in -o $out",
        "  depfile = $out.d",
        "  deps = gcc",
        "  description = c++ $out",
        "",
        "rule link",
        "  command = $cxx $in $link_flags -o $out",
        "  description = link $out",
        "",
    ]
    objects = []
    src = _p([csrc / "grouped_gemm_instance.cu"])
    for inst in instances(cfg.archs):
        obj = f"obj/{inst.name}.o"
        objects.append(obj)
        defines = [f"-DMTP_ARCH={inst.arch}", f"-DMTP_OP={inst.op}", f"-DMTP_DTYPE={inst.dtype}"]
        lines += [
            f"build {obj}: nvcc {src} | {_p(headers)}",
            f"  defines = {_q(defines)}",
            f"  gencode = {ARCHS[inst.target][0]}",
        ]
    lines += [f"build obj/bindings.o: cxx {_p([csrc / 'bindings.cpp'])} | {_p(headers[:1])}"]
    objects.append("obj/bindings.o")
    lines += [f"build {cfg.output.name}: link {' '.join(objects)}", f"default {cfg.output.name}", ""]
    return "\n".join(lines)


def configure(root: Path, build_dir: Path | None = None, debug: bool = False) -> BuildConfig:
    """Find every input and check versions; raise BuildInputError naming what is missing."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise BuildInputError("nvcc not found: install the CUDA toolkit or set CUDA_HOME")
    archs, source = requested_archs()
    if not archs:
        raise BuildInputError(
            f"no architecture with grouped GEMM kernels selected ({source}); "
            "use MTP_CUDA_ARCH_LIST='9.0a;10.0a' (or one of them)"
        )
    version = nvcc_version(nvcc)
    for arch in archs:
        if version < MIN_NVCC[arch]:
            need = ".".join(map(str, MIN_NVCC[arch]))
            raise BuildInputError(
                f"nvcc {version[0]}.{version[1]} is too old for {arch} (needs CUDA >= {need}); "
                f"set MTP_CUDA_ARCH_LIST to the architectures it supports"
            )
    return BuildConfig(
        root=root,
        build_dir=build_dir or root / "build" / "cuda",
        nvcc=nvcc,
        cuda=cuda_root(nvcc),
        cutlass=find_cutlass(),
        pybind11=find_pybind11(),
        archs=archs,
        debug=debug,
    )


def build(cfg: BuildConfig, jobs: int | None = None, verbose: bool = False) -> Path:
    """Write build.ninja (only if it changed) and run ninja; return the linked module path."""
    ninja = find_ninja()
    cfg.build_dir.mkdir(parents=True, exist_ok=True)
    (cfg.build_dir / "obj").mkdir(exist_ok=True)
    text = ninja_file(cfg)
    path = cfg.build_dir / "build.ninja"
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    cmd = [str(ninja), "-C", str(cfg.build_dir), "-j", str(jobs or default_jobs())]
    if verbose:
        cmd.append("-v")
    print(f"mtp: building {MODULE} for {', '.join(cfg.archs)} with CUTLASS "
          f"{'.'.join(map(str, cutlass_version(cfg.cutlass)))} ({' '.join(cmd)})", flush=True)
    subprocess.run(cmd, check=True)
    return cfg.output


def install_inplace(cfg: BuildConfig, built: Path) -> Path:
    """Copy the module next to mtp/__init__.py (what an editable install imports)."""
    dest = cfg.root / "mtp" / built.name
    tmp = dest.with_suffix(dest.suffix + ".tmp")
    shutil.copy2(built, tmp)
    os.replace(tmp, dest)  # atomic: a running process keeps its mapped copy
    return dest


# ----------------------------------------------------------------------------------------------
# setuptools integration (used by setup.py)
# ----------------------------------------------------------------------------------------------


def build_mode() -> str:
    """``"off"`` (MTP_BUILD_CUDA=0), ``"force"`` (=1) or ``"auto"`` (unset: when nvcc is found)."""
    flag = os.environ.get("MTP_BUILD_CUDA", "").strip()
    return {"0": "off", "1": "force"}.get(flag, "auto")


def extensions(root: Path) -> list:
    """setuptools Extensions to build (``[]`` when skipped). Called by setup.py."""
    mode = build_mode()
    if mode == "off":
        return []
    try:
        configure(Path(root))
        find_ninja()
    except BuildInputError as err:
        if mode == "force":
            raise BuildInputError(f"MTP_BUILD_CUDA=1 but {err}") from err
        print(f"mtp: skipping the CUDA extension ({err}); pure Triton install. Build it later "
              "with `make cuda-ext`.", file=sys.stderr)
        return []
    from setuptools import Extension

    return [Extension(f"mtp.{MODULE}", sources=[])]


def cmdclass() -> dict:
    """``{"build_ext": ...}`` running the ninja build for mtp._cuda_gemm."""
    from setuptools.command.build_ext import build_ext

    class NinjaBuildExt(build_ext):
        def build_extension(self, ext):
            if ext.name != f"mtp.{MODULE}":
                return super().build_extension(ext)
            root = Path(__file__).resolve().parent.parent
            cfg = configure(root, debug=bool(self.debug))
            built = build(cfg, jobs=self.parallel if isinstance(self.parallel, int) else None)
            dest = Path(self.get_ext_fullpath(ext.name))
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(built, dest)

    return {"build_ext": NinjaBuildExt}


# ----------------------------------------------------------------------------------------------
# Command line: python csrc/build_ext.py --inplace [-j N] [--print-ninja]
# ----------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inplace", action="store_true", help="copy the module into mtp/")
    parser.add_argument("-j", "--jobs", type=int, default=None, help="parallel nvcc processes")
    parser.add_argument("--build-dir", type=Path, default=None, help="default: build/cuda")
    parser.add_argument("--debug", action="store_true", help="-O0 -g device code")
    parser.add_argument("--verbose", action="store_true", help="print every command")
    parser.add_argument("--print-ninja", action="store_true", help="print build.ninja and exit")
    args = parser.parse_args(argv)
    root = Path(__file__).resolve().parent.parent
    try:
        cfg = configure(root, args.build_dir, debug=args.debug)
    except BuildInputError as err:
        print(f"mtp: cannot build {MODULE}: {err}", file=sys.stderr)
        return 2
    if args.print_ninja:
        print(ninja_file(cfg))
        return 0
    built = build(cfg, jobs=args.jobs, verbose=args.verbose)
    print(f"mtp: built {built}")
    if args.inplace:
        print(f"mtp: installed {install_inplace(cfg, built)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
