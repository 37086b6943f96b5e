"""Build a ready Engine from a model's settings: tokenizer, runner, KV budget."""

from __future__ import annotations

import logging

import torch

from tritonlm.engine.compute_thread import ComputeThread
from tritonlm.engine.cpu_cores import ThreadGovernor, usable_cores
from tritonlm.engine.engine import Engine, EngineObserver
from tritonlm.engine.kv_cache import CacheBudgetError, KVCacheManager
from tritonlm.engine.memory import default_kv_budget, free_memory_bytes
from tritonlm.engine.scheduler import SchedulerConfig
from tritonlm.engine.precision import Precision, PrecisionError, resolve_precision
from tritonlm.engine.settings import EngineSettings, SettingsError
from tritonlm.engine.slo_warmup import warm_up_slo
from tritonlm.engine.tokenizer import check_same_tokenizer, error_summary, load_tokenizer
from tritonlm.engine.window_kv import HybridKVCache

log = logging.getLogger(__name__)


def resolve_kv_budget(settings: EngineSettings, bytes_per_token: int, max_context: int) -> int:
    """The whole model's KV budget in bytes (all ranks together when it is split)."""
    if settings.kv_cache_bytes is not None:
        return settings.kv_cache_bytes
    if settings.kv_cache_fraction is not None:
        return int(free_memory_bytes(settings.device) * settings.kv_cache_fraction)
    return default_kv_budget(bytes_per_token, max_context, settings.kv_block_size)


def resolve_settings_precision(settings: EngineSettings) -> Precision:
    """The settings' dtype on their device (checked at load; SettingsError naming `dtype`)."""
    try:
        precision = resolve_precision(settings.dtype, settings.device)
    except PrecisionError as e:
        raise SettingsError(f"dtype: {e}") from None
    log.info("precision: %s%s on %s (%s)", precision.name, " weights, float32 compute" if precision.int8_weights or precision.int8_weight_only else "",
             settings.device, precision.reason)
    return precision


def _torch_runner_kwargs(settings: EngineSettings) -> dict:
    precision = resolve_settings_precision(settings)
    return {"dtype": precision.compute, "int8": precision.int8_weights, "int8_weight_only": precision.int8_weight_only,
            "attention": settings.attention_backend,
            "cuda_graphs": settings.cuda_graphs, "max_batch": settings.max_num_seqs,
            "compile_decode": settings.compile_decode}


def build_engine(settings: EngineSettings, observer: EngineObserver | None = None, runner=None, tokenizer=None) -> Engine:
    """runner/tokenizer may be passed in (tests); otherwise loaded from settings. If
    anything fails after the runner exists, the runner is closed (no worker outlives it).

    Loading runs on the thread that will run the engine's loop (ComputeThread): OpenMP
    runs a forward pass slower on another thread than the one that loaded the model
    (compute_thread.py)."""
    compute = ComputeThread()
    try:
        engine = compute.call(_load_and_build, settings, observer, runner, tokenizer)
    except BaseException:
        compute.stop()
        raise
    engine.compute = compute
    return engine


def compute_threads(settings: EngineSettings) -> tuple[int, str]:
    """This process's compute threads and why: `num_threads` when set, else one per core
    it may use, split over the model's CPU instances and each one's model-parallel ranks
    (this process is rank 0; the workers get the same count, ParallelRunner.rank_threads)."""
    if settings.num_threads:
        return settings.num_threads, "num_threads"
    budget = usable_cores()
    ranks = settings.tensor_parallel_size * settings.pipeline_parallel_size
    split = [f"{settings.cpu_share} instances"] if settings.cpu_share > 1 else []
    split += [f"{ranks} ranks each"] if ranks > 1 else []
    why = f"auto: {budget.why}" + (f", split over {' x '.join(split)}" if split else "")
    return budget.threads(settings.cpu_share * ranks), why


def _set_torch_threads(threads: int) -> None:
    torch.set_num_threads(threads)
    try:  # only before any inter-op work in this process; a second engine here keeps the first's
        torch.set_num_interop_threads(threads)
    except RuntimeError:
        pass


def _load_and_build(settings: EngineSettings, observer: EngineObserver | None, runner, tokenizer) -> Engine:
    threads, why = compute_threads(settings)
    _set_torch_threads(threads)
    log.info("compute threads: %d (%s)", threads, why)
    if tokenizer is None:
        tokenizer = load_tokenizer(settings.hf_dir)
    if runner is None:
        runner = load_model_runner(settings, threads)
    try:
        check_attention_backend(settings, runner)
        engine = _build_engine(settings, observer, runner, tokenizer)
        engine.lora_registry = load_lora_registry(settings, runner)
        if settings.slo_warmup:
            warm_up_slo(engine)
    except BaseException:
        runner.close()
        raise
    if not settings.num_threads and settings.runtime == "torch" and settings.device == "cpu" and not settings.is_parallel:
        engine.threads = ThreadGovernor(threads, torch.set_num_threads)
    return engine


