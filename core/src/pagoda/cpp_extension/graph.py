"""Kernel graphs: record a forward pass's kernel calls once, replay them from C with no Python in between.

A decode step of a small model on CPU is a few hundred kernel calls of a few microseconds each,
and the Python around them (modules, wrappers, argument checks) costs about as much again. A
CUDA graph removes the same overhead on a GPU; this is its CPU counterpart, built on the one
binding every pagoda kernel module uses (``pagoda/python.h``):

* While ``capture(fn)`` runs ``fn`` on this thread, each kernel call made through a module's
  ``PAGODA_FUNCTION`` binding is recorded -- its invoker, its arguments in 8-byte slots, which of
  them are pointers, and its integer result -- besides being executed as usual.
* torch operations inside ``fn`` are seen by a ``TorchDispatchMode``: allocations and views are
  only kept alive (their memory is what recorded pointers refer to); compute ops are recorded and
  replayed as torch calls that write into the tensors they produced at capture; operations whose
  result depends on tensor values in ways a replay cannot reproduce (``.item()``, ``.tolist()``,
  ``.numpy()``, data-dependent output shapes) make the capture fail (``NotCapturable``) and the
  caller stays eager.
* Every pointer a recorded kernel call reads must lie in memory the graph keeps alive: tensors
  made during the capture, or tensors reachable from the ``roots`` the caller names (the model,
  the attention backend, the static input buffers). Anything else fails the capture: a pointer
  into a temporary freed after the capture would otherwise be read at every replay.

Replay runs each run of consecutive kernel calls as one C loop (GIL released) and the recorded
torch calls between them in order; a kernel whose integer result differs from the captured one
(an error status, a "not handled" flag) stops the replay with an error naming it.
"""

from __future__ import annotations

import bisect
import ctypes
import sys
import threading
import types
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["KernelGraph", "NotCapturable", "capture"]

ABI = 1  # pagoda/python.h kAbi

_RECORD = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64), ctypes.c_int64,
                           ctypes.c_uint64, ctypes.c_int64)
_NAME = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_char_p)
# CFUNCTYPE (not PYFUNCTYPE): ctypes releases the GIL around the replay loop
_REPLAY = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64))


class _Recorder(ctypes.Structure):
    _fields_ = [
        ("abi", ctypes.c_uint32),
        ("active", ctypes.c_int32),
        ("record", _RECORD),
        ("name", _NAME),
        ("replay", ctypes.c_void_p),
    ]


class NotCapturable(RuntimeError):
    """The forward pass did something a replay could not reproduce; the caller runs it eagerly."""


@dataclass
class _KernelCall:
    function: int  # the binding's call address (names it)
    invoker: int
    slots: list[int]
    pointer_mask: int
    result: int


@dataclass
class _TorchCall:
    op: torch._ops.OpOverload
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: list[torch.Tensor]  # written in place at replay (functional ops)
    mutating: bool


class _State:
    """The process's recorder (handed to kernel modules through ``_RECORDER``) and the capture in progress."""

    def __init__(self) -> None:
        self.names: dict[int, str] = {}
        self.lock = threading.Lock()
        self.thread: int | None = None
        self.calls: list[_KernelCall | _TorchCall] | None = None
        # ctypes callbacks must outlive every module that holds the recorder: kept here, for the process
        self._record = _RECORD(self._on_record)
        self._name = _NAME(self._on_name)
        self.recorder = _Recorder(ABI, 0, self._record, self._name, None)

    def _on_name(self, function: int, name: bytes) -> None:
        self.names[int(function)] = name.decode()

    def _on_record(self, function: int, invoker: int, slots: Any, count: int, pointer_mask: int, result: int) -> None:
        # another thread's kernel call while this one captures belongs to no graph
        if self.calls is None or threading.get_ident() != self.thread:
            return
        self.calls.append(_KernelCall(int(function), int(invoker), [slots[i] for i in range(count)], int(pointer_mask), int(result)))

    def replay_function(self) -> Any:
        if not self.recorder.replay:
            raise NotCapturable("no pagoda kernel module is loaded: there is nothing to replay")
        return _REPLAY(self.recorder.replay)


