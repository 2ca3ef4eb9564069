"""`pagoda collect-env`: what it reports, that secrets stay hidden, and that a broken probe never hides the rest."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
from importlib import metadata

import torch

from pagoda.entrypoints.cli.env_info import Section, collect, cpu_flags_report, env_rows, mask_secret, render


def test_env_rows_pick_pagoda_and_related_variables_and_mask_secrets() -> None:
    environ = {"PAGODA_DEVICE": "cpu", "PAGODA_API_KEY": "s3cret", "HOME": "/root", "OMP_NUM_THREADS": "4",
               "OPENAI_API_KEY": "sk-1", "PAGODA_CPU_THREADS": "8"}
    rows = env_rows(environ)
    assert rows == [("PAGODA_API_KEY", "***"), ("PAGODA_CPU_THREADS", "8"), ("PAGODA_DEVICE", "cpu"),
                    ("OMP_NUM_THREADS", "4")]
    assert mask_secret("PAGODA_CPU_THREADS", "8") == "8" and mask_secret("HF_TOKEN", "") == ""


def test_env_rows_flag_unknown_names_and_values_that_do_not_parse() -> None:
    rows = dict(env_rows({"PAGODA_CPU_THRADS": "8", "PAGODA_DISABLE_CACHE": "maybe", "PAGODA_SOME_TOKEN": "t",
                          "PAGODA_CPU_GEMM": ""}))
    assert rows["PAGODA_CPU_THRADS"] == "8  (not a pagoda variable: a typo?)"
    assert rows["PAGODA_DISABLE_CACHE"].startswith("maybe  (invalid: PAGODA_DISABLE_CACHE='maybe' is not a boolean")
    assert rows["PAGODA_SOME_TOKEN"] == "***  (not a pagoda variable: a typo?)"
    assert rows["PAGODA_CPU_GEMM"] == ""  # empty means unset: nothing to parse


def test_cpu_flags_report_marks_missing_flags() -> None:
    report = cpu_flags_report({"sse2", "avx2", "fma", "avx512f", "avx512_bf16"}).split()
    assert report[:4] == ["avx2", "fma", "-f16c", "avx512f"]
    assert "avx512_bf16" in report and "-amx_bf16" in report
    assert cpu_flags_report({"fp", "asimd", "sve"}).split()[:3] == ["asimd", "-asimdhp", "sve"]
    assert "no CPU flags" in cpu_flags_report(set())


def test_a_failing_probe_is_reported_and_the_others_still_run() -> None:
    def broken() -> list[tuple[str, str]]:
        raise RuntimeError("driver exploded")

    sections = collect((("First", broken), ("Second", lambda: [("k", "v")])))
    assert [s.title for s in sections] == ["First", "Second"]
    assert sections[0].rows == [("error", "RuntimeError: driver exploded")]
    assert render(sections) == "== First ==\nerror: RuntimeError: driver exploded\n\n== Second ==\nk: v\n"
    assert render([Section("Empty")]) == "== Empty ==\n"


def test_collect_env_command_reports_this_machine() -> None:
    env = {**os.environ, "PAGODA_API_KEY": "do-not-print-me", "PAGODA_DEVICE": "cpu"}
    proc = subprocess.run([sys.executable, "-m", "pagoda.entrypoints.cli.main", "collect-env"], capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for title in ("System", "CPU", "PyTorch", "GPU", "pagoda distributions", "pagoda plugins", "Libraries",
                  "Environment variables"):
        assert f"== {title} ==" in out
    assert "error:" not in out  # every probe works on the test machine
    assert re.search(rf"^Version: +{re.escape(torch.__version__)}$", out, re.M)
    assert re.search(rf"^pagoda-core: +{re.escape(metadata.version('pagoda-core'))}$", out, re.M)
    assert re.search(rf"^Python: +{platform.python_implementation()} {re.escape(platform.python_version())} ", out, re.M)
    assert "Kernel-relevant flags:" in out
    # the plugin manager's own records: the CPU platform plugin, loaded, and which platform is selected
    assert "platform, pagoda-platform-cpu" in out and "-- loaded" in out
    # the column fits the longest plugin name, so the gap varies
    assert re.search(r"^selected platform: +cpu\b", out, re.M), out
    # the column fits the longest variable set (the suite's conftest sets one too)
    assert re.search(r"^PAGODA_API_KEY: +\*\*\*$", out, re.M) and "do-not-print-me" not in out
    assert re.search(r"^PAGODA_DEVICE: +cpu$", out, re.M)
    if not torch.cuda.is_available():
        assert "GPUs: none" in out
