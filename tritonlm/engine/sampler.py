"""Next-token choice per row of one batch, each row with its own settings.

Order: the guide's mask (guided decoding, guided.py: tokens that would leave the guide
out, the row's end tokens only where the guide is complete), repetition penalty (Hugging
Face's), frequency and presence penalties over
the answer so far and logit bias (OpenAI's), banned tokens (bad words, EOS and
stop token ids before min_tokens), temperature, min-p, top-k, top-p (vLLM's order
of the last four), then argmax (greedy) or an inverse-CDF draw with the row's own
uniform: a function of the row's seed and the index of the token being decided
(draws.py), so a seed gives the same text whatever else shares the batch and on
whichever device the logits are.

`sample_rows` decides a step's rows together, on the logits' device, with one host sync
for the whole batch; `sample_row` decides one row with the same arithmetic.

Log-probabilities have one source: log_softmax of the model's raw logits (`raw_log_probs`),
before every step above, as vLLM reports them by default (its `raw_logprobs`). The chosen
token's value, its rank and the most likely alternatives (`token_log_probs`) all come from
it, so a token listed both as chosen and among the alternatives has one value, and neither
depends on the guide, the penalties, the bans or the temperature.
"""

from __future__ import annotations

import secrets
from collections import Counter
from dataclasses import dataclass, field

import torch

from tritonlm.engine import draws
from tritonlm.engine.draws import SAMPLE, inverse_cdf
from tritonlm.engine.guided import GuideState, allocate_masks, apply_masks, fill_masks
from tritonlm.engine.kernels import kernels_loaded
from tritonlm.engine.request import SamplingParams

FLOAT32_MAX = torch.finfo(torch.float32).max


@dataclass
class RowState:
    """What the sampler needs to know about one sequence.

    `token_ids` is the sequence's own token history (prompt + generated), shared, not
    copied: the engine appends each new token there once and the sampler, detokenizer
    and drafters all read the same list."""

    params: SamplingParams
    token_ids: list[int]  # prompt + generated so far (for penalties and bad words)
    num_prompt: int
    eos_id: int | None
    seed: int  # the row's draws are a function of it (draws.py): set, or random per request
    # guided decoding: the matcher over this row's answer, which follows token_ids by itself
    # (forks share it: it rolls back to whichever history it is synced with next)
    guide: GuideState | None = None
    # greedy, nothing that changes the logits, no log-probabilities, no guide: what
    # plain_greedy needs of the row apart from its bans, fixed for the request's life
    plain_params: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        p = self.params
        self.plain_params = p.greedy and not p.changes_logits and not p.return_log_probs and self.guide is None

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def end_ids(self) -> list[int]:
        """The tokens that end the answer: its EOS and stop token ids."""
        return ([] if self.eos_id is None else [self.eos_id]) + list(self.params.stop_token_ids)

    def ends_on(self, token: int) -> bool:
        """Producing token ends the answer: the row's EOS or one of its stop token ids."""
        return token == self.eos_id or token in self.params.stop_token_ids

    def uniform(self, stream: int = SAMPLE) -> float:
        """The row's uniform in [0, 1) for the token it decides next (index num_generated)."""
        return draws.uniform(self.seed, self.num_generated, stream)

    @staticmethod
    def make(params: SamplingParams, token_ids: list[int], eos_id: int | None, guide: GuideState | None = None) -> "RowState":
        """token_ids: the prompt, by reference (the history grows in place). Without a seed in
        the request the row gets a random one, so unseeded requests differ from run to run."""
        seed = params.seed if params.seed is not None else secrets.randbits(64)
        return RowState(params, token_ids, len(token_ids), eos_id, seed, guide)

    def fork(self) -> "RowState":
        """A copy whose history can grow with guesses (drafting, verifying) without touching
        the sequence's; the seed is kept, so its draws at an index are the sequence's own."""
        return RowState(self.params, list(self.token_ids), self.num_prompt, self.eos_id, self.seed, self.guide)

    def guide_mask(self) -> torch.Tensor:
        """[ceil(V / 32)] int32: the guide's allowed tokens after this row's history."""
        return guide_masks([self])[0]


