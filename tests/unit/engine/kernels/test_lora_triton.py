"""tritonlm/engine/kernels/lora_triton.py: the Triton LoRA kernels (shrink, expand), run by
Triton's interpreter on CPU tensors, against each row's update computed in float64 with plain
torch: a mixed batch of base rows and adapters of ranks 4, 8, 16 and 64 in one launch; base
rows left bitwise as they were; refusals of bad inputs; and, forced through
lora.apply.LoraLinear, a tiny model's logits against the torch path's and PEFT's merged models'."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")
# the interpreter turns its one-element arrays into Python ints (loop bounds), which numpy deprecates
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

from tritonlm.engine.kernels.lora_triton import LoraPack, available, lora_apply, pack_deltas  # noqa: E402

RANKS = [4, 8, 16, 64]
IN, OUT = 37, 53  # multiples of no block size: every loop ends on a masked block
# each row's slot, in no order: -1 base rows, 4 a slot without an update of this projection
SLOTS = [2, -1, 0, 3, 1, -1, 3, 0, 4, 2, -1, 1]


@pytest.fixture
def interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton's interpreter for this test: the kernels are built lazily, keyed by this flag."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def make_case(seed: int, dtype: torch.dtype = torch.float32) -> dict:
    """Adapters of RANKS (and a fifth slot of rank 0), rows x and y under SLOTS."""
    g = torch.Generator().manual_seed(seed)
    deltas = [(torch.randn(IN, r, generator=g) / IN**0.5, torch.randn(r, OUT, generator=g) / r**0.5) for r in RANKS]
    rows = len(SLOTS)
    return dict(
        deltas=[*deltas, None],
        x=torch.randn(rows, IN, generator=g).to(dtype),
        y=torch.randn(rows, OUT, generator=g).to(dtype),
        slots=torch.tensor(SLOTS, dtype=torch.int32),
    )


def reference(case: dict) -> torch.Tensor:  # [M, OUT] float64
    """y + (x @ a) @ b per row in float64, from the rounded inputs."""
    want = case["y"].double().clone()
    for m, s in enumerate(case["slots"].tolist()):
        if s >= 0 and case["deltas"][s] is not None:
            a, b = case["deltas"][s]
            want[m] += (case["x"][m].double() @ a.double()) @ b.double()
    return want


def run(case: dict, **tuning) -> torch.Tensor:
    pack = pack_deltas(case["deltas"], IN, OUT, "cpu")
    return lora_apply(case["y"], case["x"], case["slots"], pack, **tuning)


@pytest.mark.parametrize("tuning", [{}, dict(block_k=16, block_r=16, block_n=16), dict(block_r=32, block_n=64)],
                         ids=["defaults", "small-blocks", "mixed"])
def test_mixed_batch_matches_float64(interpret, tuning):
    """Base rows and rows of adapters of ranks 4, 8, 16 and 64 in one launch, rows in no order;
    small blocks make rank 64 take several rank blocks and the inputs several steps."""
    case = make_case(1)
    y = case["y"]
    want = reference(case)
    got = run(case, **tuning)
    assert got is y  # in place
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    # every adapter row changed: an update dropped or sent to another row would show
    changed = (got.double() - make_case(1)["y"].double()).abs().amax(1)
    for m, s in enumerate(SLOTS):
        assert (changed[m] > 1e-2) == (0 <= s < len(RANKS)), (m, s)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_half_rows(interpret, dtype):
    """Half x and y (the float32 updates accumulated in float32, added in y's dtype)."""
    case = make_case(2, dtype)
    want = reference(case)
    got = run(case)
    assert got.dtype == dtype
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


def test_base_rows_are_left_bitwise(interpret):
    """Base rows and rows of a slot without an update hold NaN in x and odd bit patterns in y:
    they come back bit for bit, and the adapter rows still match the reference."""
    case = make_case(3)
    untouched = [m for m, s in enumerate(SLOTS) if s < 0 or s == len(RANKS)]
    case["x"][untouched] = float("nan")
    case["y"][untouched] = torch.tensor([-0.0, float("nan"), float("inf"), 1e-45]).repeat(OUT)[:OUT]
    before = case["y"].clone()
    want = reference(case)
    got = run(case)
    assert torch.equal(got[untouched].view(torch.int32), before[untouched].view(torch.int32))
    used = [m for m in range(len(SLOTS)) if m not in untouched]
    torch.testing.assert_close(got[used].double(), want[used], atol=1e-5, rtol=1e-5)


def test_no_adapter_rows_or_no_updates_launch_nothing(interpret):
    """Zero rows, or a pack without any update: y is returned as it was."""
    case = make_case(4)
    empty = pack_deltas([None, None], IN, OUT, "cpu")
    y = case["y"].clone()
    assert torch.equal(lora_apply(y, case["x"], case["slots"], empty), case["y"])
    pack = pack_deltas(case["deltas"], IN, OUT, "cpu")
    none = torch.empty(0, OUT)
    assert lora_apply(none, torch.empty(0, IN), torch.empty(0, dtype=torch.int32), pack) is none


def test_host_side_reads_no_tensor_values(interpret):
    """The checks and launch planning read no tensor value on the host (no .item(), int(),
    bool() of a tensor), so the launches could be captured in a CUDA graph."""
    from tests.helpers.dispatch import NoValueReads
    from tritonlm.engine.kernels.lora_triton import _check, _launches

    case = make_case(5)
    pack = pack_deltas(case["deltas"], IN, OUT, "cpu")
    with NoValueReads():
        _check(case["y"], case["x"], case["slots"], pack)
        launches = _launches(case["y"], case["x"], case["slots"], pack, None, None, None, None)
    for kernel, grid, values, consts in launches:
        kernel[grid](*values, **consts)
    torch.testing.assert_close(case["y"].double(), reference(make_case(5)), atol=1e-5, rtol=1e-5)


def test_bad_inputs_are_refused_on_the_host():
    """Shapes, dtypes, devices' agreement and contiguity are checked before any launch (no
    interpreter needed), each error naming the input."""
    case = make_case(6)
    pack = pack_deltas(case["deltas"], IN, OUT, "cpu")
    x, y, slots = case["x"], case["y"], case["slots"]

    def refused(match: str, **changes) -> None:
        args = {**dict(y=y, x=x, slots=slots, pack=pack), **changes}
        with pytest.raises(ValueError, match=match):
            lora_apply(args["y"], args["x"], args["slots"], args["pack"])

    refused(r"x must be \[M, K=37\]", x=x[:, :-1].contiguous())
    refused(r"y must be \[M=12, N=53\]", y=y[:-1])
    refused("float32, float16 or bfloat16", x=x.double())
    refused(r"slots must be \[M=12\] int32", slots=slots.long())
    refused(r"slots must be \[M=12\] int32", slots=slots[:-1])
    refused("x must be contiguous", x=torch.randn(IN, len(SLOTS)).t())
    refused("y must be contiguous", y=torch.randn(OUT, len(SLOTS)).t())
    refused("pack.a_all must be a flat float32", pack=LoraPack(**{**vars(pack), "a_all": pack.a_all.double()}))
    refused(r"pack.ranks must be \[S=5\]", pack=LoraPack(**{**vars(pack), "ranks": pack.ranks.long()}))
    refused(r"pack.b_offsets must be \[S=5\]", pack=LoraPack(**{**vars(pack), "b_offsets": pack.b_offsets[:2]}))
    with pytest.raises(ValueError, match=r"deltas\[1\] must be a \[K=37, R\] and b \[R, N=53\]"):
        pack_deltas([case["deltas"][0], (case["deltas"][1][0], case["deltas"][2][1])], IN, OUT, "cpu")
    with pytest.raises(ValueError, match=r"deltas\[0\] must be float32"):
        pack_deltas([(case["deltas"][0][0].half(), case["deltas"][0][1])], IN, OUT, "cpu")
    with pytest.raises(ValueError, match="block_r must be a power of two >= 16"):
        lora_apply(y, x, slots, pack, block_r=24)


def test_module_imports_without_triton():
    """Importing the module (and lora.apply, which imports it) does not import triton."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import tritonlm.engine.kernels.lora_triton as m\n"
        "import tritonlm.engine.lora.apply\n"
        "assert m.available('cuda')[0] is False\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_lora_linear_on_the_triton_path_matches_torch_and_peft(interpret, monkeypatch, tmp_path):
    """One mixed prefill step of tiny_llama (base rows and rows of adapters of ranks 4, 8 and
    16) with lora.apply's Triton path forced on CPU tensors: every logit within 1e-4 of the
    torch path's and of each row's PEFT merged model's (transformers' forward)."""
    pytest.importorskip("peft")
    from tests.helpers.lora import ADAPTERS, lora_rows, make_adapter
    from tests.helpers.models import assert_close, hf_logits, paged_cache, random_tokens, tiny_llama
    from tritonlm.engine.lora import apply, attach_lora, load_adapter
    from tritonlm.engine.runners.torch_runner import TorchRunner

    model = tiny_llama()
    names = [None, "all4", "rs8", None, "regex16"]
    made = {n: (tmp_path / n, make_adapter(model, tmp_path / n, seed=i, **ADAPTERS[n]))
            for i, n in enumerate(names) if n is not None}
    runner = TorchRunner(model, attention="gather")  # no C++ ops: the torch loop is the default path
    attach_lora(runner.transformer)
    adapters = {n: load_adapter(folder, runner.transformer, n) for n, (folder, _) in made.items()}
    row_adapters = [None if n is None else adapters[n] for n in names]
    seqs = [random_tokens(n, seed=40 + i) for i, n in enumerate([5, 7, 3, 6, 4])]

    def logits() -> torch.Tensor:
        mgr = paged_cache(runner, blocks=30)
        for sid, seq in enumerate(seqs):
            mgr.allocate(sid, len(seq))
        return lora_rows(runner, mgr, [(sid, 0, seq) for sid, seq in enumerate(seqs)], row_adapters,
                         all_logits=True)

    torch_path = logits()
    calls = []
    monkeypatch.setattr(apply.lora_triton, "lora_apply",
                        lambda *a, _f=apply.lora_triton.lora_apply, **k: calls.append(1) or _f(*a, **k))
    monkeypatch.setattr(apply, "TRITON_ON_CPU", True)
    triton_path = logits()
    assert calls  # the kernels ran
    for sid, (name, seq) in enumerate(zip(names, seqs)):
        assert_close(triton_path[sid, : len(seq)], torch_path[sid, : len(seq)])
        assert_close(triton_path[sid, : len(seq)], hf_logits(model if name is None else made[name][1], seq))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_launches_compile_for_hopper(monkeypatch, tmp_path, dtype):
    """The interpreter does not run the GPU compiler, so both launches of a call are compiled
    here for sm_90 as the JIT would on a GPU (early exits, rank-bounded loops, int64
    offsets); the expand kernel's PTX rounds its float32 sum to y's dtype when y is bfloat16."""
    from tests.helpers.triton_compile import compile_for_hopper, skip_unless_compilable
    from tritonlm.engine.kernels.lora_triton import _launches

    skip_unless_compilable()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the compiled-mode kernels
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    case = make_case(8, dtype)
    pack = pack_deltas(case["deltas"], IN, OUT, "cpu")
    launches = _launches(case["y"], case["x"], case["slots"], pack, None, None, None, None)
    assert [kernel.__name__ for kernel, *_ in launches] == ["shrink_kernel", "expand_kernel"]
    for kernel, _grid, values, consts in launches:
        ptx = compile_for_hopper(kernel, values, consts)
        assert f".entry {kernel.__name__}" in ptx
        if kernel.__name__ == "expand_kernel" and dtype == torch.bfloat16:
            assert re.search(r"cvt\.rn\.bf16(x2)?\.f32", ptx)
