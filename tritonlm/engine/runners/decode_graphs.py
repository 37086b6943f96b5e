"""Decode steps on a GPU as replays of captured CUDA graphs, one graph per batch bucket.

A decode step of a small model is ~40 kernels per layer; launched one by one from Python
the GPU waits on the host between them. A CUDA graph records the whole step once and
replays it with one launch. What a replay needs (vLLM's and gpt-fast's recipe):

    persistent inputs   the step's token ids and positions ([2, Bmax] int64) and the rows'
                        block tables ([Bmax, M] int32), written before each replay
    no host reads       slots, key counts and RoPE angles are computed from those on the
                        device, attention is the Triton paged kernel (fixed launch grid)
    static output       logits [Bmax, V] float32, copied out after the replay
    buckets             batch sizes 1, 2, 4, ... max_batch: a batch runs in the smallest
                        bucket that holds it; padding rows are token 0 at position 0 over
                        block 0, the pool's scratch block, so they write only scratch
    several tokens      a row with T new tokens (speculative verification) runs as T
                        one-token rows, each over the keys up to its own position
    compiled (optional) the step through torch.compile first (`compile_decode`): inductor
                        fuses the element-wise work around the matmuls and the paged kernel
                        (custom ops, kernels/torch_ops.py) into far fewer launches

Graphs are captured lazily, the first time a bucket is used (outside any other capture),
and share one memory pool. With graphs off the same padded step runs eagerly on the same
buffers, so logits are bitwise equal either way (the kernels and shapes are the same).
"""

from __future__ import annotations

import torch

from tritonlm.engine.batch import StepBatch
from tritonlm.engine.block_table import position_slots
from tritonlm.engine.kv_cache import KVPool
from tritonlm.engine.runners.base import ForwardBatch

CUDA_GRAPH_MODES = ("auto", "off")
MAX_WIDTH = 8  # new tokens per row a step may bring here (decode: 1, speculative verification: K + 1)


def buckets(max_batch: int) -> list[int]:
    """1, 2, 4, ... up to the first power of two >= max_batch."""
    out = [1]
    while out[-1] < max_batch:
        out.append(out[-1] * 2)
    return out


