"""Many models behind one port (`pagoda serve --models-config`, several MODELs), and served sleep mode.

Real `pagoda serve` processes: two tiny generative models (prompts as token ids, greedy checked against
transformers), a tiny BERT embedding model and a model whose checkpoint is broken share one server; a
second server holds at most one model at a time (--max-loaded-models 1).
"""

from __future__ import annotations

import concurrent.futures
import re
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import yaml

from tests.test_server_pooling import save_bert

PROMPT = [5, 9, 17, 33, 2]
NEW = 10
GEN_OPTIONS = {"skip_tokenizer_init": True, "dtype": "float32", "max_model_len": 256, "num_kv_blocks": 64}


def _complete(server: Any, model: str, prompt: list[int] = PROMPT, **extra: Any) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": NEW, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "return_tokens_as_token_ids": True, **extra}
    return httpx.post(server.url + "/v1/completions", json=body, timeout=180)


def _ids(server: Any, model: str, reported: str | None = None, **extra: Any) -> list[int]:
    r = _complete(server, model, **extra)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == (reported or model)  # vLLM's rule: a model's first served name
    return [int(t.removeprefix("token_id:")) for t in r.json()["choices"][0]["logprobs"]["tokens"]]


def _states(server: Any) -> dict[str, str]:
    r = httpx.get(server.url + "/v1/models", timeout=30)
    assert r.status_code == 200
    return {card["id"]: card["state"] for card in r.json()["data"]}


