"""The Triton kernels against the reference and the paged torch path: uneven widths (1, 13, 37, d_k ≠ d_v), GQA
groups 1, 3, 8, split contexts, contiguous and paged caches (shuffled blocks, NaN in every unused row), sliding
windows, masks as transformers passes them (causal, left-padded, banded, per head; bool and additive), float32,
bfloat16 and float16, balanced == plain. On CUDA when there is one, else in Triton's interpreter."""

import os

import pytest
import torch

from kvfold_runtime import paged_attention, reference_attention, write_paged
from kvfold_runtime.kernels import triton_common, triton_decode, triton_prefill
from tests.conftest import rerun_in_triton_interpreter

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Without a GPU the kernels run in Triton's interpreter. TRITON_INTERPRET=1 must be set before triton is first
# imported (triton's own @jit helpers, tl.cdiv say, are decorated then), and the session imported triton long
# before this module (transformers does, in tests/conftest.py). So without it, test_in_the_interpreter runs this
# module again in a child process started with the variable set, and the kernel tests here are skipped.
NEEDS_CHILD = DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1"
kernels = pytest.mark.skipif(NEEDS_CHILD, reason="no GPU: run in Triton's interpreter by test_in_the_interpreter")
# relative error of rounding float32 to each dtype: to nearest on the GPU (the interpreter truncates to bfloat16)
ROUNDING = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8 if DEVICE == "cuda" else 2.0 ** -7}


@pytest.mark.skipif(not NEEDS_CHILD, reason="the kernel tests run in this process")
def test_in_the_interpreter():
    rerun_in_triton_interpreter(__file__, "-k", "not test_in_the_interpreter")


WIDTHS = {
    "uneven 13/1/6 vs 2/37/9": ([13, 1, 6], [2, 37, 9]),
    "one head 37 vs 1": ([37], [1]),
    "equal 16": ([16, 16], [16, 16]),
}
SCALE = 0.3
F32, BF16 = torch.float32, torch.bfloat16


def _randn(*shape, g, dtype):
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


def _mask(t: int, s: int, window: int | None = None) -> torch.Tensor:
    """[1, 1, t, s]: the t queries are the last of the s positions."""
    q = torch.arange(s - t, s)[:, None]
    k = torch.arange(s)[None, :]
    allowed = k <= q
    if window is not None:
        allowed &= q - k < window
    return allowed[None, None].to(DEVICE)