_STATE = _State()
_CAPSULE_NAME = b"pagoda.cpp_extension.graph._RECORDER"
_new_capsule = ctypes.pythonapi.PyCapsule_New
_new_capsule.restype = ctypes.py_object
_new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
# What pagoda/python.h's module init imports (PyCapsule_Import): the recorder's address.
_RECORDER = _new_capsule(ctypes.addressof(_STATE.recorder), _CAPSULE_NAME, None)


_ALLOCATIONS = {
    torch.ops.aten.empty.memory_format,
    torch.ops.aten.empty_like.default,
    torch.ops.aten.empty_strided.default,
    torch.ops.aten.new_empty.default,
    torch.ops.aten.new_empty_strided.default,
}
_VALUE_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default}


class _CaptureMode(TorchDispatchMode):
    """Keeps every tensor an op makes alive and records the ops a replay must run again."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch would wrap __torch_dispatch__ in a dynamo guard whose first call imports torch._dynamo
        # (~4 s); nothing here is ever compiled
        return False

    def __init__(self, calls: list[_KernelCall | _TorchCall], kept: list[torch.Tensor]) -> None:
        super().__init__()
        self.calls = calls
        self.kept = kept

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _VALUE_READS:
            raise NotCapturable(f"{func} reads a tensor's value on the host; a replay would reuse the captured one")
        tags = getattr(func, "tags", ())
        # integer indexing (a position table gathered per step) has the shape of its index; a mask's does not
        gather = func is torch.ops.aten.index.Tensor and all(
            i is None or i.dtype not in (torch.bool, torch.uint8) for i in args[1])
        if (torch.Tag.dynamic_output_shape in tags and not gather) or torch.Tag.data_dependent_output in tags:
            raise NotCapturable(f"{func}'s output depends on tensor values; a replay could not reproduce it")
        if torch.Tag.nondeterministic_seeded in tags:
            raise NotCapturable(f"{func} draws random numbers; a replay would repeat the captured ones")
        out = func(*args, **kwargs)
        outputs = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]
        self.kept.extend(outputs)
        if func in _ALLOCATIONS or (func.is_view and _aliases_an_input(outputs, args)):
            # (reshape, contiguous and to() may alias their input or copy it: only an alias is free)
            return out
        mutating = func._schema.is_mutable
        self.calls.append(_TorchCall(func, args, kwargs, [] if mutating else outputs, mutating))
        return out


def _aliases_an_input(outputs: list[torch.Tensor], args: tuple[Any, ...]) -> bool:
    storages = {t.untyped_storage().data_ptr() for t in _tensors_in(args, depth=2)}
    return all(t.untyped_storage().data_ptr() in storages for t in outputs)


_READ_VALUES = ("tolist", "numpy", "__array__")


class _UnrecordedWorkGuard:
    """Work a replay would miss, refused on the capturing thread: ``tolist`` / ``numpy`` read tensor
    memory without passing the dispatcher, Triton's interpreter computes behind it."""

    def __init__(self, thread: int) -> None:
        self.thread = thread
        self.saved: dict[str, Any] = {}
        self.triton: tuple[Any, Any] | None = None

    def __enter__(self) -> None:
        for name in _READ_VALUES:
            original = getattr(torch.Tensor, name)
            self.saved[name] = torch.Tensor.__dict__.get(name)

            def guarded(tensor: torch.Tensor, *args: Any, _original: Any = original, _name: str = name, **kwargs: Any) -> Any:
                if threading.get_ident() == self.thread:
                    raise NotCapturable(f"Tensor.{_name}() reads a tensor's values on the host during capture")
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, guarded)

        # Triton's interpreter (TRITON_INTERPRET=1, Triton kernels on CPU) computes in numpy over raw
        # pointers: neither a dispatcher op nor a recorded call, a replay would skip it
        interpreter = sys.modules.get("triton.runtime.interpreter")
        executor = getattr(interpreter, "GridExecutor", None)
        if executor is not None:
            launch = executor.__call__
            self.triton = (executor, launch)

            def guarded_launch(grid_executor: Any, *args: Any, **kwargs: Any) -> Any:
                if threading.get_ident() == self.thread:
                    raise NotCapturable("a Triton kernel runs in Triton's interpreter, which a replay cannot record")
                return launch(grid_executor, *args, **kwargs)

            executor.__call__ = guarded_launch

    def __exit__(self, *exc: object) -> None:
        for name, saved in self.saved.items():
            if saved is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, saved)
        if self.triton is not None:
            executor, launch = self.triton
            executor.__call__ = launch


