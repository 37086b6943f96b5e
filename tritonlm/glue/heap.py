"""A model process's start-up heap, kept out of the garbage collector's full passes (plain
Python: no Triton import, so unit tests reach it).

A served model's process holds a great many container objects from its start
(torch, transformers, the tokenizer, the engine's tables) that live as long as it does.
CPython's full (generation 2) collection walks every one of them, holding the GIL, on
whichever thread happened to allocate: a step, or a stream's response, waits for it. Once
loading is done they are moved to the permanent generation (gc.freeze), which the collector
never walks; what serving allocates later is still collected, and anything frozen that
dies is still freed by its reference count (a frozen object that dies inside a reference
cycle is not: such garbage stays, bounded by the start-up heap). vLLM and SGLang freeze
their start-up heap the same way."""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """Collect what start-up left unreachable, then freeze everything alive; the number of
    objects now frozen."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("start-up heap: %d objects frozen out of full garbage collections", frozen)
    return frozen
