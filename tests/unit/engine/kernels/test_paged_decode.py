"""tritonlm/engine/kernels/paged_decode.py: the Triton paged-decode kernel, run by Triton's
interpreter on CPU tensors, against attention computed in float64 with plain torch through
the block tables (with a sliding window, logit soft-capping and attention sinks too); its
guarantee never to read past a row's length, nor before its window; its refusals of bad
inputs; and `available`."""

from __future__ import annotations

import math
import re
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")
# the interpreter turns its one-element arrays into Python ints (loop bounds), which numpy deprecates
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

from tritonlm.engine.kernels.paged_decode import available, paged_decode_attention  # noqa: E402

TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    # half inputs: the probabilities enter the P @ V product in the input dtype, and the
    # output is rounded to it
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


@pytest.fixture
def interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton's interpreter for this test: the kernels are built lazily, keyed by this flag."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def make_case(
    seed: int,
    lens: list[int],
    heads: int,
    kv_heads: int,
    dim: int,
    block_size: int,
    dtype: torch.dtype,
    poison: float = float("nan"),
    cache_dtype: torch.dtype | None = None,
) -> dict:
    """A pool whose blocks are handed to the rows shuffled (block 0, the scratch block, among
    them), with spare blocks. Every slot no row may read (tails of last blocks, spare blocks)
    holds `poison`, and table entries past a row's blocks point at poisoned spare blocks."""
    g = torch.Generator().manual_seed(seed)
    bsz = len(lens)
    need = [math.ceil(n / block_size) for n in lens]
    spare = 3
    num_blocks = sum(need) + spare
    width = max(need) + 2
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.empty((bsz, width), dtype=torch.int32)
    slots_of = []
    at = 0
    spares = perm[sum(need) :]
    for b, n in enumerate(lens):
        mine = perm[at : at + need[b]]
        at += need[b]
        pad = spares[torch.randint(0, spare, (width - need[b],), generator=g)]
        table[b] = torch.cat([mine, pad])
        pos = torch.arange(n)
        slots_of.append(table[b, pos // block_size].long() * block_size + pos % block_size)
    slots = num_blocks * block_size
    cdt = cache_dtype or dtype
    k_cache = torch.full((slots, kv_heads, dim), poison, dtype=cdt)
    v_cache = torch.full((slots, kv_heads, dim), poison, dtype=cdt)
    for s in slots_of:
        k_cache[s] = torch.randn((len(s), kv_heads, dim), generator=g).to(cdt)
        v_cache[s] = torch.randn((len(s), kv_heads, dim), generator=g).to(cdt)
    q = torch.randn((bsz, heads, dim), generator=g).to(dtype)
    return dict(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        block_table=table,
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_size=block_size,
        scale=dim**-0.5,
        slots_of=slots_of,
    )


def reference(case: dict, window: int = 0, softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's keys gathered through its block table, softmax and weighted sum in float64
    ([B, H, D]); as transformers computes them: the scores soft-capped (Gemma 2: c tanh(s / c)),
    the keys outside the window (j <= p - window, p the row's last position) masked, the
    sink logits appended to each softmax and their probabilities dropped (gpt-oss)."""
    q = case["q"].double()
    bsz, heads, dim = q.shape
    group = heads // case["k_cache"].shape[1]
    out = torch.zeros((bsz, heads, dim), dtype=torch.float64)
    for b, slots in enumerate(case["slots_of"]):
        if len(slots) == 0:
            continue
        keys = case["k_cache"][slots].double().repeat_interleave(group, dim=1)  # [L, H, D]
        values = case["v_cache"][slots].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[b], keys) * case["scale"]  # [H, L]
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        if window:
            j = torch.arange(len(slots))
            scores = scores.masked_fill(j <= len(slots) - 1 - window, float("-inf"))
        if sinks is not None:
            probs = torch.cat([scores, sinks.double()[:, None]], dim=-1).softmax(-1)[:, :-1]
        else:
            probs = scores.softmax(-1)
        out[b] = torch.einsum("hl,lhd->hd", probs, values.nan_to_num())  # masked keys' values weigh 0
    return out


def run(case: dict, **kw) -> torch.Tensor:
    args = {k: v for k, v in case.items() if k != "slots_of"}
    return paged_decode_attention(**args, **kw)


@pytest.mark.parametrize(
    "dtype, heads, kv_heads, dim, block_size, splits",
    [
        (torch.float32, 2, 2, 64, 16, 1),
        (torch.float32, 6, 2, 64, 16, 4),
        (torch.float32, 4, 1, 80, 8, 1),
        (torch.float32, 6, 2, 32, 16, 2),
        (torch.float32, 8, 2, 80, 16, 8),
        (torch.bfloat16, 6, 2, 64, 16, 1),
        (torch.bfloat16, 6, 2, 64, 16, 4),
        (torch.bfloat16, 4, 1, 32, 8, 2),
        (torch.float16, 4, 1, 80, 8, 2),
        (torch.float16, 2, 2, 64, 16, 1),
    ],
    ids=[
        "f32-mha-d64",
        "f32-g3-d64-split4",
        "f32-g4-d80-bs8",
        "f32-g3-d32-split2",
        "f32-g4-d80-split8",
        "bf16-g3-d64",
        "bf16-g3-d64-split4",
        "bf16-g4-d32-bs8-split2",
        "f16-g4-d80-bs8-split2",
        "f16-mha-d64",
    ],
)
def test_kernel_matches_float64_reference(interpret, dtype, heads, kv_heads, dim, block_size, splits):
    """Rows of mixed lengths (1 key up to ~300, ending mid-block and on a block boundary) on
    shuffled blocks, GQA groups 1, 3 and 4, head_dim 64, 32 and 80, with and without split-K:
    the float64 reference, in q's dtype, and finite although every slot no row may read is NaN."""
    lens = [1, 300, 17, 2 * block_size, 129]
    case = make_case(heads * 1000 + dim + splits, lens, heads, kv_heads, dim, block_size, dtype)
    got = run(case, num_splits=splits)
    assert got.dtype == dtype and got.shape == case["q"].shape
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), reference(case), **TOL[dtype])


OPTIONS = {
    "window-1": dict(window=1),
    "window-of-a-block": dict(window=16),
    "window-across-blocks": dict(window=21),
    "window-past-the-context": dict(window=1000),
    "softcap": dict(softcap=2.0),
    "sinks": dict(sinks=True),
    "all-three": dict(window=21, softcap=2.0, sinks=True),
}


def options_for(case: dict, options: dict, seed: int) -> dict:
    """The options with sinks=True made a logit per query head (around the scores' size,
    so they take a visible share of each softmax)."""
    if options.get("sinks") is True:
        heads = case["q"].shape[1]
        sinks = torch.randn(heads, generator=torch.Generator().manual_seed(seed)) * 2
        options = {**options, "sinks": sinks.to(case["q"].dtype)}
    return options


@pytest.mark.parametrize("options", list(OPTIONS.values()), ids=list(OPTIONS))
@pytest.mark.parametrize("splits", [1, 4])
def test_attention_options_match_float64_reference(interpret, options, splits):
    """A sliding window (1 key, a block's worth, one across block boundaries, one longer
    than every row), soft-capping, sinks and all three together, with and without split-K,
    on rows of 0 to 300 keys: the float64 reference's transformers semantics, and an answer
    that differs from plain attention where the option changes anything."""
    lens = [1, 300, 17, 32, 0, 70]
    case = make_case(53 + splits, lens, 6, 2, 64, 16, torch.float32)
    kw = options_for(case, options, 59)
    got = run(case, num_splits=splits, **kw)
    assert torch.isfinite(got).all()
    want = reference(case, **kw)
    torch.testing.assert_close(got.double(), want, **TOL[torch.float32])
    assert torch.equal(got[4], torch.zeros_like(got[4]))  # a row without keys stays zeros, sinks or not
    if options.get("window", 0) < 300:
        assert (want - reference(case)).abs().max() > 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_attention_options_in_half_precision(interpret, dtype):
    """All three options with half inputs (the sinks in q's dtype), GQA group 4, split-K."""
    case = make_case(61, [5, 150, 33], 8, 2, 32, 8, dtype)
    kw = options_for(case, dict(window=21, softcap=2.0, sinks=True), 67)
    got = run(case, num_splits=2, **kw)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), reference(case, **kw), **TOL[dtype])


