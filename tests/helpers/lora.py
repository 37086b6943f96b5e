"""PEFT adapters the multi-LoRA tests share: random (init_lora_weights=False, so B is not
zero) adapters made by PEFT itself on a tiny seeded model, saved as PEFT saves them, and
PEFT's merge_and_unload() of each: the reference forward pass and generate()."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from tritonlm.engine.batch import StepBatch

# adapters of the exactness tests: ranks 4, 8 and 16, rsLoRA, rank / alpha patterns, all-linear,
# a list with layers_to_transform, a regex, and modules_to_save (a new LM head, a new embedding)
ADAPTERS = {
    "all4": dict(r=4, lora_alpha=8, target_modules="all-linear"),
    "rs8": dict(r=8, lora_alpha=16, use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"],
                layers_to_transform=[1]),
    "regex16": dict(r=16, lora_alpha=8, target_modules=r".*\.(k_proj|o_proj|up_proj)",
                    rank_pattern={"o_proj": 4}, alpha_pattern={"up_proj": 3}, modules_to_save=["lm_head"]),
    "embed4": dict(r=4, lora_alpha=4, target_modules=["gate_proj", "q_proj"], modules_to_save=["embed_tokens"]),
}


def make_adapter(model, folder: Path, seed: int, **lora) -> torch.nn.Module:
    """A random PEFT LoRA adapter of `model` (untouched: a copy is adapted) saved in `folder`;
    returns PEFT's merged model. modules_to_save copies are perturbed, so they matter."""
    from peft import LoraConfig, get_peft_model
    from peft.utils.other import ModulesToSaveWrapper

    torch.manual_seed(seed)
    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(init_lora_weights=False, **lora))
    with torch.no_grad():
        for module in peft_model.modules():
            if isinstance(module, ModulesToSaveWrapper):
                weight = module.modules_to_save["default"].weight
                weight.add_(torch.randn_like(weight) * 0.1)
    peft_model.save_pretrained(str(folder))
    return peft_model.merge_and_unload().eval()


def write_config(folder: Path, **fields) -> None:
    """Rewrite fields of a saved adapter's adapter_config.json (for the refusals)."""
    import json

    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(fields)
    path.write_text(json.dumps(config))


def lora_rows(runner, mgr, rows: list[tuple[int, int, list[int]]], adapters: list, all_logits: bool = False,
              block_tables: bool = False) -> torch.Tensor:
    """One forward of rows (seq id, past length, new tokens), row b under adapters[b] (None:
    the base), from slot tables or, as the engine's batches come, block tables."""
    news, pasts = [new for _, _, new in rows], [past for _, past, _ in rows]
    if block_tables:
        batch = StepBatch.from_block_table(news, pasts, mgr.device_table.gather([s for s, _, _ in rows]),
                                           mgr.block_size, all_logits)
    else:
        batch = StepBatch.build(news, pasts, [mgr.slots(s, p + len(n)) for s, p, n in rows], all_logits)
    batch.adapters = adapters
    return runner.forward(batch, pool=mgr.pool)
