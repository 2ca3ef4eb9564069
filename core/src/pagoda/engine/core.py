"""The engine core loop: schedule -> execute -> update. No tokenization, no HTTP."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from pagoda.config import EngineConfig
from pagoda.kv_cache.manager import KVCacheManager
from pagoda.platforms import Platform
from pagoda.scheduler.output import EngineCoreOutput
from pagoda.scheduler.request import Request, RequestStatus
from pagoda.scheduler.scheduler import Scheduler
from pagoda.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# Token budget of one step when the user sets none. On CPU a bigger chunk buys
# nothing (compute-bound) and delays decodes; it must still hold a whole prompt
# when chunked prefill is off.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


class EngineCore:
    def __init__(self, config: EngineConfig, platform: Platform) -> None:
        self.config = config
        self.platform = platform
        platform.init_worker(config)
        platform.seed_everything(config.model.seed)
        self.runner = ModelRunner(config, platform)
        self.max_model_len = self.runner.max_model_len
        sc = config.scheduler_config
        if sc.max_num_batched_tokens is not None:
            budget = sc.max_num_batched_tokens
        else:
            budget = DEFAULT_MAX_NUM_BATCHED_TOKENS if sc.enable_chunked_prefill else max(DEFAULT_MAX_NUM_BATCHED_TOKENS, self.max_model_len)
        if not sc.enable_chunked_prefill and budget < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={budget} is smaller than max_model_len={self.max_model_len}: "
                "without chunked prefill a whole prompt must fit in one step"
            )
        self.max_num_batched_tokens = budget
        self.runner.load_model()
        memory = self.runner.init_kv_cache(sc.max_num_seqs, budget)
        self.block_size = memory.block_size
        self.kv_cache_manager = KVCacheManager(
            memory.num_blocks, memory.block_size, enable_caching=config.cache_config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.kv_cache_manager,
            max_num_seqs=sc.max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=self.max_model_len,
            enable_chunked_prefill=sc.enable_chunked_prefill,
            policy=sc.scheduling_policy,
        )

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    def step(self) -> list[EngineCoreOutput]:
        so = self.scheduler.schedule()
        if so.is_empty:
            if so.finished_req_ids:
                # let the runner forget finished requests even in an idle step
                self.runner.execute_model(so)
            return []
        out = self.runner.execute_model(so)
        return self.scheduler.update_from_output(so, out)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()