@pytest.mark.parametrize("splits", [1, 4])
def test_keys_before_the_window_are_never_read(interpret, splits):
    """Every key and value before each row's window poisoned with NaN: the output is finite
    and the reference over the window alone (the window's first key mid-block, and at a
    block's start)."""
    lens, window = [40, 100, 16, 3], 24  # first keys 16, 76, 0, 0
    case = make_case(71, lens, 4, 2, 64, 16, torch.float32)
    for slots in case["slots_of"]:
        before = slots[: max(0, len(slots) - window)]
        case["k_cache"][before] = float("nan")
        case["v_cache"][before] = float("nan")
    got = run(case, num_splits=splits, window=window)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), reference(case, window=window), **TOL[torch.float32])


@pytest.mark.parametrize("splits", [1, 4])
def test_out_is_written_in_place(interpret, splits):
    """out=: the same tensor comes back, every element overwritten (it starts as NaN)."""
    case = make_case(7, [5, 40, 33], 6, 2, 64, 16, torch.float32)
    out = torch.full_like(case["q"], float("nan"))
    got = run(case, out=out, num_splits=splits)
    assert got is out
    torch.testing.assert_close(out.double(), reference(case), **TOL[torch.float32])


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), 1e30], ids=["nan", "inf", "huge"])
@pytest.mark.parametrize("splits", [1, 8])
def test_rows_never_read_past_their_length(interpret, poison, splits):
    """Every slot outside a row's first seq_len positions (the tail of its last block, the
    spare blocks its table's unused entries point at) holds NaN, inf or 1e30: the output is
    finite and equal to the reference. Short rows and 8 splits leave splits without keys."""
    case = make_case(11, [1, 15, 16, 17, 70], 4, 2, 64, 16, torch.float32, poison=poison)
    got = run(case, num_splits=splits)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), reference(case), **TOL[torch.float32])


