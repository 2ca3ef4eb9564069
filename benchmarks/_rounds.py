"""Configurations measured in turn, each in a fresh process, round after round (so a contended machine's
drift falls on every configuration alike)."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def alternate(module: str, names: list[str], rounds: int, extra_args: list[str]) -> dict[str, list[dict]]:
    """Run ``python -m module --one NAME *extra_args`` for every name, ``rounds`` times; each run prints its
    result as a JSON object on its last line. Returns the results per name, each with its round and the
    load average after it."""
    print(f"# load average before: {os.getloadavg()}")
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names:
            out = subprocess.run([sys.executable, "-m", module, "--one", name, *extra_args],
                                 capture_output=True, text=True, check=True)
            result = json.loads(out.stdout.strip().splitlines()[-1])
            result.update(round=r, loadavg=os.getloadavg()[0])
            print(json.dumps(result), flush=True)
            runs[name].append(result)
    print(f"# load average after: {os.getloadavg()}")
    return runs
