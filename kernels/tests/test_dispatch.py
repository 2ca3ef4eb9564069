import pytest
import torch

from pagoda_kernels import dispatch
from pagoda_kernels.dispatch import KernelUnavailableError, use_triton


def test_auto_on_cpu_uses_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(dispatch.IMPL_ENV, raising=False)
    assert use_triton(torch.device("cpu")) is False


def test_triton_on_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(KernelUnavailableError, match="TRITON_INTERPRET=1"):
        use_triton(torch.device("cpu"), "triton")


def test_triton_on_cpu_under_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert use_triton(torch.device("cpu"), "triton") is True


def test_environment_forces_an_impl(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(dispatch.IMPL_ENV, "triton")
    assert use_triton(torch.device("cpu")) is True
    # An explicit per-call choice wins over the environment.
    assert use_triton(torch.device("cpu"), "torch") is False


def test_unknown_impl_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(dispatch.IMPL_ENV, "cuda-graph")
    with pytest.raises(ValueError, match="cuda-graph"):
        use_triton(torch.device("cpu"))