def _wait_state(server: Any, model: str, state: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while _states(server)[model] != state:
        assert time.monotonic() < deadline, (model, state, _states(server))
        time.sleep(0.2)


@pytest.fixture(scope="module")
def paths(tiny_model_dir: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    llama, llama_hf = tiny_model_dir("llama")
    qwen, qwen_hf = tiny_model_dir("qwen2")
    bert = tmp_path_factory.mktemp("mm-bert")
    save_bert(bert, "embed")
    broken = tmp_path_factory.mktemp("mm-broken")
    (broken / "config.json").write_text((llama / "config.json").read_text())
    (broken / "model.safetensors").write_bytes(b"this is no safetensors file")
    return {"llama": llama, "llama_hf": llama_hf, "qwen": qwen, "qwen_hf": qwen_hf, "bert": bert, "broken": broken}


@pytest.fixture(scope="module")
def server(paths: dict[str, Any], start_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    config = {"models": [
        {"model": str(paths["llama"]), "served_model_name": ["gen-a", "gen-a-alias"], **GEN_OPTIONS,
         "enable_sleep_mode": True},
        {"model": str(paths["qwen"]), "served_model_name": "gen-b", **GEN_OPTIONS},
        {"model": str(paths["bert"]), "served_model_name": "embed", "dtype": "float32"},
        {"model": str(paths["broken"]), "served_model_name": "broken", **GEN_OPTIONS},
    ]}
    path = Path(tmp_path_factory.mktemp("mm-config")) / "models.yaml"
    path.write_text(yaml.safe_dump(config))
    return start_server(["--models-config", str(path)], env={"PAGODA_SERVER_DEV_MODE": "1"})


def test_models_start_unloaded_and_load_on_first_request(server: Any, paths: dict[str, Any], hf_greedy: Any) -> None:
    assert _states(server) == {"gen-a": "unloaded", "gen-a-alias": "unloaded", "gen-b": "unloaded",
                               "embed": "unloaded", "broken": "unloaded"}
    assert _ids(server, "gen-a") == hf_greedy(paths["llama_hf"], PROMPT, NEW)
    states = _states(server)
    assert states["gen-a"] == "loaded" and states["gen-a-alias"] == "loaded" and states["gen-b"] == "unloaded"
    # the second name reaches the same engine
    assert _ids(server, "gen-a-alias", reported="gen-a") == hf_greedy(paths["llama_hf"], PROMPT, NEW)


def test_each_model_answers_its_own_requests_concurrently(server: Any, paths: dict[str, Any], hf_greedy: Any) -> None:
    expected = {"gen-a": hf_greedy(paths["llama_hf"], PROMPT, NEW), "gen-b": hf_greedy(paths["qwen_hf"], PROMPT, NEW)}
    assert expected["gen-a"] != expected["gen-b"]
    jobs = ["gen-a", "gen-b"] * 4
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda m: _ids(server, m), jobs))
    for model, ids in zip(jobs, results):
        assert ids == expected[model], model
    assert _states(server)["gen-b"] == "loaded"


def test_an_embedding_model_shares_the_server(server: Any, paths: dict[str, Any]) -> None:
    from pagoda import LLM

    texts = ["w10 w11 w12", "w20 w21"]
    r = httpx.post(server.url + "/v1/embeddings", json={"model": "embed", "input": texts}, timeout=180)
    assert r.status_code == 200, r.text
    served = np.array([d["embedding"] for d in r.json()["data"]], dtype=np.float32)
    offline = LLM(str(paths["bert"]), dtype="float32")
    expected = np.array([o.outputs.embedding for o in offline.embed(texts, use_tqdm=False)], dtype=np.float32)
    np.testing.assert_allclose(served, expected, rtol=1e-5, atol=1e-6)
    # a generation route on the embedding model, and embeddings from a generative one: each model's own 404
    assert _complete(server, "embed").status_code == 404


def test_a_broken_checkpoint_answers_a_clear_error_and_the_others_serve_on(server: Any) -> None:
    r = _complete(server, "broken")
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert error["code"] == "model_load_failed" and "broken" in error["message"] and "failed to load" in error["message"]
    cards = {c["id"]: c for c in httpx.get(server.url + "/v1/models").json()["data"]}
    assert cards["broken"]["state"] == "failed" and cards["broken"]["error"]
    # again: the same answer, at once (no reload attempt per request)
    assert _complete(server, "broken").json()["error"]["code"] == "model_load_failed"
    assert _complete(server, "gen-a").status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200


def test_unknown_model_and_bad_keep_alive(server: Any) -> None:
    r = _complete(server, "nobody")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = _complete(server, "gen-a", keep_alive="soon")
    assert r.status_code == 400 and r.json()["error"]["param"] == "keep_alive"


def test_metrics_label_each_model(server: Any) -> None:
    _ids(server, "gen-a")
    _ids(server, "gen-b")
    text = httpx.get(server.url + "/metrics").text
    for model in ("gen-a", "gen-b"):
        assert any(line.startswith("pagoda:request_success_total{") and f'model_name="{model}"' in line
                   and not line.endswith(" 0.0") for line in text.splitlines()), model


def test_admin_unload_load_and_keep_alive_zero(server: Any, paths: dict[str, Any], hf_greedy: Any) -> None:
    _ids(server, "gen-b")
    r = httpx.post(server.url + "/v1/models/unload", json={"model": "gen-b"}, timeout=60)
    assert r.status_code == 200 and r.json()["state"] == "unloaded"
    r = httpx.post(server.url + "/v1/models/load", json={"model": "gen-b"}, timeout=180)
    assert r.status_code == 200 and r.json()["state"] == "loaded"
    assert httpx.post(server.url + "/v1/models/load", json={"model": "nobody"}).status_code == 404
    # Ollama's keep_alive 0: gone once the request is done (parked at level 2, its weights freed)
    assert _ids(server, "gen-b", keep_alive=0) == hf_greedy(paths["qwen_hf"], PROMPT, NEW)
    _wait_state(server, "gen-b", "sleeping")
    card = {c["id"]: c for c in httpx.get(server.url + "/v1/models").json()["data"]}["gen-b"]
    assert card["sleep_level"] == 2 and "cpu_share" not in card


def test_served_sleep_and_wake_up_restore_greedy_output(server: Any) -> None:
    before = _ids(server, "gen-a")
    assert httpx.get(server.url + "/is_sleeping", params={"model": "gen-a"}).json() == {"is_sleeping": False}
    assert httpx.post(server.url + "/sleep", params={"model": "gen-a", "level": 3}).status_code == 400
    for level in (1, 2):
        r = httpx.post(server.url + "/sleep", params={"model": "gen-a", "level": level}, timeout=60)
        assert r.status_code == 200, r.text
        assert httpx.get(server.url + "/is_sleeping", params={"model": "gen-a"}).json() == {"is_sleeping": True}
        asleep = _complete(server, "gen-a")
        assert asleep.status_code == 503 and "asleep" in asleep.json()["error"]["message"]
        assert httpx.post(server.url + "/wake_up", params={"model": "gen-a"}, timeout=120).status_code == 200
        assert _ids(server, "gen-a") == before
    # (a pool engine always has sleep mode, parking needs it: the refusal without it is test_sleep_mode's)


def test_lru_under_max_loaded_models_one(paths: dict[str, Any], start_server: Any, hf_greedy: Any) -> None:
    a, b = str(paths["llama"]), str(paths["qwen"])
    server = start_server([a, b, "--max-loaded-models", "1", "--skip-tokenizer-init", "--dtype", "float32",
                           "--max-model-len", "256", "--num-kv-blocks", "64"])
    expected = {a: hf_greedy(paths["llama_hf"], PROMPT, NEW), b: hf_greedy(paths["qwen_hf"], PROMPT, NEW)}
    assert _ids(server, a) == expected[a]
    assert _states(server) == {a: "loaded", b: "unloaded"}
    assert _ids(server, b) == expected[b]
    assert _states(server) == {a: "sleeping", b: "loaded"}  # parked, not unloaded
    assert _ids(server, a) == expected[a]  # woken after its eviction
    assert _states(server) == {a: "loaded", b: "sleeping"}
    # both at once: the second waits for the first to finish, then evicts it
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda m: _ids(server, m), [a, b]))
    assert results == [expected[a], expected[b]]
    log = server.output()
    assert "least recently used" in log


