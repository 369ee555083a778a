"""The step token budget: by default small on CPU (a CPU prefills ~1,600 tokens a second
on the default model, so a large budget stalls running streams and makes a burst of
prompts wait for the whole burst), large on CUDA; an explicit max_num_batched_tokens wins."""
import torch

from engine.config import CPU_STEP_TOKENS, CUDA_STEP_TOKENS, EngineConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.sampling_params import SamplingParams


def test_the_default_budget_depends_on_the_device_and_an_explicit_one_wins():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert EngineConfig().max_num_batched_tokens is None
    assert EngineConfig().step_token_budget(cpu) == CPU_STEP_TOKENS == 512
    assert EngineConfig().step_token_budget(cuda) == CUDA_STEP_TOKENS == 8192
    assert EngineConfig(max_num_batched_tokens=96).step_token_budget(cpu) == 96
    assert EngineConfig(max_num_batched_tokens=96).step_token_budget(cuda) == 96


def test_a_burst_of_prompts_is_prefilled_within_the_budget_step_by_step():
    config = EngineConfig()
    scheduler = Scheduler(config, KVCacheManager(256, 16, True), 4096,
                          config.step_token_budget(torch.device("cpu")))
    for i in range(12):  # 12 x 64 = 768 prompt tokens: more than one step's budget
        scheduler.add(Request(f"r{i}", list(range(100 + i, 164 + i)),
                              SamplingParams(max_tokens=4), (2,)))
    first = scheduler.schedule()
    assert sum(first.num_new_tokens) == 512
    assert first.num_new_tokens == [64] * 8  # whole prompts first, in arrival order
    assert len(scheduler.waiting) == 4  # the rest wait for the next step