def guide_masks(rows: list[RowState]) -> torch.Tensor:
    """[n, ceil(V / 32)] int32: each guided row's allowed tokens after its history, filled
    together on the grammar library's threads."""
    states = [row.guide for row in rows]
    assert all(s is not None for s in states)
    for row, state in zip(rows, states):
        state.sync(row.token_ids[row.num_prompt:], row.end_ids)
    masks = allocate_masks(len(rows), states[0].compiler.vocab_size)
    fill_masks(states, masks, states[0].compiler)
    return masks


def process_logits(logits: torch.Tensor, row: RowState, guide_mask: torch.Tensor | None = None) -> torch.Tensor:
    """[V] raw logits -> [V] logits with the guide's mask, penalties, bans and temperature
    applied (a new tensor). guide_mask: the row's [ceil(V / 32)] mask when already made
    (guide_masks); a guided row without one makes its own."""
    p = row.params
    device = logits.device
    # NaN (an overflow upstream) can never win; +inf would make every probability NaN
    out = torch.nan_to_num(logits.to(torch.float32), nan=float("-inf"), posinf=FLOAT32_MAX)
    if row.guide is not None:
        mask = row.guide_mask() if guide_mask is None else guide_mask  # [ceil(V / 32)]
        apply_masks(out.unsqueeze(0), mask.unsqueeze(0), [row.guide], [row.end_ids])
    if p.repetition_penalty != 1.0 and row.token_ids:
        seen = to_device(sorted(set(row.token_ids)), torch.int64, device)
        vals = out[seen]
        out[seen] = torch.where(vals < 0, vals * p.repetition_penalty, vals / p.repetition_penalty)
    if p.frequency_penalty or p.presence_penalty:
        answer = row.token_ids[row.num_prompt:]
        if answer:
            # counted on the host: torch.unique on a GPU would wait for the device
            counted = Counter(answer)
            ids = to_device(list(counted), torch.int64, device)
            counts = to_device(list(counted.values()), torch.float32, device)
            out[ids] = out[ids] - (p.frequency_penalty * counts + p.presence_penalty)
    if p.logit_bias:
        ids = to_device([t for t, _ in p.logit_bias], torch.int64, device)
        out[ids] = out[ids] + to_device([b for _, b in p.logit_bias], torch.float32, device)
    banned = banned_tokens(row)
    if banned:
        # index_fill_ takes the value as a scalar: assigning one by indexing copies it to the
        # device first, and that copy waits for the device
        out.index_fill_(0, to_device(banned, torch.int64, device), float("-inf"))
    if not p.greedy and p.temperature != 1.0:
        # clipped again: a clipped +inf divided by a temperature below 1 overflows once more
        out = (out / p.temperature).clamp_(max=FLOAT32_MAX)
    return out