@pytest.mark.parametrize("splits", [1, 4])
def test_row_without_keys_gives_zeros(interpret, splits):
    """seq_len 0 (a padding row) gives zeros, not 0 / 0, and does not disturb the others."""
    case = make_case(13, [0, 20], 3, 3, 32, 16, torch.float32)
    got = run(case, num_splits=splits)
    assert torch.equal(got[0], torch.zeros_like(got[0]))
    torch.testing.assert_close(got.double(), reference(case), **TOL[torch.float32])


def test_default_splits_and_int64_indices(interpret):
    """num_splits left to the wrapper (1 off CUDA), int64 block table and lengths."""
    case = make_case(17, [3, 90], 6, 2, 64, 16, torch.float32)
    case["block_table"] = case["block_table"].long()
    case["seq_lens"] = case["seq_lens"].long()
    torch.testing.assert_close(run(case).double(), reference(case), **TOL[torch.float32])


def test_cache_of_another_dtype_is_read_as_q_dtype(interpret):
    """A bfloat16 pool under float32 queries: the keys and values are read as float32 (what
    the gather path's .to(q.dtype) does), so the reference over the same rounded values holds."""
    case = make_case(19, [10, 77], 4, 2, 64, 16, torch.float32, cache_dtype=torch.bfloat16)
    torch.testing.assert_close(run(case, num_splits=2).double(), reference(case), **TOL[torch.float32])


