"""pagoda.cpp_extension.graph: kernel calls recorded during a capture replay from C over changed inputs.

A small kernel module built with pagoda/python.h stands in for the platform's kernels; each test
compares a replay against running the same Python again, and checks that what a replay could
not reproduce fails the capture instead of replaying wrong."""

from __future__ import annotations

import shutil
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

from pagoda.cpp_extension import CppExtension
from pagoda.cpp_extension.graph import NotCapturable, capture

pytestmark = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler")

_SOURCE = """
#include <pagoda/python.h>
#include <pagoda/simd.h>
#include <cstdint>
// y[i] = a * x[i] + b (float and double arguments travel as 8-byte slots too)
PAGODA_EXPORT void axpb(const float* x, float* y, int64_t n, float a, double b) {
  for (int64_t i = 0; i < n; ++i) y[i] = a * x[i] + static_cast<float>(b);
}
// 0 while x[0] is not negative, else an error status (as the attention kernel reports bad metadata)
PAGODA_EXPORT int check_first(const float* x) { return x[0] < 0 ? 3 : 0; }
// a scalar argument taken from the data on the host would be baked in: the count is read from memory here
PAGODA_EXPORT void sum_first(const float* x, const int32_t* count, float* out) {
  float total = 0;
  for (int32_t i = 0; i < count[0]; ++i) total += x[i];
  out[0] = total;
}
PAGODA_PYTHON_MODULE(PAGODA_FUNCTION(axpb), PAGODA_FUNCTION(check_first), PAGODA_FUNCTION(sum_first))
"""


@pytest.fixture
def kernels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    monkeypatch.setenv("PAGODA_CACHE_ROOT", str(tmp_path / "cache"))
    name = f"pagoda_test_graph_{tmp_path.name.replace('-', '_')}"
    root = tmp_path / "pkgs" / name
    (root / "csrc").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "csrc" / "kernel.cpp").write_text(_SOURCE)
    monkeypatch.syspath_prepend(str(root.parent))
    yield CppExtension("pagoda_test_graph", name, ["csrc/kernel.cpp"]).library()
    sys.modules.pop(name, None)


class Static:
    """Inputs whose storage lives across replays, as the graph runner's static buffers do."""

    def __init__(self) -> None:
        self.x = torch.arange(8, dtype=torch.float32)
        self.table = torch.linspace(0, 1, 16)
        self.index = torch.tensor([1, 3], dtype=torch.int64)
        self.count = torch.tensor([4], dtype=torch.int32)


def _forward(k: ModuleType, s: Static) -> torch.Tensor:
    y = torch.empty(8)
    k.axpb(s.x.data_ptr(), y.data_ptr(), 8, 2.5, 0.25)
    z = y[2:] * 2 + s.table[s.index].sum()  # torch ops between kernels, a gather by index among them
    out = torch.empty(1)
    k.sum_first(z.data_ptr(), s.count.data_ptr(), out.data_ptr())
    assert k.check_first(s.x.data_ptr()) == 0
    return torch.cat([z, out])


def test_replay_equals_running_the_python_again(kernels: ModuleType) -> None:
    s = Static()
    graph, output = capture(lambda: _forward(kernels, s), [s])
    assert graph.num_kernel_calls == 3 and graph.num_torch_calls >= 3
    for step in range(3):
        s.x.copy_(torch.randn(8).abs() + step)
        s.index.copy_(torch.tensor([step, 15 - step]))
        s.count.fill_(step + 1)
        graph.replay()
        assert torch.equal(output, _forward(kernels, s))


def test_kernel_result_differing_from_the_capture_stops_the_replay(kernels: ModuleType) -> None:
    s = Static()
    graph, _ = capture(lambda: _forward(kernels, s), [s])
    s.x[0] = -1.0
    with pytest.raises(RuntimeError, match="check_first returned 3, where it returned 0"):
        graph.replay()


