"""The first seconds on a lent GPU: does mtp import and run there at all?

1. imports every module of the ``mtp`` package (``mtp.kernels`` and ``mtp.bench`` included) and
   the CUTLASS module ``mtp._cuda_gemm`` (carried prebuilt, see ``tools/gpu_bundle.py``);
2. unless ``--imports-only``: one tiny call per op family and mtp backend on the GPU, the bench's
   own first checked smoke case, forward and forward+backward, against the reference backend
   (``rel_err`` within the bench's limit, or the provider's own: FP8), so a torch / triton version mismatch shows in seconds
   rather than after minutes of benchmarks.

Writes ``--json`` (``imports``, ``cutlass``, ``calls``, ``summary``) as it goes, prints a line per
call. Exit code 0 when every import and call passed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _error(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


#: Modules that import a peer framework, which a GPU machine may not have: a missing peer
#: there is "skipped", not "failed".
PEER_MODULES = ("mtp.integrations.",)


def import_all() -> dict:
    """``{"ok": [...], "failed": {module: error}}`` over every module of the mtp package."""
    import mtp

    ok, failed = [], {}
    # mtp.kernels and mtp.bench are subpackages (links to kernels/ and bench/): the walk finds
    # them; the bench's pytest modules and its __main__ (which runs the CLI) are not imported.
    names = [m.name for m in pkgutil.walk_packages(mtp.__path__, "mtp.")
             if not m.name.rpartition(".")[2].startswith(("test_", "conftest", "__main__"))]
    skipped = {}
    for name in sorted(set(names) - {"mtp._cuda_gemm"}):
        try:
            importlib.import_module(name)
            ok.append(name)
        except ModuleNotFoundError as exc:  # an optional peer (torchtitan, ...) not installed
            if name.startswith(PEER_MODULES) and exc.name and not exc.name.startswith("mtp"):
                skipped[name] = _error(exc)
            else:
                failed[name] = _error(exc)
        except Exception as exc:  # noqa: BLE001 - report every broken module
            failed[name] = _error(exc)
    return {"ok": ok, "failed": failed, "skipped": skipped}


def cutlass_status() -> str:
    try:
        importlib.import_module("mtp._cuda_gemm")
    except Exception as exc:  # noqa: BLE001
        return _error(exc)
    return "ok"


def tiny_calls(report: dict, write) -> None:
    """One checked smoke case per op (first of each), every available mtp backend, on CUDA (on
    CPU under the interpreter where there is none: how the test suite runs this)."""
    import torch

    from mtp.bench.core import check_limit, rel_err
    from mtp.bench.env import prepare_runtime
    from mtp.bench.runner import load_modules

    device = torch.device("cuda" if prepare_runtime("auto") == "gpu" else "cpu")
    for module in load_modules():
        seen = set()
        for case in module.cases("smoke", torch.bfloat16):
            if not (case.check and case.execute) or (case.op, case.pass_) in seen:
                continue
            seen.add((case.op, case.pass_))
            setup = module.SETUP[case.op]
            try:
                expected = [t.detach() for t in setup(case, "reference", device).fn()]
            except Exception as exc:  # noqa: BLE001 - the reference broken: say so, go on
                _record(report, write, dict(family=module.FAMILY, op=case.op, pass_=case.pass_,
                                            provider="reference", ok=False, error=_error(exc),
                                            trace=traceback.format_exc()[-2000:], seconds=0.0))
                continue
            for provider in module.providers(case.op):
                if provider.kind != "mtp" or "+" in provider.name or provider.unavailable(device):
                    continue
                row = dict(family=module.FAMILY, op=case.op, pass_=case.pass_,
                           provider=provider.name)  # fmt: skip
                t0 = time.monotonic()
                try:
                    out = setup(case, provider.name, device).fn()
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    row["rel_err"] = rel_err([t.detach() for t in out], expected)
                    limit = provider.tolerance
                    row["ok"] = row["rel_err"] <= (check_limit(case.dtype) if limit is None
                                                   else limit)  # fmt: skip
                except Exception as exc:  # noqa: BLE001 - one broken call must not stop the rest
                    row.update(ok=False, error=_error(exc), trace=traceback.format_exc()[-2000:])
                row["seconds"] = round(time.monotonic() - t0, 2)
                _record(report, write, row)


def _record(report: dict, write, row: dict) -> None:
    report["calls"].append(row)
    print(f"{row['family']:<22}{row['op']:<22}{row['pass_']:<9}"
          f"{row['provider']:<16}{'ok' if row['ok'] else 'FAILED'} "
          f"{row.get('rel_err', row.get('error'))} ({row['seconds']} s)", flush=True)
    write()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--imports-only", action="store_true")
    args = parser.parse_args(argv)
    report: dict = {"imports": None, "cutlass": None, "calls": [], "summary": ""}

    def write() -> None:
        calls = report["calls"]
        imports = report["imports"] or {"ok": [], "failed": {}}
        skipped = len(imports.get("skipped", {}))
        report["summary"] = (
            f"{len(imports['ok'])} modules imported, {len(imports['failed'])} failed"
            + (f", {skipped} skipped (peer not installed)" if skipped else "") + "; "
            f"CUTLASS module: {report['cutlass']}; "
            f"{sum(c['ok'] for c in calls)}/{len(calls)} tiny calls ok"
        )
        args.json.write_text(json.dumps(report, indent=1) + "\n")

    report["imports"] = import_all()
    report["cutlass"] = cutlass_status()
    write()
    for name, err in report["imports"]["failed"].items():
        print(f"import {name}: {err}", flush=True)
    if not args.imports_only:
        tiny_calls(report, write)
    write()
    print(report["summary"], flush=True)
    failed = report["imports"]["failed"] or not all(c["ok"] for c in report["calls"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