@pytest.mark.parametrize("splits", [None, 1, 4])
def test_host_side_reads_no_tensor_values(interpret, splits):
    """A CUDA graph replays the launches it captured, so their grid and arguments must not
    depend on tensor values: the wrapper's checks and launch planning run under a dispatch
    mode that fails on a read of a value to the host (.item(), int(), bool(), max() over a tensor)."""
    from tests.helpers.dispatch import NoValueReads
    from tritonlm.engine.kernels.paged_decode import _check, _launches

    case = make_case(31, [3, 50], 6, 2, 64, 16, torch.float32)
    args = {k: v for k, v in case.items() if k != "slots_of"}
    out = torch.empty_like(case["q"])
    with NoValueReads():
        _check(*(args[k] for k in ("q", "k_cache", "v_cache", "block_table", "seq_lens", "block_size")), out)
        launches = _launches(**args, out=out, num_splits=splits, block_n=None, num_warps=None)
    for kernel, grid, values, consts in launches:
        kernel[grid](*values, **consts)
    torch.testing.assert_close(out.double(), reference(case), **TOL[torch.float32])


def test_bad_inputs_are_refused_on_the_host():
    """Shapes, dtypes and contiguity are checked before any launch (no interpreter needed)."""
    case = make_case(23, [4, 9], 4, 2, 32, 16, torch.float32)

    def refused(match: str, **changes) -> None:
        with pytest.raises(ValueError, match=match):
            run({**case, **changes})

    q = case["q"]
    refused("contiguous", q=q.transpose(0, 1).contiguous().transpose(0, 1))
    refused("contiguous", out=torch.empty(q.shape[::-1]).permute(2, 1, 0))
    refused(r"q must be \[B, H, D\]", q=q[:, :, None])
    refused("float32, float16 or bfloat16", q=q.double())
    refused("multiple of kv heads", q=torch.randn(2, 3, 32))
    refused("head_dim differs", q=torch.randn(2, 4, 16))
    refused("share a float dtype", v_cache=case["v_cache"].half())
    refused("block_table", block_table=case["block_table"].float())
    refused("block_table", block_table=case["block_table"][:1])
    refused("seq_lens", seq_lens=case["seq_lens"][:1])
    refused("block_size", block_size=7)
    refused("out must be", out=torch.empty_like(q).half())
    refused("window must be an int >= 0", window=-1)
    refused("window must be an int >= 0", window=2.5)
    refused("softcap must be a finite number >= 0", softcap=-1.0)
    refused("softcap must be a finite number >= 0", softcap=float("nan"))
    refused(r"sinks must be \[H=4\]", sinks=torch.zeros(3))
    refused(r"sinks must be \[H=4\]", sinks=torch.zeros(4, dtype=torch.int32))
    refused("sinks must be contiguous", sinks=torch.zeros(8)[::2])