def _check(got, q, k, v, d_k, d_v, group, mask):
    """float32: within 1e-5 of the reference. bfloat16, float16: within 2e-3 of the float32 reference on the same
    inputs, plus the two roundings the contract itself makes: the softmax weights to the input dtype before they
    meet the values (as reference_attention does) and the output, each within ROUNDING of what it rounds.
    A query head whose mask row allows no key must give exactly 0 (as torch's SDPA; the reference averages the
    values there) and is left out of the comparison."""
    f = [x.float() for x in (q, k, v)]
    want = reference_attention(*f, d_k, d_v, group, scaling=SCALE, mask=mask)
    err = (got.float() - want).abs()
    if mask is not None:
        b, t, s = q.shape[0], q.shape[1], k.shape[1]
        heads = group * len(d_k)
        allowed = (mask[..., :s] != 0) if mask.dtype == torch.bool else (mask[..., :s] > float("-inf"))
        some = allowed.any(-1).expand(b, heads, t)  # [B, H, T]: the query head sees at least one key
        cols = torch.cat([some[:, h, :, None].expand(b, t, d_v[h // group]) for h in range(heads)], -1)
        assert torch.equal(got[~cols].float(), torch.zeros_like(got[~cols].float()))
        err = torch.where(cols, err, 0.0)
    if got.dtype == torch.float32:
        assert err.max() <= 1e-5, float(err.max())
        return
    weighted = reference_attention(f[0], f[1], f[2].abs(), d_k, d_v, group, scaling=SCALE, mask=mask)  # Σ p|v|
    excess = err - (2e-3 + ROUNDING[got.dtype] * (want.abs() + weighted))
    assert excess.max() <= 0, float(err.max())


def _masks(kind: str, b: int, heads: int, t: int, s: int, seed: int = 0, pad: int | None = None) -> torch.Tensor:
    """A bool mask as transformers' generate() passes one (True = attend), with 3 spare key columns (random: only the
    first s are read), t queries being the last of the s positions:
      causal    [1, 1, t, s+3] expanded to b (stride 0 along the batch);
      padded    [b, 1, t, s+3], causal, the last sequence left-padded by `pad` keys (default: 5 queries, if there
                are as many, or else 20 keys stay visible), the queries in the padding seeing nothing;
      window    [b, 1, t, s+3], causal within a sliding window of 9;
      per head  [b, heads, t, s+3], a different random pattern (≈ 40% allowed) for every query head."""
    g = torch.Generator().manual_seed(seed)
    if kind == "per head":
        m = torch.rand(b, heads, t, s, generator=g) < 0.4
    else:
        m = _mask(t, s, window=9 if kind == "window" else None).cpu().expand(b, 1, t, s).clone()
        if kind == "padded":
            m[-1, ..., :min(s - t + 5, s - 20) if pad is None else pad] = False
    m = torch.cat([m, torch.rand(*m.shape[:3], 3, generator=g) < 0.5], -1)
    if kind == "causal":
        m = m[:1].expand(b, *m.shape[1:])
    return m.to(DEVICE)


MASKS = ["causal", "padded", "window", "per head"]


@kernels
@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize(("widths", "group", "splits", "dtype"), [
    ("uneven 13/1/6 vs 2/37/9", 3, 1, F32), ("uneven 13/1/6 vs 2/37/9", 3, 3, BF16), ("one head 37 vs 1", 8, 2, F32)])
def test_decode_with_a_mask_matches_reference(kind, widths, group, splits, dtype):
    """The mask alone decides (no seq_lens, no window): split contexts whose keys are all masked, skipped blocks."""
    d_k, d_v = WIDTHS[widths]
    g = torch.Generator().manual_seed(5)
    b, s = 2, 100
    q = _randn(b, 1, group * sum(d_k), g=g, dtype=dtype)
    k, v = _randn(b, s, sum(d_k), g=g, dtype=dtype), _randn(b, s, sum(d_v), g=g, dtype=dtype)
    mask = _masks(kind, b, group * len(d_k), 1, s)
    got = triton_decode.decode_attention(q, k, v, d_k, d_v, group, scaling=SCALE, num_splits=splits, mask=mask)
    assert got.shape == (b, 1, group * sum(d_v)) and got.dtype == dtype
    _check(got, q, k, v, d_k, d_v, group, mask)
    if kind == "padded" and dtype == F32:  # the same mask as additive float32 (0 / -inf), balanced grid
        additive = torch.zeros(mask.shape, device=DEVICE).masked_fill(~mask, float("-inf"))
        again = triton_decode.decode_attention(q, k, v, d_k, d_v, group, scaling=SCALE, num_splits=splits,
                                               mask=additive, balanced=True, num_programs=3)
        assert (again - got).abs().max() <= 1e-6


@kernels
@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize(("widths", "group", "t", "dtype"), [
    ("uneven 13/1/6 vs 2/37/9", 3, 36, F32), ("uneven 13/1/6 vs 2/37/9", 1, 36, BF16), ("one head 37 vs 1", 8, 5, F32)])
def test_prefill_with_a_mask_matches_reference(kind, widths, group, t, dtype):
    """Left-padded query rows see no key (0 there), no key block is skipped for causality: the mask decides."""
    d_k, d_v = WIDTHS[widths]
    g = torch.Generator().manual_seed(6)
    b, s = 2, 48  # two blocks of queries (t = 36) and of keys
    q = _randn(b, t, group * sum(d_k), g=g, dtype=dtype)
    k, v = _randn(b, s, sum(d_k), g=g, dtype=dtype), _randn(b, s, sum(d_v), g=g, dtype=dtype)
    mask = _masks(kind, b, group * len(d_k), t, s, seed=1)
    got = triton_prefill.prefill_attention(q, k, v, d_k, d_v, group, scaling=SCALE, mask=mask)
    assert got.shape == (b, t, group * sum(d_v)) and got.dtype == dtype
    _check(got, q, k, v, d_k, d_v, group, mask)
    if kind == "per head" and group == 8:  # the same mask as additive bfloat16 (0 / its most negative number)
        additive = torch.zeros(mask.shape, dtype=BF16, device=DEVICE).masked_fill(~mask, torch.finfo(BF16).min)
        again = triton_prefill.prefill_attention(q, k, v, d_k, d_v, group, scaling=SCALE, mask=additive)
        live = mask[..., :s].any(-1).all(1)[..., None].expand_as(got)  # fully masked rows: finite, not compared
        assert (again - got)[live].abs().max() <= 1e-6 and again.isfinite().all()


@kernels
def test_the_dispatch_sends_masks_to_the_kernels(monkeypatch):
    """A left-padded batch through kernels.dispatch.attention: the kernels run and give the torch path's results,
    padding rows (0) included; soft-capped scores (with a mask) still take the torch path, as would a mask the
    kernels do not take (an int mask, say: torch's SDPA refuses it too)."""
    from kvfold_runtime.kernels import dispatch, sdpa_attention

    d_k, d_v, group = [13, 1, 6], [2, 37, 9], 3
    g = torch.Generator().manual_seed(7)
    calls = []
    for name in ("decode_attention", "prefill_attention"):
        module = dispatch._triton()[name == "prefill_attention"]
        real = getattr(module, name)
        monkeypatch.setattr(module, name,
                            lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))
    monkeypatch.setenv("KVFOLD_KERNELS", "triton")
    for t in (12, 1):
        q = _randn(2, t, group * sum(d_k), g=g, dtype=F32)
        k, v = _randn(2, 13, sum(d_k), g=g, dtype=F32), _randn(2, 13, sum(d_v), g=g, dtype=F32)
        mask = _masks("padded", 2, 9, t, 13, pad=6)  # prefill: 5 padding queries
        got = dispatch.attention(q, k, v, d_k, d_v, group, scaling=SCALE, mask=mask)
        want = sdpa_attention(q, k, v, d_k, d_v, group, scaling=SCALE, mask=mask)
        assert (got - want).abs().max() <= 1e-5
        assert calls.pop() == ("decode_attention" if t == 1 else "prefill_attention")
        capped = dispatch.attention(q, k, v, d_k, d_v, group, scaling=SCALE, mask=mask, softcap=5.0)
        assert not calls
        assert torch.equal(capped, sdpa_attention(q, k, v, d_k, d_v, group, scaling=SCALE, mask=mask, softcap=5.0))
        assert not triton_common.supports_mask(mask.to(torch.int32), 2, 9, t, 13, DEVICE)


@kernels
@pytest.mark.parametrize(("widths", "group", "splits", "dtype"), [
    ("uneven 13/1/6 vs 2/37/9", 3, 1, F32), ("uneven 13/1/6 vs 2/37/9", 3, 3, BF16),
    ("uneven 13/1/6 vs 2/37/9", 1, 3, F32), ("one head 37 vs 1", 8, 2, F32), ("one head 37 vs 1", 8, 1, BF16),
    ("equal 16", 3, 4, F32)])
def test_decode_matches_reference(widths, group, splits, dtype):
    d_k, d_v = WIDTHS[widths]
    g = torch.Generator().manual_seed(0)
    b, s = 2, 150
    q = _randn(b, 1, group * sum(d_k), g=g, dtype=dtype)
    k, v = _randn(b, s, sum(d_k), g=g, dtype=dtype), _randn(b, s, sum(d_v), g=g, dtype=dtype)
    got = triton_decode.decode_attention(q, k, v, d_k, d_v, group, scaling=SCALE, num_splits=splits)
    assert got.shape == (b, 1, group * sum(d_v)) and got.dtype == dtype
    _check(got, q, k, v, d_k, d_v, group, None)


@kernels
def test_decode_per_sequence_lengths_and_window():
    d_k, d_v = WIDTHS["uneven 13/1/6 vs 2/37/9"]
    window = 40
    g = torch.Generator().manual_seed(1)
    lens = [150, 7, 66]
    q = _randn(3, 1, 3 * sum(d_k), g=g, dtype=torch.float32)
    k, v = _randn(3, 150, sum(d_k), g=g, dtype=torch.float32), _randn(3, 150, sum(d_v), g=g, dtype=torch.float32)
    k[1, 7:], v[2, 66:] = float("nan"), float("nan")  # past a sequence's end: never read
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    got = triton_decode.decode_attention(q, k, v, d_k, d_v, 3, scaling=SCALE, seq_lens=seq_lens,
                                         sliding_window=window, num_splits=3)
    for i, n in enumerate(lens):
        _check(got[i:i + 1], q[i:i + 1], k[i:i + 1, :n], v[i:i + 1, :n], d_k, d_v, 3, _mask(1, n, window=window))


def _paged(d_k, d_v, group, seq_lens, q_lens, dtype, block_size=16, seed=0):
    """A paged cache (the layout of kvfold_runtime.kernels.paged) holding `seq_lens` tokens per request in
    shuffled blocks, NaN everywhere else, and each request's last `q_lens` tokens as queries. Returns the
    paged inputs and, per request, its contiguous keys, values and queries."""
    g = torch.Generator().manual_seed(seed)
    sk, sv = sum(d_k), sum(d_v)
    per = [(s + block_size - 1) // block_size for s in seq_lens]
    order = torch.randperm(sum(per) + 3, generator=g)[: sum(per)] + 1  # block 0 and a few others stay unused
    kv = torch.full((int(order.max()) + 2, 1, block_size, sk + sv), float("nan"), dtype=dtype, device=DEVICE)
    table = torch.zeros(len(seq_lens), max(per) + 1, dtype=torch.int32)  # a spare column, as vLLM's
    seqs, used = [], 0
    for r, s in enumerate(seq_lens):
        table[r, :per[r]] = order[used:used + per[r]]
        used += per[r]
        k, v = _randn(s, sk, g=g, dtype=dtype), _randn(s, sv, g=g, dtype=dtype)
        pos = torch.arange(s)
        write_paged(kv, (table[r, pos // block_size].long() * block_size + pos % block_size).to(DEVICE), k, v)
        seqs.append((k, v, _randn(q_lens[r], group * sk, g=g, dtype=dtype)))
    start = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    return kv, table.to(DEVICE), lens, start, torch.cat([s[2] for s in seqs]), seqs


@kernels
@pytest.mark.parametrize(("widths", "group", "window", "splits", "dtype"), [
    ("uneven 13/1/6 vs 2/37/9", 3, None, None, F32), ("uneven 13/1/6 vs 2/37/9", 3, 20, 3, F32),
    ("uneven 13/1/6 vs 2/37/9", 3, None, 3, BF16), ("one head 37 vs 1", 8, None, 2, F32),
    ("one head 37 vs 1", 8, 20, 2, BF16), ("equal 16", 1, 50, 2, F32), ("equal 16", 3, None, 2, torch.float16)])
def test_paged_decode_matches_paged_attention(widths, group, window, splits, dtype):
    d_k, d_v = WIDTHS[widths]
    seq_lens = [100, 1, 37, 64]
    kv, table, lens, start, q, seqs = _paged(d_k, d_v, group, seq_lens, [1] * 4, dtype)
    got = triton_decode.paged_decode_attention(q, kv, table, lens, d_k, d_v, group, scaling=SCALE,
                                               sliding_window=window, num_splits=splits)
    assert not got.isnan().any()
    if dtype == torch.float32:
        torch_path = paged_attention(q, kv, table, lens, start, d_k, d_v, group, scaling=SCALE,
                                     sliding_window=window)
        assert (got - torch_path).abs().max() <= 1e-5
    for r, (k, v, qr) in enumerate(seqs):
        _check(got[r:r + 1][None], qr[None], k[None], v[None], d_k, d_v, group,
               _mask(1, seq_lens[r], window=window))


@kernels
@pytest.mark.parametrize("paged", [False, True])
def test_balanced_equals_plain(paged):
    """The persistent, cost-sorted grid (5 programs, several snake rounds) runs the very same tasks: identical bits."""
    d_k, d_v, group = [13, 1, 6], [2, 37, 9], 3
    if paged:
        kv, table, lens, _, q, _ = _paged(d_k, d_v, group, [100, 3, 37], [1] * 3, torch.float32)
        run = lambda **kw: triton_decode.paged_decode_attention(  # noqa: E731
            q, kv, table, lens, d_k, d_v, group, scaling=SCALE, num_splits=3, **kw)
    else:
        g = torch.Generator().manual_seed(2)
        q = _randn(3, 1, group * sum(d_k), g=g, dtype=torch.float32)
        k, v = _randn(3, 90, sum(d_k), g=g, dtype=torch.float32), _randn(3, 90, sum(d_v), g=g, dtype=torch.float32)
        lens = torch.tensor([90, 5, 61], dtype=torch.int32, device=DEVICE)
        run = lambda **kw: triton_decode.decode_attention(  # noqa: E731
            q, k, v, d_k, d_v, group, scaling=SCALE, seq_lens=lens, num_splits=2, **kw)
    plain = run()
    assert torch.equal(run(balanced=True, num_programs=5), plain)


def test_task_order_puts_the_costliest_tasks_first():
    heads = triton_common.head_table([4, 60], [4, 60], DEVICE)  # KV head 1 reads 15× the bytes of head 0
    order = triton_decode._task_order(torch.tensor([10, 300], device=DEVICE), heads, 0, 2).tolist()
    # task id (request·G + head)·splits + split; request 1's 300 keys split in whole 64-key blocks: 192 + 108
    assert order[:2] == [(1 * 2 + 1) * 2 + 0, (1 * 2 + 1) * 2 + 1]
    assert sorted(order) == list(range(8))


@kernels
@pytest.mark.parametrize(("widths", "group", "t", "window", "dtype"), [
    ("uneven 13/1/6 vs 2/37/9", 3, 20, None, F32), ("uneven 13/1/6 vs 2/37/9", 3, 20, None, BF16),
    ("uneven 13/1/6 vs 2/37/9", 1, 70, 9, F32), ("one head 37 vs 1", 8, 5, None, F32),
    ("one head 37 vs 1", 8, 5, 3, BF16)])
def test_prefill_matches_reference(widths, group, t, window, dtype):
    d_k, d_v = WIDTHS[widths]
    g = torch.Generator().manual_seed(3)
    b, s = 2, 70
    q = _randn(b, t, group * sum(d_k), g=g, dtype=dtype)
    k, v = _randn(b, s, sum(d_k), g=g, dtype=dtype), _randn(b, s, sum(d_v), g=g, dtype=dtype)
    got = triton_prefill.prefill_attention(q, k, v, d_k, d_v, group, scaling=SCALE, sliding_window=window)
    assert got.shape == (b, t, group * sum(d_v)) and got.dtype == dtype
    _check(got, q, k, v, d_k, d_v, group, _mask(t, s, window=window))


@kernels
@pytest.mark.parametrize(("widths", "group", "window", "dtype"), [
    ("uneven 13/1/6 vs 2/37/9", 3, 10, F32), ("uneven 13/1/6 vs 2/37/9", 3, None, BF16),
    ("one head 37 vs 1", 8, 30, torch.float16), ("equal 16", 1, None, F32)])
def test_paged_prefill_matches_paged_attention(widths, group, window, dtype):
    """A mixed batch as vLLM schedules it: a decode, a fresh prefill, a chunked prefill against a cached prefix."""
    d_k, d_v = WIDTHS[widths]
    seq_lens, q_lens = [40, 30, 45], [1, 30, 20]
    kv, table, lens, start, q, seqs = _paged(d_k, d_v, group, seq_lens, q_lens, dtype, seed=4)
    got = triton_prefill.paged_prefill_attention(q, kv, table, lens, start, d_k, d_v, group, scaling=SCALE,
                                                 sliding_window=window, max_query_len=30 if dtype != F32 else None)
    assert got.dtype == dtype
    if dtype == F32:
        torch_path = paged_attention(q, kv, table, lens, start, d_k, d_v, group, scaling=SCALE,
                                     sliding_window=window)
        assert (got - torch_path).abs().max() <= 1e-5
    for r, (k, v, qr) in enumerate(seqs):
        _check(got[start[r]:start[r + 1]][None], qr[None], k[None], v[None], d_k, d_v, group,
               _mask(q_lens[r], seq_lens[r], window=window))


def test_wrong_widths_are_refused_with_the_fix():
    q, k, v = torch.zeros(1, 1, 12), torch.zeros(1, 4, 4), torch.zeros(1, 4, 4)
    with pytest.raises(ValueError, match="group"):
        triton_decode.decode_attention(q, k, v, [4], [4], 2, scaling=1.0)
    with pytest.raises(ValueError, match="float16"):
        triton_decode.decode_attention(q.double(), k.double(), v.double(), [6], [4], 2, scaling=1.0)
    with pytest.raises(ValueError, match="positive"):
        triton_prefill.prefill_attention(q[..., :8], k, v, [4, 0], [2, 2], 2, scaling=1.0)
    mask = torch.ones(1, 1, 1, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match="not both"):
        triton_decode.decode_attention(q, k, v, [6], [4], 2, scaling=1.0, mask=mask, sliding_window=2)
    with pytest.raises(ValueError, match="shape"):
        triton_decode.decode_attention(q, k, v, [6], [4], 2, scaling=1.0, mask=mask[..., :3])
    with pytest.raises(ValueError, match="int64"):
        triton_prefill.prefill_attention(q, k, v, [6], [4], 2, scaling=1.0, mask=mask.long())


def test_default_splits_fill_the_device_with_long_enough_splits():
    split = triton_decode.default_splits
    assert split(1, tasks=1, programs=528) == 1
    assert split(4096, tasks=8, programs=528, keys_per_split=512) == 8  # by length
    assert split(10**7, tasks=1, programs=528) == triton_decode.MAX_SPLITS
    assert split(10**5, tasks=132, programs=528) == 4  # by occupancy
    assert split(10**5, tasks=4096, programs=528) == 1  # a large batch fills the device by itself


@kernels
@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM"])
def test_an_export_served_through_the_dispatch_runs_the_kernels_and_matches_the_torch_path(tiny_exports, arch,
                                                                                           monkeypatch):
    """kvfold_runtime's transformers attention calls kernels.dispatch: with KVFOLD_KERNELS=triton the whole
    model (prefill, then decode steps over the DynamicCache) runs the Triton kernels — on CUDA, or here in
    the interpreter — and gives the torch path's logits and greedy tokens (uneven widths, float32)."""
    from transformers import AutoModelForCausalLM

    from kvfold_runtime.kernels import dispatch

    model = AutoModelForCausalLM.from_pretrained(tiny_exports[arch, "uneven"].path, dtype=torch.float32).eval()
    model = model.to(DEVICE)
    ids = (torch.arange(24, device=DEVICE)[None] * 7) % 200
    calls = []
    for name in ("decode_attention", "prefill_attention"):
        real = getattr(dispatch._triton()[name == "prefill_attention"], name)
        monkeypatch.setattr(dispatch._triton()[name == "prefill_attention"], name,
                            lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))
    results = {}
    for mode in ("torch", "triton"):
        monkeypatch.setenv("KVFOLD_KERNELS", mode)
        with torch.inference_mode():
            logits = model(input_ids=ids).logits
            tokens = model.generate(ids[:, :8], max_new_tokens=4, do_sample=False, pad_token_id=0)
        results[mode] = logits, tokens
    assert {"decode_attention", "prefill_attention"} <= set(calls)
    assert (results["triton"][0] - results["torch"][0]).abs().max() < 1e-4
    assert torch.equal(results["triton"][1], results["torch"][1])


def test_the_dispatch_keeps_the_torch_path_where_the_kernels_do_not_apply(monkeypatch):
    from kvfold_runtime.kernels.dispatch import kernels_for

    x = torch.zeros(2, 3)
    monkeypatch.setenv("KVFOLD_KERNELS", "auto")
    assert kernels_for(x) == "torch"  # a CPU tensor
    monkeypatch.setenv("KVFOLD_KERNELS", "triton")
    assert kernels_for(x.double()) == "torch"  # float64: the kernels take 16/32-bit floats
    monkeypatch.setenv("KVFOLD_KERNELS", "fast")
    with pytest.raises(ValueError, match="use auto, torch or triton"):
        kernels_for(x)
