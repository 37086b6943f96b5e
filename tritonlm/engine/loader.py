"""Build a ready Engine from a model's settings: tokenizer, runner, KV budget."""

from __future__ import annotations

import logging
import os

import torch

from tritonlm.engine.engine import Engine, EngineObserver
from tritonlm.engine.kv_cache import CacheBudgetError, KVCacheManager
from tritonlm.engine.scheduler import SchedulerConfig
from tritonlm.engine.settings import DTYPES, EngineSettings, SettingsError

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


def _reason(e: Exception) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"


def load_tokenizer(hf_dir, field: str = "hf_dir"):
    """The tokenizer saved in hf_dir; a folder without one refuses to load, naming `field`."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(hf_dir))
    except Exception as e:  # transformers raises OSError/ValueError/... for a missing or broken tokenizer
        raise SettingsError(
            f"{field}: no usable tokenizer in {hf_dir} ({_reason(e)}); save the model's tokenizer there "
            "(tokenizer.json, or vocab.json + merges.txt) or re-export the model"
        ) from None
    if tok.eos_token_id is None:
        log.warning("tokenizer of %s has no EOS token: generation stops only on max_tokens/stop words", hf_dir)
    return tok


def build_engine(settings: EngineSettings, observer: EngineObserver | None = None, runner=None, tokenizer=None) -> Engine:
    """runner/tokenizer may be passed in (tests); otherwise loaded from settings."""
    if settings.num_threads:
        torch.set_num_threads(settings.num_threads)
    if tokenizer is None:
        tokenizer = load_tokenizer(settings.hf_dir)
    if runner is None and (settings.tensor_parallel_size > 1 or settings.pipeline_parallel_size > 1):
        from tritonlm.engine.parallel import build_parallel_engine  # one model split over worker processes

        return build_parallel_engine(settings, observer, tokenizer, build_engine)
    if runner is None:
        runner = _load_runner_or_explain(
            "hf_dir" if settings.runtime == "torch" else "onnx_model",
            settings.runtime, settings.hf_dir, onnx_path=settings.onnx_model, device=settings.device,
            **({"dtype": DTYPES[settings.dtype]} if settings.runtime == "torch" else {}),
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
        drafter=build_drafter(settings, runner, cache, tokenizer),
        num_draft_tokens=settings.num_draft_tokens,
    )


def _load_runner_or_explain(field: str, kind: str, path, **kwargs):
    """load_runner, with a failure (missing or broken weights/artifact) turned into a
    SettingsError that names the config field to fix."""
    from tritonlm.engine.runners import load_runner

    try:
        return load_runner(kind, path, **kwargs)
    except SettingsError:
        raise
    except Exception as e:
        where = kwargs.get("onnx_path") if field == "onnx_model" else path
        raise SettingsError(
            f"{field}: cannot load the {kind} model from {where} ({_reason(e)}); "
            "re-export the model or point the parameter at a complete export"
        ) from None


def check_same_tokenizer(target_tokenizer, draft_tokenizer, draft_dir) -> None:
    """A draft proposes token ids the target verifies: both must mean the same text by
    every id. Compares the whole vocabularies (token -> id), special tokens included."""
    target, draft = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if target == draft:
        return
    differ = sorted(t for t in set(target) | set(draft) if target.get(t) != draft.get(t))
    example = differ[0]
    raise SettingsError(
        f"draft_model: the draft's tokenizer ({draft_dir}) differs from the target's: {len(differ)} of "
        f"{len(set(target) | set(draft))} tokens map to other ids (e.g. {example!r} is "
        f"{target.get(example)} in the target, {draft.get(example)} in the draft); a draft model must use "
        "the target's tokenizer: pick a draft of the same model family or save the target's tokenizer with it"
    )


def build_drafter(settings: EngineSettings, target_runner, target_cache: KVCacheManager, target_tokenizer=None):
    """The speculative drafter the settings ask for, or None."""
    from tritonlm.engine.speculative import DraftModelDrafter, PromptLookupDrafter

    if settings.speculative == "prompt_lookup":
        return PromptLookupDrafter(settings.prompt_lookup_ngram)
    if settings.speculative != "draft":
        return None
    if target_tokenizer is not None:
        check_same_tokenizer(target_tokenizer, load_tokenizer(settings.draft_model, "draft_model"), settings.draft_model)
    draft = _load_runner_or_explain(
        "draft_model", "torch", settings.draft_model, device=settings.device, dtype=DTYPES[settings.dtype]
    )
    if draft.spec.vocab_size != target_runner.spec.vocab_size:
        raise SettingsError(
            f"draft_model: its vocabulary has {draft.spec.vocab_size} tokens, the target's {target_runner.spec.vocab_size}; "
            "a draft must share the target's tokenizer"
        )
    log.info("speculative decoding: draft model %s, up to %d draft tokens", settings.draft_model, settings.num_draft_tokens)
    return DraftModelDrafter(draft, target_cache)