def test_keep_alive_parses_ollama_durations() -> None:
    from pagoda.entrypoints.openai.model_pool import parse_keep_alive

    assert parse_keep_alive(0) == 0 and parse_keep_alive(30) == 30 and parse_keep_alive("1.5") == 1.5
    assert parse_keep_alive("5m") == 300 and parse_keep_alive("1h") == 3600 and parse_keep_alive("250ms") == 0.25
    assert parse_keep_alive(-1) is None and parse_keep_alive("-1m") is None
    for bad in ("soon", "5 minutes", True, None, [1]):
        with pytest.raises(ValueError, match="keep_alive"):
            parse_keep_alive(bad)


@pytest.mark.parametrize("config, args, message", [
    ({"models": [{"served_model_name": "x"}]}, [], "'model' is missing"),
    ({"models": [{"model": "m", "no_such_option": 1}]}, [], "no_such_option"),
    ({"models": [{"model": "m", "lora_modules": ["a=/b"]}]}, [], "needs enable_lora"),
    ({"models": []}, [], "non-empty list"),
    ({"models": [{"model": "m", "keep_alive": "soon"}]}, [], "keep_alive"),
    ({"models": [{"model": "a", "served_model_name": "x"}, {"model": "b", "served_model_name": "x"}]}, [],
     "two models are served as 'x'"),
    (None, ["a", "b", "--served-model-name", "x"], "--served-model-name and --lora-modules"),
])
def test_bad_many_model_options_are_refused_before_anything_loads(tmp_path: Path, config: Any, args: list[str],
                                                                  message: str) -> None:
    import subprocess
    import sys

    if config is not None:
        (tmp_path / "m.yaml").write_text(yaml.safe_dump(config))
        args = ["--models-config", str(tmp_path / "m.yaml"), *args]
    out = subprocess.run([sys.executable, "-m", "pagoda.entrypoints.cli.main", "serve", *args, "--port", "0"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    text = " ".join((out.stderr + out.stdout).replace("│", " ").split())  # (typer's box wraps long lines)
    assert message in text, out.stderr[-3000:]


def test_one_models_dead_engine_leaves_the_server_serving(server: Any, paths: dict[str, Any], hf_greedy: Any) -> None:
    import os
    import re
    import signal

    assert httpx.post(server.url + "/v1/models/unload", json={"model": "gen-b"}, timeout=60).status_code == 200
    # a fresh load, kept loaded (an earlier test left gen-b's keep_alive at 0)
    assert _ids(server, "gen-b", keep_alive=-1) == hf_greedy(paths["qwen_hf"], PROMPT, NEW)
    # the load just done logged its engine-core process last
    pid = int(re.findall(r"engine core 0 runs in process (\d+)", server.output())[-1])
    os.kill(pid, signal.SIGKILL)
    _wait_state(server, "gen-b", "unloaded")
    card = {c["id"]: c for c in httpx.get(server.url + "/v1/models").json()["data"]}["gen-b"]
    assert "engine died" in card["error"]
    assert server.proc.poll() is None and httpx.get(server.url + "/health").status_code == 200
    assert _ids(server, "gen-a") == hf_greedy(paths["llama_hf"], PROMPT, NEW)
    # its next request loads it again
    assert _ids(server, "gen-b") == hf_greedy(paths["qwen_hf"], PROMPT, NEW)


def _cards(server: Any) -> dict[str, dict[str, Any]]:
    return {c["id"]: c for c in httpx.get(server.url + "/v1/models", timeout=30).json()["data"]}


def _core_pids(server: Any) -> list[int]:
    import re

    return [int(p) for p in re.findall(r"engine core 0 runs in process (\d+)", server.output())]


def test_a_parked_model_wakes_with_its_greedy_output_and_the_parked_bound_shuts_the_oldest(
        paths: dict[str, Any], start_server: Any, hf_greedy: Any, tmp_path: Path) -> None:
    config = {"models": [{"model": str(paths["llama"]), "served_model_name": "a", **GEN_OPTIONS},
                         {"model": str(paths["qwen"]), "served_model_name": "b", **GEN_OPTIONS},
                         {"model": str(paths["llama"]), "served_model_name": "c", **GEN_OPTIONS}]}
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(config))
    server = start_server(["--models-config", str(tmp_path / "m.yaml"), "--max-loaded-models", "1",
                           "--max-parked-models", "1"])
    before = {"a": _ids(server, "a"), "b": _ids(server, "b")}
    assert before["a"] == hf_greedy(paths["llama_hf"], PROMPT, NEW)
    assert before["b"] == hf_greedy(paths["qwen_hf"], PROMPT, NEW)
    cards = _cards(server)
    # evicted under --max-loaded-models: parked at level 1 (weights kept), its process alive
    assert cards["a"]["state"] == "sleeping" and cards["a"]["sleep_level"] == 1
    assert len(_core_pids(server)) == 2
    assert _ids(server, "a") == before["a"]  # woken, not loaded again: no new engine-core process
    assert len(_core_pids(server)) == 2 and "model a woke in" in server.output()
    assert _states(server) == {"a": "loaded", "b": "sleeping", "c": "unloaded"}
    # c evicts a (parked: two parked now, over --max-parked-models 1): the least recently used, b, shuts down
    assert _ids(server, "c") == before["a"]  # (c is a's checkpoint)
    assert _states(server) == {"a": "sleeping", "b": "unloaded", "c": "loaded"}
    assert "(--max-parked-models)" in server.output()
    b_pid = _core_pids(server)[1]
    deadline = time.monotonic() + 30
    while _alive(b_pid):
        assert time.monotonic() < deadline, "b's engine-core process outlived its unload"
        time.sleep(0.2)
    assert _ids(server, "b") == before["b"]  # loaded afresh
    assert len(_core_pids(server)) == 4
    # every load was served by a core spawned ahead of it (the standby, then the pool's spares after each load
    # or unload): no load spawned its own, so none paid the core's spawn and imports
    spared = [int(p) for p in re.findall(r"engine core 0 spawned as process (\d+) ahead", server.output())]
    assert set(_core_pids(server)) <= set(spared), (spared, _core_pids(server))


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not reaped yet) is gone for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_awake_engines_divide_the_cpus_and_take_them_back(paths: dict[str, Any], start_server: Any,
                                                          tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from pagoda.worker.cpu_share import split_cpus

    cpus = sorted(os.sched_getaffinity(0))  # the server's, inherited
    config = {"models": [{"model": str(paths["llama"]), "served_model_name": "a", **GEN_OPTIONS},
                         {"model": str(paths["qwen"]), "served_model_name": "b", **GEN_OPTIONS}]}
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(config))
    for name in ("PAGODA_CPU_THREADS", "OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY", "KMP_AFFINITY"):
        monkeypatch.delenv(name, raising=False)  # the user settings that win over the split
    server = start_server(["--models-config", str(tmp_path / "m.yaml")])
    _ids(server, "a")
    # alone: the whole machine, as a one-model server
    assert _cards(server)["a"]["cpu_share"] == [{"threads": len(cpus), "cpus": cpus, "kept": None}]
    _ids(server, "b")
    halves = split_cpus(cpus, 2)
    cards = _cards(server)
    assert cards["a"]["cpu_share"] == [{"threads": len(halves[0]), "cpus": halves[0], "kept": None}]
    assert cards["b"]["cpu_share"] == [{"threads": len(halves[1]), "cpus": halves[1], "kept": None}]
    if len(cpus) > 1:
        assert not set(halves[0]) & set(halves[1])
    assert "CPU share: %d torch threads on CPUs %s" % (len(halves[1]), halves[1]) in server.output()
    # b goes: a takes the whole machine back
    assert httpx.post(server.url + "/v1/models/unload", json={"model": "b"}, timeout=60).status_code == 200
    assert _cards(server)["a"]["cpu_share"] == [{"threads": len(cpus), "cpus": cpus, "kept": None}]


