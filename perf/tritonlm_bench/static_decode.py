"""A reference decode loop for GPU figures: a static KV cache and torch.compile, gpt-fast style.

The served engine's GPU throughput is judged against what the same weights give when
nothing else is in the way: every row of a fixed batch at the same position, the cache a
dense [B, Hkv, T, D] tensor per layer written at that position, and the whole step one
compiled graph (`torch.compile(mode="reduce-overhead")`: inductor's kernels replayed as a
CUDA graph). That loop does no scheduling, no paging and no continuous batching, so it
is a ceiling, not a competitor. It reuses the served Transformer's weights (Llama family
or GPT-2), so both run exactly the same model.

    StaticDecoder(transformer, batch, max_len).tokens_per_second(prompt_len, new_tokens)
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from tritonlm.engine.runners.rope import apply_rope, rope_cos_sin


class StaticDecoder:
    def __init__(self, transformer, batch: int, max_len: int, compile: bool = True):
        t = transformer
        self.t = t
        self.batch, self.max_len = batch, max_len
        spec, dev = t.spec, t.device
        shape = (batch, t.kv_heads, max_len, spec.head_dim)  # [B, Hkv, T, D]
        self.k = [torch.zeros(shape, dtype=t.dtype, device=dev) for _ in t.layers]
        self.v = [torch.zeros(shape, dtype=t.dtype, device=dev) for _ in t.layers]
        if compile:
            # the weights and caches keep their addresses: the graph reads them in place
            # instead of copying them in before every replay
            for tensor in self._tensors():
                torch._dynamo.mark_static_address(tensor)
        self.step = torch.compile(self._step, mode="reduce-overhead", fullgraph=True) if compile else self._step

    def _tensors(self) -> list[torch.Tensor]:
        t, out = self.t, self.k + self.v
        for obj in [t.wte, t.wpe, t.inv_freq, t.ln_f, t.lm_head] + [
            part for layer in t.layers for part in vars(layer).values()
        ]:
            if isinstance(obj, torch.Tensor):
                out.append(obj)
            elif obj is not None and hasattr(obj, "__dict__"):
                out += [x for x in vars(obj).values() if isinstance(x, torch.Tensor)]
        return out

    @torch.no_grad()
    def _step(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """ids [B] int64 (this step's tokens), pos [1] int64 (their shared position) -> next tokens [B]."""
        t = self.t
        d, heads, kv = t.spec.head_dim, t.heads, t.kv_heads
        bsz = ids.shape[0]
        x = F.embedding(ids, t.wte).unsqueeze(1)  # [B, 1, C]
        if t.wpe is not None:
            x = x + F.embedding(pos, t.wpe).unsqueeze(0)
        rope = None
        if t.inv_freq is not None:
            rope = rope_cos_sin(pos.view(1, 1).expand(bsz, 1), t.inv_freq, t.rope_scaling, t.dtype)
        keys = torch.arange(self.max_len, device=ids.device)
        mask = (keys <= pos).view(1, 1, 1, -1)  # [1, 1, 1, T]
        for li, layer in enumerate(t.layers):
            h = layer.ln_attn(x)
            qkv = layer.qkv(h).view(bsz, 1, heads + 2 * kv, d)
            q, k, v = qkv.split([heads, kv, kv], dim=2)  # [B, 1, H|Hkv, D]
            if rope is not None:
                q, k = apply_rope(q, *rope), apply_rope(k, *rope)
            self.k[li].index_copy_(2, pos, k.transpose(1, 2))
            self.v[li].index_copy_(2, pos, v.transpose(1, 2))
            att = F.scaled_dot_product_attention(
                q.transpose(1, 2), self.k[li], self.v[li], attn_mask=mask, scale=layer.attn_scale,
                enable_gqa=heads != kv,
            )  # [B, H, 1, D]
            x = x + layer.o(att.transpose(1, 2).reshape(bsz, 1, heads * d))
            h = layer.ln_mlp(x)
            if layer.fc is not None:
                inner = t.act(layer.fc(h))
            else:
                gate, up = layer.gate_up(h).chunk(2, dim=-1)
                inner = t.act(gate) * up
            x = x + layer.down(inner)
        logits = t.lm_head(t.ln_f(x[:, 0]))  # [B, V]
        return logits.argmax(-1)

    def tokens_per_second(self, prompt_len: int, new_tokens: int) -> tuple[float, float]:
        """(decode tok/s over new_tokens steps after a prompt_len-token prefix fed one token
        per step, seconds spent before timing: compilation and warm-up)."""
        dev = self.t.device
        ids = torch.randint(0, self.t.spec.vocab_size, (self.batch,), device=dev)
        t0 = time.perf_counter()
        for p in range(prompt_len):  # the first calls compile and record the graph
            ids = self.step(ids, torch.tensor([p], device=dev)).clone()
        torch.cuda.synchronize(dev)
        warm = time.perf_counter() - t0
        t0 = time.perf_counter()
        for p in range(prompt_len, prompt_len + new_tokens):
            ids = self.step(ids, torch.tensor([p], device=dev)).clone()
        torch.cuda.synchronize(dev)
        return self.batch * new_tokens / (time.perf_counter() - t0), warm
