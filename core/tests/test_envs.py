"""pagoda.envs: one registry of every PAGODA_* variable (core's and the plugins'), read when asked, kept complete
by a scan of the repository."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagoda import envs
from pagoda.plugins import API_VERSION, PluginManager, hookimpl

REPO = Path(__file__).resolve().parents[2]
NAME = re.compile(r"PAGODA_[A-Z0-9_]+")
# PAGODA_* names that are not environment variables.
NOT_ENVIRONMENT = {"PAGODA_PLUGIN_API_VERSION": "the module attribute a plugin declares its API version in"}
SKIP_DIRS = {".git", "build", "dist", "node_modules", "__pycache__", ".venv", "venv"}


def _files(suffixes: tuple[str, ...]) -> list[Path]:
    return [
        p for p in REPO.rglob("*")
        if p.suffix in suffixes and p.is_file() and not SKIP_DIRS & set(p.relative_to(REPO).parts)
    ]


def _is_test_file(path: Path) -> bool:
    return "tests" in path.relative_to(REPO).parts


def names_in_python(source: str) -> set[str]:
    """Every string constant that is exactly a PAGODA_* name (what os.environ.get, setenv and
    typer's envvar= are given), from one Python file. Macros passed to a compiler sit inside
    longer strings ("-DPAGODA_X=1") and are not counted."""
    return {
        node.value for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and NAME.fullmatch(node.value)
    }


def _macro_names() -> set[str]:
    """PAGODA_* tokens of the C/C++ sources: preprocessor macros, which the docs may mention."""
    return {m for p in _files((".cpp", ".h", ".hpp", ".cc")) for m in NAME.findall(p.read_text(errors="replace"))}


def test_the_scan_finds_names_read_from_the_environment() -> None:
    source = 'import os\nos.environ.get("PAGODA_SOMETHING_NEW")\nflags = "-DPAGODA_MACRO=1"\nx = "PAGODA_"\n'
    assert names_in_python(source) == {"PAGODA_SOMETHING_NEW"}


def test_every_name_the_sources_use_is_listed() -> None:
    sources = [p for p in _files((".py",)) if not _is_test_file(p)]
    assert any(p.name == "platform.py" and "platform_cpu" in p.parts for p in sources)  # the scan reaches plugins
    used: dict[str, list[str]] = {}
    for path in sources:
        for name in names_in_python(path.read_text()):
            used.setdefault(name, []).append(str(path.relative_to(REPO)))
    assert {"PAGODA_PLUGINS", "PAGODA_CPU_THREADS", "PAGODA_KERNELS_IMPL"} <= set(used)
    missing = {n: files for n, files in used.items() if n not in envs.all_variables() and n not in NOT_ENVIRONMENT}
    assert missing == {}, f"declare these in pagoda/envs.py or the plugin's pagoda_add_env_vars (and docs/environment.md): {missing}"


def test_every_name_the_docs_mention_is_listed() -> None:
    docs = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    known = set(envs.all_variables()) | set(NOT_ENVIRONMENT) | _macro_names()
    unknown = {f"{p.relative_to(REPO)}: {n}" for p in docs for n in NAME.findall(p.read_text()) if n not in known}
    assert unknown == set()


def test_docs_list_every_variable_with_its_type() -> None:
    table = (REPO / "docs" / "environment.md").read_text()
    rows = {line.split("|")[1].strip().strip("`"): line for line in table.splitlines() if line.startswith("| `PAGODA_")}
    assert set(rows) == set(envs.all_variables())
    for name, var in envs.all_variables().items():
        assert var.type in rows[name], name
    assert "docs/environment.md" in (REPO / "README.md").read_text()


def test_values_are_read_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGODA_CPU_THREADS", raising=False)
    assert envs.PAGODA_CPU_THREADS is None
    monkeypatch.setenv("PAGODA_CPU_THREADS", "3")
    assert envs.PAGODA_CPU_THREADS == 3
    monkeypatch.setenv("PAGODA_CPU_THREADS", "  ")
    assert envs.PAGODA_CPU_THREADS is None  # empty is unset
    monkeypatch.setenv("PAGODA_DEVICE", "")
    assert envs.PAGODA_DEVICE == "auto"
    monkeypatch.setenv("PAGODA_CACHE_ROOT", "~/somewhere")
    assert envs.PAGODA_CACHE_ROOT == Path("~/somewhere").expanduser()


def test_empty_plugin_list_means_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGODA_PLUGINS", raising=False)
    assert envs.PAGODA_PLUGINS is None and not envs.is_set("PAGODA_PLUGINS")
    monkeypatch.setenv("PAGODA_PLUGINS", "")
    assert envs.PAGODA_PLUGINS == [] and envs.is_set("PAGODA_PLUGINS")
    monkeypatch.setenv("PAGODA_PLUGINS", "cpu, llama ,")
    assert envs.PAGODA_PLUGINS == ["cpu", "llama"]


@pytest.mark.parametrize(("raw", "value"), [("0", False), ("off", False), ("No", False), ("1", True), ("TRUE", True), ("", True)])
def test_booleans(monkeypatch: pytest.MonkeyPatch, raw: str, value: bool) -> None:
    monkeypatch.setenv("PAGODA_CPU_GEMM", raw)
    assert envs.PAGODA_CPU_GEMM is value


@pytest.mark.parametrize(
    ("name", "raw", "why"),
    [
        ("PAGODA_CPU_GEMM", "maybe", "is not a boolean"),
        ("PAGODA_CPU_THREADS", "four", "is not an integer"),
        ("PAGODA_CPU_THREADS", "0", "must be positive"),
        ("PAGODA_CPU_KVCACHE_SPACE", "lots", "is not a number of GiB"),
        ("PAGODA_CPU_KVCACHE_SPACE", "-1", "must be positive"),
        ("PAGODA_KERNELS_IMPL", "cuda", "is not one of auto, triton, torch"),
    ],
)
def test_a_bad_value_is_an_error_naming_the_variable(monkeypatch: pytest.MonkeyPatch, name: str, raw: str, why: str) -> None:
    monkeypatch.setenv(name, raw)
    with pytest.raises(ValueError, match=why) as caught:
        getattr(envs, name)
    assert name in str(caught.value)


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="PAGODA_NO_SUCH_VARIABLE"):
        envs.PAGODA_NO_SUCH_VARIABLE  # noqa: B018
    envs.all_variables()
    assert "PAGODA_CPU_THREADS" in dir(envs)


_PLUGIN_VAR = envs.EnvVar("PAGODA_TEST_PLUGIN_SWITCH", "bool", True, "A test plugin's switch.", "test-plugin",
                          envs.parse_bool)


@pytest.fixture
def forget_plugin_var() -> Iterator[None]:
    yield
    envs.ENVIRONMENT_VARIABLES.pop(_PLUGIN_VAR.name, None)


def test_a_plugin_declares_its_variables_with_a_hook(
    isolated_plugin_manager: PluginManager, monkeypatch: pytest.MonkeyPatch, forget_plugin_var: None
) -> None:
    class WithVariables:
        PAGODA_PLUGIN_API_VERSION = API_VERSION

        @hookimpl
        def pagoda_add_env_vars(self, registry: envs.EnvRegistry) -> None:
            registry.add(_PLUGIN_VAR)

    assert _PLUGIN_VAR.name not in envs.ENVIRONMENT_VARIABLES
    assert isolated_plugin_manager.register(WithVariables(), name="with-vars").status == "loaded"
    assert envs.all_variables()[_PLUGIN_VAR.name] is _PLUGIN_VAR
    monkeypatch.setenv(_PLUGIN_VAR.name, "off")
    assert envs.PAGODA_TEST_PLUGIN_SWITCH is False
    # a second manager (a worker's) registering the same plugin declares the same variable: no conflict
    assert PluginManager().register(WithVariables(), name="with-vars").status == "loaded"


def test_a_name_declared_twice_differently_is_refused() -> None:
    registry = envs.EnvRegistry([_PLUGIN_VAR])
    registry.add(_PLUGIN_VAR)
    with pytest.raises(ValueError, match="declared twice: by test-plugin and by other"):
        registry.add(envs.EnvVar(_PLUGIN_VAR.name, "int", 1, "other", "other", envs.parse_positive_int))
    with pytest.raises(ValueError, match="named PAGODA_"):
        registry.add(envs.EnvVar("VLLM_X", "int", 1, "x", "other", envs.parse_positive_int))


def test_a_process_that_loads_plugins_knows_their_variables() -> None:
    # what a worker or engine-core process does (pagoda.worker.process.replay_main_process_decisions):
    # load the main process's plugins, then read their variables through pagoda.envs
    code = ("import os; os.environ['PAGODA_CPU_THREADS'] = '3'\n"
            "from pagoda import envs\n"
            "from pagoda.plugins import load_plugins\n"
            "assert 'PAGODA_CPU_THREADS' not in envs.ENVIRONMENT_VARIABLES\n"
            "load_plugins(['cpu'])\n"
            "print(envs.ENVIRONMENT_VARIABLES['PAGODA_CPU_THREADS'].read_by, envs.PAGODA_CPU_THREADS)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["pagoda-platform-cpu", "3"]


def test_every_variable_is_described() -> None:
    for name, var in envs.all_variables().items():
        assert var.name == name and var.help and var.type and var.read_by