def test_an_explicit_thread_count_wins_over_the_split(paths: dict[str, Any], start_server: Any,
                                                      tmp_path: Path) -> None:
    config = {"models": [{"model": str(paths["llama"]), "served_model_name": "a", **GEN_OPTIONS},
                         {"model": str(paths["qwen"]), "served_model_name": "b", **GEN_OPTIONS}]}
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(config))
    server = start_server(["--models-config", str(tmp_path / "m.yaml")], env={"PAGODA_CPU_THREADS": "3"})
    _ids(server, "a")
    _ids(server, "b")
    for model in ("a", "b"):
        share = _cards(server)[model]["cpu_share"]
        assert [(s["threads"], s["kept"]) for s in share] == [(3, "PAGODA_CPU_THREADS=3")], share


def test_split_cpus_gives_disjoint_slices_and_wraps_when_short() -> None:
    from pagoda.worker.cpu_share import split_cpus

    assert split_cpus([0, 1, 2, 3], 1) == [[0, 1, 2, 3]]
    assert split_cpus([0, 1, 2, 3], 2) == [[0, 1], [2, 3]]
    assert split_cpus([0, 1, 2, 3, 4], 2) == [[0, 1], [2, 3]]
    assert split_cpus([4, 7], 3) == [[4], [7], [4]]
    with pytest.raises(ValueError):
        split_cpus([0], 0)
