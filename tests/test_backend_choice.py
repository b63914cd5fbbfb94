"""mtp.ops._backend.resolve_backend."""

import pytest
import torch

from mtp import settings
from mtp.kernels import _common
from mtp.ops._backend import resolve_backend

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_auto_is_triton_on_cuda_and_reference_on_cpu(monkeypatch):
    settings.configure(backend=None)
    assert resolve_backend("op", "auto", CUDA, ("triton", "reference")) == "triton"
    assert resolve_backend("op", "auto", CPU, ("triton", "reference")) == "reference"


def test_env_steers_auto_only_when_the_op_has_it(monkeypatch):
    monkeypatch.setenv("MTP_BACKEND", "multistream")
    settings.reload()
    assert resolve_backend("gg", "auto", CUDA, ("triton", "multistream", "reference")) == "multistream"
    assert resolve_backend("gelu", "auto", CUDA, ("triton", "reference")) == "triton"
    assert resolve_backend("gg", "reference", CUDA, ("triton", "multistream", "reference")) == "reference"


def test_errors(monkeypatch):
    with pytest.raises(ValueError, match=r"op: unknown backend 'cuda'; choose one of \['auto'"):
        resolve_backend("op", "cuda", CPU, ("triton", "reference"))
    with pytest.raises(TypeError, match="backend must be a str"):
        resolve_backend("op", None, CPU, ("triton", "reference"))
    monkeypatch.setattr(_common, "_INTERPRET", False)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        resolve_backend("op", "triton", CPU, ("triton", "reference"))