def load_lora_registry(settings: EngineSettings, runner):
    """The model's LoRA adapters by name (lora.registry.LoraRegistry), or None without any.
    Attached after the runner has quantized and packed its weights (the wrappers keep the
    base projections as they are); every adapter is loaded once here, so a broken one refuses
    the model at load, naming it, rather than failing its first request."""
    if not settings.takes_lora:
        return None
    from tritonlm.engine.lora import attach_lora
    from tritonlm.engine.lora.registry import LoraRegistry

    model = getattr(runner, "transformer", None)
    if model is None:
        raise SettingsError("lora_adapters / enable_lora: this runner cannot take LoRA adapters; use runtime 'torch' "
                            "without model parallelism")
    attach_lora(model)
    registry = LoraRegistry(model, dict(settings.lora_adapters), settings.max_lora_rank, settings.max_cpu_loras)
    folders = dict(settings.lora_adapters)
    for name in registry.names:
        try:
            adapter = registry.get(name)
        except ValueError as e:
            raise SettingsError(f"lora_adapters: {e}") from None
        log.info("LoRA adapter %r: %s, rank %d", name, folders[name], adapter.rank)
    log.info("LoRA adapters: %d served (%s), up to %d loaded at once, rank at most %d", len(registry.names),
             ", ".join(registry.names), settings.max_cpu_loras, settings.max_lora_rank)
    return registry


def check_attention_backend(settings: EngineSettings, runner) -> None:
    """`attention_backend: paged` refuses to load where the kernel cannot run (the runner
    says why); `auto` logs which path decode steps take."""
    if not hasattr(runner, "attention"):  # ONNX Runtime and parallel ranks: their own attention
        return
    used, why = runner.attention, runner.attention_why
    if settings.attention_backend == "paged" and used != "paged":
        raise SettingsError(f"attention_backend: 'paged' cannot run here: {why}; use 'auto' or 'gather'")
    log.info("attention: %s%s", used, f" ({why})" if why else "")
    int8 = runner.transformer.int8_path() if hasattr(runner, "transformer") else None
    if int8:
        log.info("int8 projections: %s", int8)


def load_model_runner(settings: EngineSettings, threads: int = 0):
    """The target model's runner: torch or onnx in this process, or split over worker processes;
    `threads`: ONNX Runtime's intra-op threads (torch's are set on the calling thread)."""
    if settings.is_parallel:
        from tritonlm.engine.parallel import load_parallel_runner

        return load_parallel_runner(settings)
    return _load_runner_or_explain(
        "hf_dir" if settings.runtime == "torch" else "onnx_model",
        settings.runtime, settings.hf_dir, onnx_path=settings.onnx_model, device=settings.device,
        **(_torch_runner_kwargs(settings) if settings.runtime == "torch" else {"threads": threads}),
    )


def _build_engine(settings: EngineSettings, observer: EngineObserver | None, runner, tokenizer) -> Engine:
    spec = runner.spec
    max_context = settings.max_context or spec.max_positions
    if max_context > spec.max_positions:
        raise SettingsError(
            f"max_context: {max_context} is beyond the model's {spec.max_positions} positions; use at most {spec.max_positions}"
        )
    budget = resolve_kv_budget(settings, spec.bytes_per_token, max_context)
    if settings.is_parallel:  # on GPUs each rank has its own free memory
        budget = runner.resolve_kv_budget(settings, budget)
    # the draft model's cache is indexed by the same blocks but would be missing on a hit
    prefix_caching = settings.enable_prefix_caching and settings.use_kv_cache and settings.speculative != "draft"
    if settings.enable_prefix_caching and settings.speculative == "draft":
        log.info("prefix caching is off: a draft model's cache is not shared between requests")
    try:
        cache = _window_cache(settings, runner, budget, max_context)
        if cache is None:
            cache = KVCacheManager(
                spec, budget, settings.kv_block_size, allocate_kv=runner.allocate_kv, prefix_caching=prefix_caching
            )
    except CacheBudgetError as e:
        raise SettingsError(f"kv_cache_bytes: {e}") from None
    if isinstance(cache, HybridKVCache):
        if cache.max_tokens_per_sequence < max_context:
            raise SettingsError(
                f"kv_cache_bytes: {budget} bytes hold {cache.max_tokens_per_sequence} tokens with sliding_window_kv "
                f"'window', less than one full-context sequence of {max_context}; raise it or lower max_context"
            )
        log.info("KV cache (sliding_window_kv 'window'): budget %d bytes = %d for the full-attention layers, %d for "
                 "the windowed layers' rings of %d blocks of %d tokens", cache.total_bytes,
                 cache.full.total_bytes if cache.full is not None else 0, cache.window.total_bytes,
                 cache.ring_blocks, cache.block_size)
    elif cache.max_tokens_per_sequence < max_context:
        need = (cache.blocks_for(max_context) + 1) * cache.block_bytes
        raise SettingsError(
            f"kv_cache_bytes: {budget} bytes hold {cache.max_tokens_per_sequence} tokens, less than one "
            f"full-context sequence ({max_context} tokens at {spec.bytes_per_token} bytes/token); "
            f"give at least {need} bytes or lower max_context"
        )
    else:
        log.info(
            "KV cache: %d bytes/token, budget %d bytes = %d blocks of %d tokens (%d full-context sequences of %d)",
            spec.bytes_per_token, cache.total_bytes, cache.usable_blocks, cache.block_size,
            cache.max_tokens_per_sequence // max_context, max_context,
        )
    if hasattr(runner, "max_context"):  # bounds the CUDA graphs' block tables
        runner.max_context = max_context
    if (hasattr(runner, "prepare_decode") and cache.device_table is not None and runner.device.type == "cuda"
            and cache.window_group is None):
        log.info("decode steps: %s", runner.prepare_decode(cache.pool, cache.block_size))
    sched = SchedulerConfig(
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=max(settings.max_num_batched_tokens, settings.max_num_seqs),
        max_queue_size=settings.max_queue_size,
        slo_ttft_s=settings.slo_ttft_ms / 1000 if settings.slo_ttft_ms > 0 else None,
        slo_tpot_s=settings.slo_tpot_ms / 1000 if settings.slo_tpot_ms > 0 else None,
        max_loras=settings.max_loras,
    )
    return Engine(
        runner,
        tokenizer,
        cache,
        sched,
        max_context=max_context,
        use_kv_cache=settings.use_kv_cache,
        queue_timeout_s=settings.queue_timeout_s,
        cancellation_check_s=settings.cancellation_check_period_ms / 1000,
        stream_interval=settings.stream_interval,
        observer=observer,
        drafter=build_drafter(settings, runner, cache, tokenizer, max_context),
        num_draft_tokens=settings.num_draft_tokens,
        schedule_ahead=settings.schedule_ahead,
        adaptive_speculation=settings.adaptive_speculation,
    )