def test_module_imports_without_triton():
    """Importing the module does not import triton (CPU-only installs lack it)."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import tritonlm.engine.kernels.paged_decode as m\n"
        "assert m.available('cuda')[0] is False\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ---------------------------------------------------------------------------- on a GPU, where there is one

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def on_cuda(case: dict) -> dict:
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in case.items()}


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("splits", [None, 1, 8], ids=["default-splits", "split1", "split8"])
def test_cuda_kernel_matches_float64_reference(monkeypatch, dtype, splits):
    """The compiled kernel on the GPU (SmolLM2-135M's heads: 9 over 3 kv heads, D 64, and
    MHA at D 80), rows of 1 to 1000 keys, every slot no row may read poisoned with NaN."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for heads, kv_heads, dim in ((9, 3, 64), (4, 4, 80)):
        case = make_case(37 + dim, [1, 300, 17, 32, 129, 1000], heads, kv_heads, dim, 16, dtype)
        got = run(on_cuda(case), num_splits=splits).cpu()
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), reference(case), **TOL[dtype])


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("splits", [1, 8], ids=["split1", "split8"])
def test_cuda_kernel_attention_options(monkeypatch, dtype, splits):
    """The compiled kernel with a sliding window, soft-capping and sinks, each alone and
    together, against the float64 reference (keys before the window poisoned with NaN)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for name, options in OPTIONS.items():
        case = make_case(79, [1, 300, 17, 32, 129, 1000], 9, 3, 64, 16, dtype)
        kw = options_for(case, options, 83)
        window = kw.get("window", 0)
        for slots in case["slots_of"] if window else []:
            before = slots[: max(0, len(slots) - window)]
            case["k_cache"][before] = float("nan")
            case["v_cache"][before] = float("nan")
        dev_kw = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
        got = run(on_cuda(case), num_splits=splits, **dev_kw).cpu()
        assert torch.isfinite(got).all(), name
        torch.testing.assert_close(got.double(), reference(case, **kw), **TOL[dtype], msg=name)


@needs_cuda
def test_cuda_graph_replays_with_new_lengths_and_tables(monkeypatch):
    """A call captured in a CUDA graph, replayed after the lengths and the block table were
    rewritten in place, attends over the new keys: nothing in the call was fixed by values."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    case = make_case(41, [300, 200, 129, 64], 9, 3, 64, 16, torch.bfloat16)
    dev = on_cuda(case)
    out = torch.empty_like(dev["q"])
    args = {k: v for k, v in dev.items() if k != "slots_of"}
    for _ in range(2):  # compiles before the capture
        paged_decode_attention(**args, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(**args, out=out)
    # shorter rows, and rows 0 and 1 swap their block lists
    lens = [1, 150, 17, 64]
    table = case["block_table"].clone()
    table[[0, 1]] = table[[1, 0]]
    bs = case["block_size"]
    slots_of = [table[b, torch.arange(n) // bs].long() * bs + torch.arange(n) % bs for b, n in enumerate(lens)]
    dev["seq_lens"].copy_(torch.tensor(lens, dtype=torch.int32))
    dev["block_table"].copy_(table)
    graph.replay()
    torch.cuda.synchronize()
    expected = reference({**case, "slots_of": slots_of})
    torch.testing.assert_close(out.cpu().double(), expected, **TOL[torch.bfloat16])


# ---------------------------------------------------------------------------- compiled for a GPU, here

@pytest.mark.parametrize(
    "dtype, heads, kv_heads, dim, splits, options",
    [(torch.bfloat16, 9, 3, 64, 4, {}), (torch.float32, 8, 2, 80, 1, {}), (torch.float16, 4, 4, 128, 2, {}),
     (torch.bfloat16, 8, 2, 64, 2, dict(window=21, softcap=2.0, sinks=True)),
     (torch.float32, 8, 2, 64, 1, dict(window=21, softcap=2.0, sinks=True))],
    ids=["bf16-g3-d64-split4", "f32-g4-d80", "f16-mha-d128-split2", "bf16-options-split2", "f32-options"],
)
def test_launches_compile_for_hopper(monkeypatch, tmp_path, dtype, heads, kv_heads, dim, splits, options):
    """The interpreter does not run the GPU compiler, so each launch of a call is compiled
    here for sm_90 (the H200) as the JIT would on a GPU: same constexprs, pointers and
    strides divisible by 16 marked so. Half types multiply on tensor cores (mma); float32
    stays off tf32 (the engine compares against a float32 reference)."""
    from tests.helpers.triton_compile import compile_for_hopper, skip_unless_compilable
    from tritonlm.engine.kernels.paged_decode import _launches

    skip_unless_compilable()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the compiled-mode kernels
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    case = make_case(29, [5, 70], heads, kv_heads, dim, 16, dtype)
    args = {k: v for k, v in case.items() if k != "slots_of"}
    launches = _launches(**args, out=torch.empty_like(case["q"]), num_splits=splits, block_n=None, num_warps=None,
                         **options_for(case, options, 73))
    assert len(launches) == (2 if splits > 1 else 1)
    for kernel, _grid, values, consts in launches:
        ptx = compile_for_hopper(kernel, values, consts)
        if kernel.__name__ == "decode_kernel":
            if dtype == torch.float32:
                assert "tf32" not in ptx
            else:
                half = "bf16" if dtype == torch.bfloat16 else "f16"  # PTX's names
                assert re.search(rf"mma[.\w]*\.{half}\.{half}", ptx)  # mma.sync or Hopper's wgmma