class KernelGraph:
    """A captured forward: ``replay()`` runs its calls again on whatever the static inputs now hold."""

    def __init__(self, calls: list[_KernelCall | _TorchCall], kept: list[torch.Tensor], held: list[torch.Tensor],
                 names: dict[int, str]) -> None:
        # the memory recorded pointers refer to: the capture's own tensors, and the root tensors they point into
        self._kept, self._held = kept, held
        self._replay = _STATE.replay_function()
        self.num_kernel_calls = sum(isinstance(c, _KernelCall) for c in calls)
        self.num_torch_calls = len(calls) - self.num_kernel_calls
        self.own_bytes = sum(end - start for start, end, _ in _ranges(kept))
        self._segments: list[tuple[Any, list[str], list[int]] | _TorchCall] = []
        run: list[_KernelCall] = []
        for call in [*calls, None]:
            if isinstance(call, _KernelCall):
                run.append(call)
                continue
            if run:
                self._segments.append(_program(run, names))
                run = []
            if call is not None:
                self._segments.append(call)

    def replay(self) -> None:
        failed = ctypes.c_int64(0)
        for segment in self._segments:
            if isinstance(segment, _TorchCall):
                result = segment.op(*segment.args, **segment.kwargs)
                if not segment.mutating:
                    produced = result if isinstance(result, (tuple, list)) else (result,)
                    for kept, new in zip(segment.outputs, (t for t in produced if isinstance(t, torch.Tensor))):
                        if new.shape != kept.shape:
                            raise RuntimeError(f"kernel graph replay: {segment.op} made shape {tuple(new.shape)}, "
                                               f"{tuple(kept.shape)} when captured")
                        kept.copy_(new)
                continue
            program, names, expected = segment
            index = self._replay(ctypes.addressof(program), ctypes.byref(failed))
            if index >= 0:
                raise RuntimeError(f"kernel graph replay: {names[index]} returned {failed.value}, "
                                   f"where it returned {expected[index]} when captured")


def _program(calls: list[_KernelCall], names: dict[int, str]) -> tuple[Any, list[str], list[int]]:
    words: list[int] = [len(calls)]
    for call in calls:
        words += [call.invoker, call.result & 0xFFFFFFFFFFFFFFFF, len(call.slots), *call.slots]
    program = (ctypes.c_uint64 * len(words))(*words)
    return program, [names.get(c.function, hex(c.function)) for c in calls], [c.result for c in calls]


def capture(fn: Callable[[], torch.Tensor], roots: Iterable[Any]) -> tuple[KernelGraph, torch.Tensor]:
    """Run ``fn`` once, recording it; returns the graph and ``fn``'s output (which every replay rewrites).

    ``roots``: objects whose tensors (found through attributes, modules, containers) recorded
    kernel calls may point into besides the capture's own tensors -- the model, the attention
    backend and its prepared metadata, the static input buffers. Raises ``NotCapturable``.
    """
    calls: list[_KernelCall | _TorchCall] = []
    kept: list[torch.Tensor] = []
    with _STATE.lock:
        _STATE.thread, _STATE.calls = threading.get_ident(), calls
        _STATE.recorder.active = 1
        try:
            with _UnrecordedWorkGuard(threading.get_ident()), _CaptureMode(calls, kept):
                output = fn()
        finally:
            _STATE.recorder.active = 0
            _STATE.thread, _STATE.calls = None, None
    # a torch call's inputs made before the capture (a weight, a position table) stay alive through the call
    inputs = [t for call in calls if isinstance(call, _TorchCall) for t in _tensors_in((call.args, call.kwargs))]
    held = _check_pointers(calls, [*kept, *inputs], roots)
    return KernelGraph(calls, kept, held, _STATE.names), output