class DecodeGraphs:
    """Runs width-1 decode batches of a Transformer as padded, optionally graph-captured steps."""

    def __init__(
        self, transformer, pool: KVPool, max_batch: int, max_blocks: int, block_size: int, graphs: bool,
        compile: bool = False,
    ):
        """max_blocks: the block-table width a step may use (blocks of the longest sequence
        the engine admits); graphs: capture and replay (CUDA), else run eagerly; compile:
        the step through torch.compile (inductor fuses its element-wise work), once for
        every batch size (dynamic), then captured per bucket like the eager step."""
        self.transformer = transformer
        self.pool = pool
        self.device = transformer.device
        self.buckets = buckets(max_batch)
        self.max_batch = self.buckets[-1]
        self.max_blocks = max(1, max_blocks)
        self.block_size = block_size
        self.use_graphs = graphs and self.device.type == "cuda"
        dev = self.device
        self.inputs = torch.zeros(2, self.max_batch, dtype=torch.int64, device=dev)  # [2, Bmax]: ids, positions
        self.tables = torch.zeros(self.max_batch, self.max_blocks, dtype=torch.int32, device=dev)  # [Bmax, M]
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}  # bucket -> the captured step's logits [b, V]
        self._mempool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        # a step's host-made indices, pinned on a GPU, and where they land on the device:
        # [ids, positions, each token's row, where its logits go] x Bmax
        self._staging = torch.zeros(4, self.max_batch, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        self._indices = torch.zeros(4, self.max_batch, dtype=torch.int64, device=dev)
        self._staged: torch.cuda.Event | None = None  # recorded after the copy out of _staging
        self.compiled = compile
        self._run = self._body
        if compile:
            # dynamic: one compilation serves every bucket (a size-1 batch may get its own)
            self._run = torch.compile(self._body, dynamic=True)

    def accepts(self, batch: StepBatch) -> bool:
        """A batch with device block tables of at most MAX_WIDTH new tokens per row (decode
        steps, speculative verification, short prefill chunks) whose tokens fit the buckets."""
        return (
            batch.block_table is not None and batch.block_size == self.block_size and batch.width <= MAX_WIDTH
            and int(batch.num_new.sum()) <= self.max_batch
            and int((batch.past_len + batch.num_new).max()) <= self.max_blocks * self.block_size
        )

    @property
    def captured(self) -> list[int]:
        return sorted(self._graphs)

    def bucket(self, rows: int) -> int:
        return next(b for b in self.buckets if b >= rows)

    # ---- the step ---------------------------------------------------------------------
    def _step(self, rows: int) -> torch.Tensor:
        """The padded decode step over the persistent buffers' first `rows` rows -> logits [rows, V]."""
        ids = self.inputs[0, :rows].view(rows, 1)  # [b, 1]
        pos = self.inputs[1, :rows].view(rows, 1)  # [b, 1]
        table = self.tables[:rows]  # [b, M]
        with torch.inference_mode():
            return self._run(ids, pos, table)

    def _body(self, ids: torch.Tensor, pos: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """ids, pos [b, 1] int64, table [b, M] int32 -> logits [b, V] float32: embedding, the
        layers (the paged kernel for attention) and the head, no host read."""
        total = pos[:, 0] + 1  # [b]
        plan = ForwardBatch(
            input_ids=ids, positions=pos, valid=torch.ones_like(ids, dtype=torch.bool),
            write_slots=position_slots(table, pos, self.block_size), slot_table=None,
            past_len=pos[:, 0], num_new=torch.ones_like(total), total_len=total, max_past=0, max_total=0,
            packed=None, block_table=table, seq_lens=total.to(torch.int32), block_size=self.block_size,
        )
        t = self.transformer
        return t.head(plan, t.run_layers(plan, t.embed(plan), self.pool), False)  # [b, V]

    def _capture(self, rows: int) -> None:
        # the buffers' rows point at scratch while warming up and capturing: those runs write K/V
        self.inputs[:, :rows].zero_()
        self.tables[:rows].zero_()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # compiles the Triton kernel, sets up cuBLAS workspaces
                self._step(rows)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._mempool):
            self._outputs[rows] = self._step(rows)
        self._graphs[rows] = graph

    def capture_all(self) -> None:
        """Capture every bucket now (at load), so no request pays for a capture or a compile."""
        if self.use_graphs:
            for rows in reversed(self.buckets):  # largest first: the smaller ones reuse its memory
                if rows not in self._graphs:
                    self._capture(rows)

    def forward(self, batch: StepBatch) -> torch.Tensor:
        """batch (accepts() true) -> float32 logits of its own: [B, V] (each row's last new
        token), or [B, T, V] with all_logits (entries past a row's num_new are zeros).

        A row with several new tokens runs as that many one-token rows, each attending to the
        keys up to its own position: the same causal attention, as the new tokens' K/V are all
        written before any is read."""
        bsz, width = batch.batch_size, batch.width
        if width == 1:
            tokens, ids, pos, row_of = bsz, batch.input_ids[:, 0], batch.past_len, None
        else:
            num_new = batch.num_new.to(torch.int64)
            row_of = torch.repeat_interleave(torch.arange(bsz), num_new)  # [N] the row of each token
            starts = num_new.cumsum(0) - num_new  # [B]
            t = torch.arange(int(num_new.sum())) - starts[row_of]  # [N] its offset in the row
            tokens, ids, pos = len(row_of), batch.input_ids[row_of, t], batch.past_len[row_of] + t
            # where each token's logits go: its [B*T] entry, or (one per row) its row's last token
            gather = row_of * width + t if batch.all_logits else starts + num_new - 1
        rows = self.bucket(tokens)
        if self.use_graphs and rows not in self._graphs:
            self._capture(rows)
        if self._staged is not None:  # the last copy out of the pinned buffer must be done first
            self._staged.synchronize()
        staged = self._staging
        staged[:, :rows].zero_()
        staged[0, :tokens] = ids
        staged[1, :tokens] = pos
        if row_of is not None:
            staged[2, :tokens] = row_of
            staged[3, : len(gather)] = gather
        self._indices.copy_(staged, non_blocking=True)
        self._staged = torch.cuda.Event() if self.device.type == "cuda" else None
        if self._staged is not None:
            self._staged.record(torch.cuda.current_stream(self.device))  # this runner's device's stream
        self.inputs[:, :rows].copy_(self._indices[:2, :rows])
        if batch.fed is not None:  # width 1: token b is row b's
            self.inputs[0].index_copy_(0, *batch.fed)
        # columns past max_blocks are zeros: no accepted row has blocks there
        cols = min(batch.block_table.shape[1], self.max_blocks)
        table = batch.block_table[:, :cols]
        if row_of is not None:
            table = table.index_select(0, self._indices[2, :tokens])  # [N, cols]: each token its row's
        self.tables[:tokens, :cols].copy_(table)
        if rows > tokens:
            self.tables[tokens:rows, 0] = 0  # padding rows read and write block 0 (scratch) only
        if self.use_graphs:
            self._graphs[rows].replay()
            logits = self._outputs[rows][:tokens]  # [N, V]
        else:
            logits = self._step(rows)[:tokens]
        if row_of is None:
            return logits.clone().view(bsz, 1, -1) if batch.all_logits else logits.clone()
        index = self._indices[3, : len(gather)]
        if not batch.all_logits:
            return logits.index_select(0, index)  # [B, V]
        out = logits.new_zeros(bsz * width, logits.shape[-1])
        return out.index_copy_(0, index, logits).view(bsz, width, -1)  # [B, T, V]
