"""Run a pure-Python call under a wall-clock deadline, stopping it when the deadline passes.

Used for chat templates: Jinja compiles a template to Python bytecode, so a
template that loops for minutes is stopped by raising an exception inside the
thread that renders it (``PyThreadState_SetAsyncExc``); a thread that merely
stopped being waited for would keep burning a core. A single long C call (one
huge string operation) is only interrupted when it returns to bytecode.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class DeadlineExceeded(Exception):
    """The call ran past its deadline and was stopped."""


class _Stop(BaseException):
    # a BaseException: the code being stopped (Jinja, transformers) catches Exception, not this
    pass


def _set_async_exc(thread_id: int, exc: type[BaseException] | None) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc else None)


def call_with_deadline(fn: Callable[[], T], seconds: float | None) -> T:
    """``fn()`` in the calling thread; past ``seconds`` it is interrupted and ``DeadlineExceeded`` raised.

    ``seconds`` None or <= 0 runs ``fn`` unbounded.
    """
    if seconds is None or seconds <= 0:
        return fn()
    thread_id = threading.get_ident()
    lock = threading.Lock()
    state = {"done": False, "fired": False}

    def fire() -> None:
        with lock:
            if not state["done"]:
                state["fired"] = True
                _set_async_exc(thread_id, _Stop)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    try:
        timer.start()
        try:
            result = fn()
        finally:
            with lock:
                state["done"] = True
                if state["fired"]:
                    # the stop may still be pending (fn returned just as it fired): clear it here
                    _set_async_exc(thread_id, None)
            timer.cancel()
    except _Stop:
        raise DeadlineExceeded(f"stopped after {seconds:g} s") from None
    return result