def _window_cache(settings: EngineSettings, runner, budget: int, max_context: int) -> HybridKVCache | None:
    """sliding_window_kv 'window': the KV cache of two block groups, the windowed layers' in rings
    (window_kv.py); None for 'full', and for a model without a sliding-window layer (logged)."""
    if settings.sliding_window_kv != "window":
        return None
    model = getattr(runner, "transformer", None)
    if model is None:
        raise SettingsError("sliding_window_kv: 'window' needs the torch runtime's own forward pass; "
                            "set sliding_window_kv to 'full'")
    windows = [layer.block.sliding_window for layer in model.layers]
    if all(w is None for w in windows):
        log.info("sliding_window_kv: 'window' ignored: %s has no sliding-window layer, every layer keeps every position",
                 model.spec.family)
        return None
    # the most new tokens one row brings to a step: a prefill chunk, or a token and its draft
    step_tokens = max(settings.max_num_batched_tokens, settings.max_num_seqs, 1 + settings.num_draft_tokens)
    cache = HybridKVCache(model.spec, budget, settings.kv_block_size, windows, step_tokens, settings.max_num_seqs,
                          max_context, device=runner.device)
    if cache.window_group is not None:
        log.info("sliding_window_kv 'window': %s", model.use_window_groups().why)
    return cache


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
            f"{field}: cannot load the {kind} model from {where} ({error_summary(e)}); "
            "re-export the model or point the parameter at a complete export"
        ) from None


def build_drafter(
    settings: EngineSettings, target_runner, target_cache: KVCacheManager, target_tokenizer=None, max_context: int | None = None
):
    """The speculative drafter the settings ask for, or None. The draft model must read
    every position the target serves (max_context)."""
    from tritonlm.engine.speculative import DraftModelDrafter, PromptLookupDrafter

    if settings.speculative == "prompt_lookup":
        return PromptLookupDrafter(settings.prompt_lookup_ngram)
    if settings.speculative != "draft":
        return None
    if target_tokenizer is not None:
        check_same_tokenizer(target_tokenizer, load_tokenizer(settings.draft_model, "draft_model"), settings.draft_model)
    draft = _load_runner_or_explain(
        "draft_model", "torch", settings.draft_model, device=settings.device, **_torch_runner_kwargs(settings)
    )
    if draft.spec.vocab_size != target_runner.spec.vocab_size:
        raise SettingsError(
            f"draft_model: its vocabulary has {draft.spec.vocab_size} tokens, the target's {target_runner.spec.vocab_size}; "
            "a draft must share the target's tokenizer"
        )
    if max_context is not None and draft.max_positions is not None and draft.max_positions < max_context:
        raise SettingsError(
            f"draft_model: it reads {draft.max_positions} positions, less than max_context={max_context}; "
            f"lower max_context to {draft.max_positions} or pick a draft with a longer context"
        )
    log.info("speculative decoding: draft model %s, up to %d draft tokens", settings.draft_model, settings.num_draft_tokens)
    drafter = DraftModelDrafter(draft, target_cache)
    if max_context is not None:
        draft.max_context = max_context
    if target_cache.device_table is not None and drafter.pool is not None and draft.device.type == "cuda":
        log.info("draft model's decode steps: %s", draft.prepare_decode(drafter.pool, target_cache.block_size))
    return drafter
