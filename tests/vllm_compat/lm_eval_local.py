"""lm-eval's ``vllm`` model on pagoda (through pagoda-vllm-compat) beside lm-eval's ``hf`` model, on local tasks.

Usage: python lm_eval_local.py MODEL_DIR OUT.json. Runs the three tasks of lm_eval_tasks/ (multiple
choice, generate_until, loglikelihood_rolling) with both models and writes, per model and task,
the metrics and every sample's filtered response, for tests/test_vllm_compat.py to compare.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

TASKS_DIR = Path(__file__).resolve().parent / "lm_eval_tasks"
TASKS = ["pagoda_capitals_mc", "pagoda_capitals_gen", "pagoda_capitals_rolling"]


def _evaluate(model: str, model_args: str) -> dict[str, Any]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=TASKS, task_manager=TaskManager(include_path=str(TASKS_DIR)),
        log_samples=True, batch_size=4, bootstrap_iters=0,
    )
    assert results is not None
    return {
        task: {
            "metrics": {k: v for k, v in results["results"][task].items() if isinstance(v, (int, float))},
            "responses": [sample["filtered_resps"] for sample in results["samples"][task]],
        }
        for task in TASKS
    }


def main() -> None:
    model_dir, out = sys.argv[1], sys.argv[2]
    # the json task data lies beside the yaml files; datasets resolves data_files against the working directory
    os.chdir(TASKS_DIR)
    report = {
        # no max_length: lm-eval then reads the engine's llm_engine.model_config.max_model_len
        "vllm": _evaluate("vllm", f"pretrained={model_dir},dtype=float32,max_num_seqs=4,"
                                  "num_kv_blocks=128,enforce_eager=True"),
        "hf": _evaluate("hf", f"pretrained={model_dir},dtype=float32,max_length=256,device=cpu"),
    }
    Path(out).write_text(json.dumps(report))


if __name__ == "__main__":
    main()