def banned_tokens(row: RowState) -> list[int]:
    p = row.params
    banned: list[int] = []
    # a finished guide leaves only the end tokens: min_tokens cannot hold them back
    if row.num_generated < p.min_tokens and not (row.guide is not None and row.guide.must_end()):
        if row.eos_id is not None:
            banned.append(row.eos_id)
        banned.extend(p.stop_token_ids)
    for seq in p.bad_words:
        # ban the last token of a bad word when the text so far ends with the rest of it
        prefix = list(seq[:-1])
        if not prefix or row.token_ids[-len(prefix):] == prefix:
            banned.append(seq[-1])
    return banned


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """[V] -> [V] with tokens below min-p, outside top-k or outside the top-p nucleus set to -inf."""
    if min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        # stable: tied logits keep index order, so which of them the cut-off keeps is defined
        # (and filter_batch, sorting once for top-k and top-p, keeps the same ones)
        sorted_logits, order = torch.sort(logits, descending=True, stable=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        # drop a token when the mass before it already reaches top_p (the first always stays)
        drop_sorted = (cum - torch.softmax(sorted_logits, dim=-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def next_token_distribution(logits: torch.Tensor, row: RowState) -> torch.Tensor:
    """[V] raw logits -> [V] probabilities the row samples from (one-hot for greedy)."""
    processed = process_logits(logits, row)
    if row.params.greedy:
        probs = torch.zeros_like(processed)
        probs[int(torch.argmax(processed))] = 1.0
        return probs
    filtered = filter_top_k_top_p(processed, row.params.top_k, row.params.top_p, row.params.min_p)
    return torch.softmax(filtered, dim=-1)


def plain_greedy(row: RowState) -> bool:
    """Greedy with nothing that changes the logits and no log-probability asked for: the
    next token is the raw logits' argmax."""
    if not row.plain_params:
        return False
    p = row.params
    if not p.bad_words and len(row.token_ids) - row.num_prompt >= p.min_tokens:
        return True  # banned_tokens would find nothing; this runs for every row of every step
    return not banned_tokens(row)


def native_argmax() -> bool:
    """tritonlm's C++ greedy_argmax can run here (kernels/decode_ops.cpp): the kernels are
    loaded already. Sampling never loads them itself: where the runner did not (another
    runner, another dtype, the gather attention), torch's max serves, and no build or ISA
    refusal can happen on the engine thread mid-step."""
    return kernels_loaded()


def greedy_tokens(logits: torch.Tensor) -> list[int | None]:
    """[n, V] raw logits of plain-greedy rows -> each row's argmax, or None where that winner
    is not finite (NaN or +inf in the row), which sample_row then decides."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2 and native_argmax():
        # the same first maximal index, and -1 where torch.max's winner would not be finite;
        # torch.max reduces value and index element by element (docs/performance-notes.md)
        return [t if t >= 0 else None for t in torch.ops.tritonlm.greedy_argmax(logits.contiguous()).tolist()]
    # max(dim) gives the first maximal index like argmax (NaN ranked highest too) and the
    # winning values, in half argmax(dim)'s time on CPU at [32, 49152]
    values, tokens = torch.max(logits, dim=-1)  # [n], [n]
    finite = torch.isfinite(values)
    return [t if ok else None for t, ok in zip(tokens.tolist(), finite.tolist())]


def filter_batch(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """[n, V] logits, [n] top_k / top_p / min_p -> [n, V]: filter_top_k_top_p on every row at
    once (min-p, then top-k keeping ties, then top-p keeping the first token). A row with
    top_k 0, top_p 1 and min_p 0 comes out unchanged."""
    vocab = logits.shape[-1]
    device = logits.device
    neg_inf = float("-inf")
    # float32 like the per-row function, whose Python-float settings meet float32 tensors
    min_p = min_p.to(device=device, dtype=torch.float32).unsqueeze(-1)  # [n, 1]
    top_p = top_p.to(device=device, dtype=torch.float32).unsqueeze(-1)  # [n, 1]
    top_k = top_k.to(device=device, dtype=torch.int64).unsqueeze(-1)  # [n, 1]

    probs = torch.softmax(logits, dim=-1)  # [n, V]
    # min_p 0: a threshold of 0, below which no probability lies
    logits = logits.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), neg_inf)

    # one sort serves top-k and top-p: top-k removes a tail of this order, so masking that
    # tail gives the order a second sort of the top-k-filtered logits would give
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)  # [n, V]
    k_on = (top_k > 0) & (top_k < vocab)  # [n, 1]
    kth = sorted_logits.gather(-1, torch.where(k_on, top_k - 1, 0))  # [n, 1]
    kth = torch.where(k_on, kth, neg_inf)  # top-k off: nothing is below -inf
    logits = logits.masked_fill(logits < kth, neg_inf)
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, neg_inf)

    sorted_probs = torch.softmax(sorted_logits, dim=-1)  # [n, V]
    cum = sorted_probs.cumsum(-1)  # [n, V]
    # top_p 1 is off: rounding could push the mass before a token to 1 and drop it
    threshold = torch.where(top_p < 1.0, top_p, float("inf"))  # [n, 1]
    drop_sorted = (cum - sorted_probs) >= threshold  # [n, V]
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)  # [n, V], vocabulary order
    return logits.masked_fill(drop, neg_inf)


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on device, without waiting for the device: a plain copy to a
    GPU waits for the work queued before it, an asynchronous one from pinned memory does not
    (the caching host allocator keeps that memory until the copy is done)."""
    tensor = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def owns_logits(row: RowState) -> bool:
    """The row's logits change in a way of its own (penalties, bias, bans): process_logits
    runs on that row alone. A guide alone does not: sample_rows masks such rows together."""
    return row.params.changes_logits or bool(banned_tokens(row))


def filters(params: SamplingParams) -> bool:
    return not params.greedy and (params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0.0)


NO_FINITE_LOGIT = "the model's logits hold no finite value for this sequence"


def sample_rows(logits: torch.Tensor, rows: list[RowState]) -> list[tuple[int, float]]:
    """[n, V] raw logits, row i's settings in rows[i] -> (token, its raw log-probability
    (raw_log_probs); 0.0 unless asked for) per row.

    Works on the logits' device and waits for it once, for all tokens and log-probabilities
    together. Raises ValueError when a row's logits hold no finite value: the caller then
    samples row by row (sample_row gives the same tokens) so that only that row fails."""
    if not rows:
        return []
    tokens, logprobs, no_finite = draw_rows(logits, rows)
    # the one host sync: tokens, log-probabilities and the failed rows in one transfer
    packed = torch.stack([tokens.to(torch.float64), logprobs.to(torch.float64), no_finite.to(torch.float64)], dim=-1)
    out: list[tuple[int, float]] = []
    for token, logprob, failed in packed.tolist():
        if failed:
            raise ValueError(NO_FINITE_LOGIT)
        out.append((int(token), logprob))
    return out


def decided_on_device(row: RowState) -> bool:
    """The row's next token can be chosen before its last one is known on the host: nothing
    in its choice reads the values of its history (penalties, a bad word's prefix, a guide)
    and it asks for no log-probabilities. Its seeded draws need only the history's length."""
    p = row.params
    return (row.guide is None and not p.return_log_probs and not p.top_log_probs and p.repetition_penalty == 1.0
            and not p.frequency_penalty and not p.presence_penalty and all(len(w) <= 1 for w in p.bad_words))


def draw_rows(logits: torch.Tensor, rows: list[RowState]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """sample_rows without the wait: [n, V] raw logits -> the tokens [n] int64, their raw
    log-probabilities [n] float32 (0 unless asked for) and which rows have no finite logit
    [n] bool, all on the logits' device. Rows with a guide or penalties read their history
    on the host here; decided_on_device rows read only its length."""
    n = len(rows)
    device = logits.device
    processed = torch.nan_to_num(logits.to(torch.float32), nan=float("-inf"), posinf=FLOAT32_MAX)  # [n, V]
    own = [owns_logits(row) for row in rows]
    guided = [i for i, row in enumerate(rows) if row.guide is not None]
    masks = guide_masks([rows[i] for i in guided]) if guided else None  # [g, ceil(V / 32)]
    mask_of = {i: masks[j] for j, i in enumerate(guided)}  # row -> [ceil(V / 32)]
    for i, row in enumerate(rows):
        if own[i]:
            processed[i] = process_logits(logits[i], row, mask_of.get(i))  # temperature included
    masked = [j for j, i in enumerate(guided) if not own[i]]  # guided rows without logits of their own
    if len(masked) == n:  # every row guided (then guided is 0 .. n-1): one pass over the batch
        apply_masks(processed, masks, [row.guide for row in rows], [row.end_ids for row in rows])
    else:  # in place, row by row: a gather of the rows and a scatter back cost more than the masks
        for j in masked:
            row = rows[guided[j]]
            apply_masks(processed[guided[j]:guided[j] + 1], masks[j:j + 1], [row.guide], [row.end_ids])

    greedy = [row.params.greedy for row in rows]
    # temperature 1 where it is already applied (own rows) or means nothing (greedy)
    temperatures = [1.0 if g or o else row.params.temperature for row, g, o in zip(rows, greedy, own)]
    table = to_device(
        [
            [
                0.0 if g else row.uniform(SAMPLE),
                t,
                0 if g else row.params.top_k,
                1.0 if g else row.params.top_p,
                0.0 if g else row.params.min_p,
                float(g),
                float(row.params.return_log_probs),
            ]
            for row, g, t in zip(rows, greedy, temperatures)
        ],
        torch.float64,
        device,
    )  # [n, 7]: one copy to the device for every per-row setting
    is_greedy = table[:, 5] > 0  # [n]
    if any(t != 1.0 for t in temperatures):
        # clipped as in process_logits, so every row with a finite logit has a distribution
        processed = (processed / table[:, 1:2].to(torch.float32)).clamp_(max=FLOAT32_MAX)  # [n, V]
    no_finite = ~torch.isfinite(processed).any(dim=-1)  # [n]

    tokens: torch.Tensor | None = None
    if not all(greedy):
        filtered = processed
        picked = [i for i, row in enumerate(rows) if filters(row.params)]
        if len(picked) == n:
            filtered = filter_batch(processed, table[:, 2], table[:, 3], table[:, 4])
        elif picked:  # only the rows that filter pay for the sort
            index = to_device(picked, torch.int64, device)
            sub = table[index]  # [m, 7]
            filtered = processed.index_copy(0, index, filter_batch(processed[index], sub[:, 2], sub[:, 3], sub[:, 4]))
        probs = torch.softmax(filtered, dim=-1)  # [n, V]
        tokens = inverse_cdf(probs, table[:, 0])  # [n]
    if any(greedy):
        argmax = processed.argmax(dim=-1)  # [n]
        tokens = argmax if tokens is None else torch.where(is_greedy, argmax, tokens)
    assert tokens is not None

    logprobs = torch.zeros(n, dtype=torch.float32, device=device)  # [n]
    if any(row.params.return_log_probs for row in rows):
        chosen = raw_log_probs(logits).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # [n]
        logprobs = torch.where(table[:, 6] > 0, chosen, logprobs)

    return tokens, logprobs, no_finite


def sample_row(logits: torch.Tensor, row: RowState) -> tuple[int, float]:
    """[V] raw logits -> (token, its raw log-probability; 0.0 unless asked for): sample_rows
    on a batch of one, so a row decides the same token alone or batched."""
    if plain_greedy(row):
        # Plain greedy, the common case: one pass over V. A finite winner means no NaN and no
        # +inf in the row, and the full path would pick the same token; otherwise it decides.
        token = greedy_tokens(logits.unsqueeze(0))[0]
        if token is not None:
            return token, 0.0
    return sample_rows(logits.unsqueeze(0), [row])[0]


def raw_log_probs(logits: torch.Tensor) -> torch.Tensor:
    """[n, V] (or [V]) raw logits -> the same shape of float32 log-probabilities: log_softmax
    of the model's logits before the guide, penalties, bias, bans and temperature. NaN counts
    as -inf and +inf as the largest float, as in sampling, so one bad logit does not turn
    every value of its row into NaN."""
    clean = torch.nan_to_num(logits.to(torch.float32), nan=float("-inf"), posinf=FLOAT32_MAX)
    return torch.log_softmax(clean, dim=-1)


@dataclass
class TokenLogProbs:
    """One position's log-probabilities, all from raw_log_probs."""

    chosen: float  # the chosen token's
    rank: int  # its rank (1: the most likely; vLLM's Logprob.rank)
    top: list[tuple[int, float]]  # the most likely (token id, log-probability), most likely first


def token_log_probs(logits: torch.Tensor, tokens: list[int], counts: list[int]) -> list[TokenLogProbs]:
    """logits [n, V] raw, tokens[i] row i's chosen token, counts[i] how many most likely tokens
    it lists -> each row's TokenLogProbs, from one log_softmax (raw_log_probs) and one host
    sync for the batch: the chosen token's value is its entry among the most likely, bit for bit."""
    logprobs = raw_log_probs(logits)  # [n, V]
    index = to_device(tokens, torch.int64, logprobs.device).unsqueeze(-1)  # [n, 1]
    chosen = logprobs.gather(-1, index)  # [n, 1]
    ranks = (logprobs > chosen).sum(dim=-1, keepdim=True)  # [n, 1]: tokens more likely than the chosen one
    k = max(counts, default=0)
    values, ids = torch.topk(logprobs, k, dim=-1)  # [n, k]
    # the one host sync: float64 holds every token id and rank exactly
    packed = torch.cat([chosen.double(), ranks.double(), values.double(), ids.double()], dim=-1).tolist()  # [n, 2 + 2k]
    out = []
    for row, c in zip(packed, counts):
        top = [(int(t), v) for t, v in zip(row[2 + k: 2 + k + c], row[2: 2 + c])]
        out.append(TokenLogProbs(row[0], int(row[1]) + 1, top))
    return out