def _check_pointers(calls: list[_KernelCall | _TorchCall], kept: list[torch.Tensor], roots: Iterable[Any]) -> list[torch.Tensor]:
    """The root tensors recorded pointers fall in (to keep alive); NotCapturable for a pointer into anything else."""
    own = _ranges(kept)
    rooted: list[tuple[int, int, torch.Tensor]] | None = None
    needed: dict[int, torch.Tensor] = {}
    for call in calls:
        if not isinstance(call, _KernelCall):
            continue
        for i, slot in enumerate(call.slots):
            if not (call.pointer_mask >> i) & 1 or slot == 0 or _covered(own, slot) is not None:
                continue
            if rooted is None:
                rooted = _ranges(_tensors_in(roots))
            found = _covered(rooted, slot)
            if found is None:
                name = _STATE.names.get(call.function, hex(call.function))
                raise NotCapturable(f"{name}'s argument {i} points at memory that is neither made during the capture "
                                    "nor held by the model, backend or static inputs: a replay could read freed memory")
            needed[id(found)] = found
    return list(needed.values())


def _ranges(tensors: Iterable[torch.Tensor]) -> list[tuple[int, int, torch.Tensor]]:
    """The storages under ``tensors`` as sorted, disjoint (start, end, a tensor on it) spans."""
    by_start: dict[int, tuple[int, torch.Tensor]] = {}
    for t in tensors:
        if t.layout != torch.strided:
            # oneDNN's packed weights and sparse tensors have no storage a kernel's raw pointer could
            # point into; only torch calls read them, and a recorded torch call holds its arguments
            continue
        storage = t.untyped_storage()
        start = storage.data_ptr()
        if start:
            by_start[start] = (start + storage.nbytes(), t)
    return sorted((start, end, t) for start, (end, t) in by_start.items())


def _covered(spans: list[tuple[int, int, torch.Tensor]], address: int) -> torch.Tensor | None:
    i = bisect.bisect_right(spans, address, key=lambda span: span[0]) - 1
    # an address one past the end is a valid pointer for an empty tail
    return spans[i][2] if i >= 0 and address <= spans[i][1] else None


_OPAQUE = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.ModuleType, type)


def _tensors_in(root: Any, depth: int = 16) -> list[torch.Tensor]:
    """Every tensor reachable from ``root`` through modules, containers and object attributes."""
    found: list[torch.Tensor] = []
    seen: set[int] = set()
    # breadth first: an object is expanded where it is nearest the root, so the depth limit cuts the same
    # paths however deep a model nests its decoder (a multimodal model's language_model)
    stack: deque[tuple[Any, int]] = deque([(root, 0)])
    while stack:
        obj, level = stack.popleft()
        if id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int, float, bool, *_OPAQUE)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
            continue
        if level >= depth:
            continue
        if isinstance(obj, torch.nn.Module):
            children: Iterable[Any] = [*obj._parameters.values(), *obj._buffers.values(), *obj._modules.values(),
                                       *vars(obj).values()]
        elif isinstance(obj, dict):
            children = obj.values()
        elif isinstance(obj, (list, tuple, set, frozenset)):
            children = obj
        elif isinstance(obj, threading.local) or hasattr(obj, "__dict__"):
            children = vars(obj).values()
        elif hasattr(type(obj), "__slots__"):
            children = [getattr(obj, s, None) for s in type(obj).__slots__]
        else:
            continue
        stack.extend((child, level + 1) for child in children)
    return found