def test_reading_values_on_the_host_fails_the_capture(kernels: ModuleType) -> None:
    s = Static()

    def branches_on_data() -> torch.Tensor:
        y = torch.empty(8)
        kernels.axpb(s.x.data_ptr(), y.data_ptr(), int(s.count.tolist()[0]), 1.0, 0.0)
        return y

    with pytest.raises(NotCapturable, match="tolist"):
        capture(branches_on_data, [s])
    with pytest.raises(NotCapturable, match="value on the host"):
        capture(lambda: s.x * s.count.item(), [s])
    with pytest.raises(NotCapturable, match="depends on tensor values"):
        capture(lambda: s.x[s.x > 2], [s])
    assert s.count.tolist() == [4], "the guard is gone after the capture"


def test_pointer_into_memory_nothing_keeps_fails_the_capture(kernels: ModuleType) -> None:
    s = Static()
    temporary = torch.ones(8)  # made before the capture, held by no root: freed before any replay

    def reads_a_temporary() -> torch.Tensor:
        y = torch.empty(8)
        kernels.axpb(temporary.data_ptr(), y.data_ptr(), 8, 1.0, 0.0)
        return y

    with pytest.raises(NotCapturable, match="argument 0 points at memory"):
        capture(reads_a_temporary, [s])
    graph, output = capture(reads_a_temporary, [s, temporary])  # named as a root: kept alive by the graph
    graph.replay()
    assert torch.equal(output, temporary)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
def test_torch_calls_on_opaque_tensors_replay(kernels: ModuleType) -> None:
    # oneDNN's packed linear weights (what CPUs without AVX-512 run linears on) have no storage;
    # the capture used to fail on them with NotImplementedError and took every AVX2 CPU's engine down
    s = Static()
    packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn(4, 8), 64)
    assert packed.layout != torch.strided

    def linear_then_kernel() -> torch.Tensor:
        h = torch.ops.mkldnn._linear_pointwise(s.x.view(1, 8), packed, None, "none", [], "")
        y = torch.empty(4)
        kernels.axpb(h.data_ptr(), y.data_ptr(), 4, 2.0, 1.0)
        return y

    graph, output = capture(linear_then_kernel, [s, packed])
    s.x.copy_(torch.randn(8))
    graph.replay()
    assert torch.allclose(output, linear_then_kernel())


def test_kernel_calls_on_other_threads_are_not_recorded(kernels: ModuleType) -> None:
    s = Static()
    other = torch.empty(8)
    started, release = threading.Event(), threading.Event()

    def background() -> None:
        started.set()
        while not release.is_set():
            kernels.axpb(s.x.data_ptr(), other.data_ptr(), 8, 1.0, 0.0)

    thread = threading.Thread(target=background)
    thread.start()
    started.wait()
    try:
        graph, _ = capture(lambda: _forward(kernels, s), [s])
    finally:
        release.set()
        thread.join()
    assert graph.num_kernel_calls == 3


def test_ops_that_may_alias_or_copy_replay_when_they_copied(kernels: ModuleType) -> None:
    """reshape / contiguous / to() alias their input when they can and copy when not: a copy is work to redo."""
    s = Static()

    def forward() -> torch.Tensor:
        strided = s.x[::2].contiguous().to(torch.float64).reshape(2, 2).t().reshape(4).to(torch.float32)
        y = torch.empty(4)
        kernels.axpb(strided.data_ptr(), y.data_ptr(), 4, 1.0, 0.0)
        return y

    graph, output = capture(forward, [s])
    s.x.copy_(torch.randn(8))
    graph.replay()
    assert torch.equal(output, forward())


def test_triton_interpreter_launch_fails_the_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton kernels on CPU run in Triton's interpreter (numpy over raw pointers): nothing a replay could redo."""
    triton = pytest.importorskip("triton")
    import triton.language as tl

    monkeypatch.setenv("TRITON_INTERPRET", "1")

    @triton.jit
    def double(x_ptr, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        offsets = tl.arange(0, BLOCK)
        mask = offsets < n
        tl.store(x_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) * 2, mask=mask)

    x = torch.ones(8)
    double[(1,)](x, 8, BLOCK=8)  # outside a capture it runs
    assert torch.equal(x, torch.full((8,), 2.0))
    with pytest.raises(NotCapturable, match="Triton's interpreter"):
        capture(lambda: double[(1,)](x, 8, BLOCK=8) or x, [x])
    double[(1,)](x, 8, BLOCK=8)  # and runs again after the capture
    assert torch.equal(x, torch.full((8,), 4.0))
