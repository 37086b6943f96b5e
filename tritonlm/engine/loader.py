"""Build a ready Engine from a model's settings: tokenizer, runner, KV budget."""

from __future__ import annotations

import logging
import os

import torch

from tritonlm.engine.engine import Engine, EngineObserver
from tritonlm.engine.kv_cache import CacheBudgetError, KVCacheManager
from tritonlm.engine.scheduler import SchedulerConfig
from tritonlm.engine.settings import EngineSettings, SettingsError

log = logging.getLogger(__name__)

DEFAULT_FULL_SEQUENCES = 8  # without a budget: room for this many full-context sequences


def free_memory_bytes(device: str) -> int:
    if device.startswith("cuda"):
        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def resolve_kv_budget(settings: EngineSettings, bytes_per_token: int, max_context: int) -> int:
    if settings.kv_cache_bytes is not None:
        return settings.kv_cache_bytes
    if settings.kv_cache_fraction is not None:
        return int(free_memory_bytes(settings.device) * settings.kv_cache_fraction)
    return DEFAULT_FULL_SEQUENCES * (max_context + settings.kv_block_size) * bytes_per_token


def load_tokenizer(hf_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    if tok.eos_token_id is None:
        log.warning("tokenizer of %s has no EOS token: generation stops only on max_tokens/stop words", hf_dir)
    return tok


def build_engine(settings: EngineSettings, observer: EngineObserver | None = None, runner=None, tokenizer=None) -> Engine:
    """runner/tokenizer may be passed in (tests); otherwise loaded from settings."""
    from tritonlm.engine.runners import load_runner

    if settings.num_threads:
        torch.set_num_threads(settings.num_threads)
    if tokenizer is None:
        tokenizer = load_tokenizer(settings.hf_dir)
    if runner is None and (settings.tensor_parallel_size > 1 or settings.pipeline_parallel_size > 1):
        from tritonlm.engine.parallel import build_parallel_engine  # one model split over worker processes

        return build_parallel_engine(settings, observer, tokenizer, build_engine)
    if runner is None:
        runner = load_runner(
            settings.runtime, settings.hf_dir, onnx_path=settings.onnx_model, device=settings.device
        )
    spec = runner.spec
    max_context = settings.max_context or spec.max_positions
    if max_context > spec.max_positions:
        raise SettingsError(
            f"max_context: {max_context} is beyond the model's {spec.max_positions} positions; use at most {spec.max_positions}"
        )
    budget = resolve_kv_budget(settings, spec.bytes_per_token, max_context)
    owns_pool = getattr(runner, "owns_kv_pool", False) is True  # parallel runners hold the KV tensors, sharded
    if owns_pool:
        budget = runner.resolve_kv_budget(settings, budget)
    try:
        cache = KVCacheManager(spec, budget, settings.kv_block_size, device=settings.device, allocate_pool=not owns_pool)
    except CacheBudgetError as e:
        raise SettingsError(f"kv_cache_bytes: {e}") from None
    if cache.max_tokens_per_sequence < max_context:
        need = (cache.blocks_for(max_context) + 1) * cache.block_bytes
        raise SettingsError(
            f"kv_cache_bytes: {budget} bytes hold {cache.max_tokens_per_sequence} tokens, less than one "
            f"full-context sequence ({max_context} tokens at {spec.bytes_per_token} bytes/token); "
            f"give at least {need} bytes or lower max_context"
        )
    log.info(
        "KV cache: %d bytes/token, budget %d bytes = %d blocks of %d tokens (%d full-context sequences of %d)",
        spec.bytes_per_token, cache.total_bytes, cache.usable_blocks, cache.block_size,
        cache.max_tokens_per_sequence // max_context, max_context,
    )
    engine_cls = Engine
    if owns_pool:
        from tritonlm.engine.parallel import ParallelEngine as engine_cls  # also stops the workers on shutdown

        runner.allocate_kv(cache.num_blocks * cache.block_size)
    sched = SchedulerConfig(
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=max(settings.max_num_batched_tokens, settings.max_num_seqs),
        max_queue_size=settings.max_queue_size,
    )
    return engine_cls(
        runner,
        tokenizer,
        cache,
        sched,
        max_context=max_context,
        use_kv_cache=settings.use_kv_cache,
        queue_timeout_s=settings.queue_timeout_s,
        observer=observer,
        drafter=build_drafter(settings, runner, cache),
        num_draft_tokens=settings.num_draft_tokens,
    )


def build_drafter(settings: EngineSettings, target_runner, target_cache: KVCacheManager):
    """The speculative drafter the settings ask for, or None."""
    from tritonlm.engine.speculative import DraftModelDrafter, PromptLookupDrafter

    if settings.speculative == "prompt_lookup":
        return PromptLookupDrafter(settings.prompt_lookup_ngram)
    if settings.speculative != "draft":
        return None
    from tritonlm.engine.runners import load_runner

    draft = load_runner("torch", settings.draft_model, device=settings.device)
    if draft.spec.vocab_size != target_runner.spec.vocab_size:
        raise SettingsError(
            f"draft_model: its vocabulary has {draft.spec.vocab_size} tokens, the target's {target_runner.spec.vocab_size}; "
            "a draft must share the target's tokenizer"
        )
    log.info("speculative decoding: draft model %s, up to %d draft tokens", settings.draft_model, settings.num_draft_tokens)
    return DraftModelDrafter(draft, target_cache)
