"""Decode graph runner logic on CPU: bucketing, static-buffer filling, padding rows.

Captures here use ``EagerReplay`` (records the forward, re-runs it eagerly on
replay): it checks what the real graphs read, not CUDA graphs themselves.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

from pagoda.attention import AttentionBackend, AttentionMetadata
from pagoda.platforms import Platform
from pagoda.worker import graphs
from pagoda.worker.graphs import PAD_SLOT, DecodeGraphRunner, EagerReplay, capture_sizes_for, create_decode_graphs

BLOCK_SIZE = 4
WIDTH = 6  # block-table columns per request
MAX_MODEL_LEN = BLOCK_SIZE * WIDTH
NUM_SLOTS = 64


class ToyModel:
    """Each output row depends only on its own row's inputs; writes a fake KV entry per slot >= 0."""

    def __init__(self) -> None:
        self.cache = torch.zeros(NUM_SLOTS)

    def __call__(self, ids: torch.Tensor, pos: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        keep = md.slot_mapping >= 0
        self.cache[md.slot_mapping[keep]] = (ids[keep] * 1000 + pos[keep] + 1).float()
        last_block = md.block_tables.gather(1, ((md.seq_lens.long() - 1) // BLOCK_SIZE)[:, None])[:, 0]
        return torch.stack([ids.float(), pos.float(), md.seq_lens.float(), last_block.float()], 1)


def _expected(ids: np.ndarray, pos: np.ndarray, seq: np.ndarray, bt: np.ndarray) -> torch.Tensor:
    last = bt[np.arange(len(ids)), (seq - 1) // BLOCK_SIZE]
    return torch.tensor(np.stack([ids, pos, seq, last], 1), dtype=torch.float32)


def _runner(sizes: list[int], prepared: list[AttentionMetadata] | None = None) -> tuple[DecodeGraphRunner, ToyModel]:
    model = ToyModel()

    def prepare(md: AttentionMetadata) -> AttentionMetadata:
        if prepared is not None:
            prepared.append(md)
        return md

    runner = DecodeGraphRunner(model, prepare, sizes, WIDTH, MAX_MODEL_LEN, torch.device("cpu"), EagerReplay())
    runner.capture()
    model.cache.zero_()  # capture runs only padding rows, which must have written nothing
    return runner, model


def _decode_step(n: int, seed: int, width: int = WIDTH) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    seq = rng.integers(1, width * BLOCK_SIZE + 1, n)
    bt = rng.integers(1, 50, (n, width)).astype(np.int32)
    return dict(
        input_ids=rng.integers(1, 300, n),
        positions=seq - 1,
        slot_mapping=rng.choice(np.arange(1, NUM_SLOTS), n, replace=False).astype(np.int64),
        seq_lens=seq,
        block_tables=bt,
        num_scheduled=np.ones(n, dtype=np.int64),
    )


def test_bucket_is_the_smallest_captured_size_that_fits() -> None:
    runner, _ = _runner([8, 1, 4, 2])
    assert runner.sizes == [1, 2, 4, 8]
    assert [runner.bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 0)] == [1, 2, 4, 4, 8, 8, None, None]


def test_capture_prepares_each_size_once_largest_first_with_an_upper_bound() -> None:
    prepared: list[AttentionMetadata] = []
    runner, _ = _runner([1, 2, 4], prepared)
    assert [md.num_seqs for md in prepared] == [4, 2, 1]
    for md in prepared:
        assert md.is_all_decode and md.max_query_len == 1 and md.max_seq_len == MAX_MODEL_LEN
        assert md.num_tokens == md.num_seqs and md.seq_lens_cpu is None
        # Views of the static buffers, so a replay sees what the step copied in.
        assert md.slot_mapping.data_ptr() == runner.slot_mapping.data_ptr()
        assert md.block_tables.data_ptr() == runner.block_tables.data_ptr()
    assert runner.query_start_loc.tolist() == list(range(5))


def test_padded_replay_matches_the_real_rows_and_writes_no_kv_for_padding() -> None:
    runner, model = _runner([1, 2, 4, 8])
    # A full bucket first leaves stale real data in rows the next, smaller step pads.
    big = _decode_step(8, seed=1)
    out = runner.replay(**big)
    assert out is not None
    torch.testing.assert_close(out, _expected(big["input_ids"], big["positions"], big["seq_lens"], big["block_tables"]))
    model.cache.zero_()

    step = _decode_step(5, seed=2)
    out = runner.replay(**step)
    assert out is not None and out.shape[0] == 5
    torch.testing.assert_close(out, _expected(step["input_ids"], step["positions"], step["seq_lens"], step["block_tables"]))
    # Only the real rows' slots were written.
    written = set(torch.nonzero(model.cache).flatten().tolist())
    assert written == set(step["slot_mapping"].tolist())
    # Padding rows 5..7 of the 8 graph: slot -1, token 0 at position 0, seq_len 1 over the null block 0.
    assert runner.slot_mapping[5:8].tolist() == [PAD_SLOT] * 3
    assert runner.seq_lens[5:8].tolist() == [1] * 3
    assert runner.input_ids[5:8].tolist() == [0] * 3 and runner.positions[5:8].tolist() == [0] * 3
    assert runner.block_tables[5:8, 0].tolist() == [0] * 3
    assert runner.num_replays == 2


def test_narrower_block_tables_leave_stale_columns_unread() -> None:
    runner, _ = _runner([4])
    runner.replay(**_decode_step(4, seed=3))
    step = _decode_step(3, seed=4, width=2)
    out = runner.replay(**step)
    assert out is not None
    torch.testing.assert_close(out, _expected(step["input_ids"], step["positions"], step["seq_lens"], step["block_tables"]))


@pytest.mark.parametrize("case", ["mixed", "too_big", "too_wide"])
def test_steps_a_graph_cannot_serve_run_eagerly(case: str) -> None:
    runner, model = _runner([1, 2, 4])
    step = _decode_step(3, seed=5)
    if case == "mixed":
        step["num_scheduled"] = np.array([1, 2, 1])
    elif case == "too_big":
        step = _decode_step(5, seed=5)
    else:
        step["block_tables"] = np.zeros((3, WIDTH + 1), dtype=np.int32)
    assert runner.replay(**step) is None
    assert runner.num_replays == 0 and not model.cache.any()


class _Platform(Platform):
    name = "fake"
    supports_graphs = True

    def cuda_graph_capture_sizes(self, config: Any) -> list[int]:
        return [8, 2, 2, 1, 64]


class _NoGraphsPlatform(_Platform):
    supports_graphs = False


def test_capture_sizes_come_from_the_platform() -> None:
    assert capture_sizes_for(_Platform(), None) == [1, 2, 8, 64]  # type: ignore[arg-type]
    assert capture_sizes_for(_NoGraphsPlatform(), None) == []  # type: ignore[arg-type]

    class NoRule(Platform):
        supports_graphs = True

    from pagoda.config import EngineArgs

    # the default rule: the sizes the config resolution decided (none decided: every step eager)
    assert capture_sizes_for(NoRule(), EngineArgs().create_engine_config()) == []
    assert capture_sizes_for(NoRule(), EngineArgs(cuda_graph_sizes=[4, 1]).create_engine_config()) == [1, 4]


class _GraphBackend(AttentionBackend):
    name = "graph_ok"
    supports_cuda_graphs: ClassVar[bool] = True


def _graph_inputs(backend: type[AttentionBackend]) -> graphs.GraphInputs:
    from pagoda.attention import AttentionSpec

    spec = AttentionSpec(num_heads=1, num_kv_heads=1, head_dim=4, dtype=torch.float32, device_type="cpu", block_size=BLOCK_SIZE)
    return graphs.GraphInputs(
        model=ToyModel(), attn_backend=backend(spec), attn_layers=[], max_blocks_per_req=WIDTH,
        max_model_len=MAX_MODEL_LEN, max_num_seqs=16, max_num_batched_tokens=32, device=torch.device("cpu"),
    )


_CONFIG: Any = SimpleNamespace(cache_config=SimpleNamespace(calculate_kv_scales=False))


class _CapturingPlatform(_Platform):
    def graph_capturer(self, roots: list[object]) -> tuple[graphs.GraphCapturer | None, str]:
        return EagerReplay(), ""


class _LazyReplay(EagerReplay):
    captures_on_first_use = True


def test_create_decode_graphs_turns_off_where_it_must() -> None:
    assert AttentionBackend.supports_cuda_graphs is False
    # The platform has no graph runtime (the interface's default): no graphs even when everything else allows them.
    assert create_decode_graphs(_Platform(), _CONFIG, _graph_inputs(_GraphBackend)) is None

    class NoGraphs(_CapturingPlatform):
        supports_graphs = False

    assert create_decode_graphs(NoGraphs(), _CONFIG, _graph_inputs(_GraphBackend)) is None
    assert create_decode_graphs(_CapturingPlatform(), _CONFIG, _graph_inputs(AttentionBackend)) is None
    made = create_decode_graphs(_CapturingPlatform(), _CONFIG, _graph_inputs(_GraphBackend))
    assert made is not None
    # 64 > max_num_seqs (16): never replayed, so never captured.
    assert made.sizes == [1, 2, 8] and sorted(made.steps) == [1, 2, 8]


def test_a_capturer_that_captures_on_first_use_captures_only_the_sizes_replayed() -> None:
    class LazyPlatform(_Platform):
        def graph_capturer(self, roots: list[object]) -> tuple[graphs.GraphCapturer | None, str]:
            return _LazyReplay(), ""

    lazy = create_decode_graphs(LazyPlatform(), _CONFIG, _graph_inputs(_GraphBackend))
    assert lazy is not None and lazy.sizes == [1, 2, 8] and not lazy.steps, "nothing captured at start-up"
    eager, _ = _runner([1, 2, 8])
    for n, seed in ((3, 1), (2, 2), (3, 3)):
        step = _decode_step(n, seed)
        out = lazy.replay(**step)
        assert out is not None
        # the same rows, bit for bit, as the graphs captured up front
        assert torch.equal(out, eager.replay(**step))
    assert sorted(lazy.steps) == [2, 8] and lazy.num_replays == 3
