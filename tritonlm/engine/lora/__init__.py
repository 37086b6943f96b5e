"""Multi-LoRA: PEFT adapters on one base model, chosen per row of a step (docs/lora.md).

    adapter.load_adapter(folder, model, name, max_rank) -> LoraAdapter   a PEFT folder, checked
    apply.attach_lora(model) -> LoraState                                  the model takes adapters
    registry.LoraRegistry(model, folders, max_rank, max_cpu_loras)         adapters by name, an LRU
    GenerationRequest.lora / StepBatch.adapters[b]                         a request's / row's adapter
"""

from tritonlm.engine.lora.adapter import LoraAdapter, load_adapter
from tritonlm.engine.lora.apply import LoraState, LoraStep, attach_lora

__all__ = ["LoraAdapter", "LoraState", "LoraStep", "attach_lora", "load_adapter"]
