"""The CPU element-wise kernels (workers/cpu_ops.c) against the torch references they replace: RMSNorm (+ residual
add), SiLU-and-mul, q/k norm + rope + KV write, the greedy argmax; eager calls, the registered ops, and a captured
tape's replay."""
from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from workers import cpu_ops, tape_graph
from workers.kv_cache import write_kv
from workers.models.llama import RMSNorm
from workers.models.llama import RotaryEmbedding

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def two_threads():
    assert cpu_ops.available(), "the CPU ops kernel did not build (needs a C compiler)"
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _wide(rows: int, cols: int, dtype, gen, scale=1.0) -> torch.Tensor:
    """A [rows, cols] view with a row stride past cols (as a slice of a projection's output)."""
    return (torch.randn(rows, cols + 7, generator=gen) * scale).to(dtype)[:, 3:cols + 3]


def assert_as_rounded(out: torch.Tensor, expected: torch.Tensor) -> None:
    """fp32: within 1e-6 relative (the sum of squares' order, exp's last bit). bf16: the reference's rounding,
    different only where an fp32 value that differs in its last bit lies on a rounding boundary (rare), and then
    by at most two bf16 steps (RMSNorm's normalised row one step off, then its product with the weight rounded)."""
    assert out.dtype == expected.dtype and out.shape == expected.shape
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
        return
    steps = (out.view(torch.int16).int() - expected.view(torch.int16).int()).abs()   # same sign: bf16 steps apart
    assert steps.max() <= 2 and (steps > 0).float().mean() < 1e-3


def _norm(D: int, dtype, gen) -> RMSNorm:
    norm = RMSNorm(D, 1e-6)
    norm.weight.data = (1 + 0.1 * torch.randn(D, generator=gen)).to(dtype)
    return norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,D", [(1, 65), (3, 127), (33, 128), (32, 1024), (300, 1024)])   # last: threaded
def test_rms_norm_matches(dtype, rows, D):
    gen = _gen()
    norm, x = _norm(D, dtype, gen), _wide(rows, D, dtype, gen, scale=3.0)
    assert_as_rounded(cpu_ops.rms_norm(x, norm.weight, norm.eps), norm.reference(x))
    assert torch.equal(torch.ops.loraserve.rms_norm(x, norm.weight, norm.eps), cpu_ops.rms_norm(x, norm.weight, norm.eps))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,D", [(1, 65), (3, 127), (33, 1024)])
def test_add_rms_norm_rounds_the_sum_then_normalises_it(dtype, rows, D):
    gen = _gen(1)
    norm, x, delta = _norm(D, dtype, gen), _wide(rows, D, dtype, gen), _wide(rows, D, dtype, gen)
    total, normed = norm.add_and_norm(x, delta)
    assert torch.equal(total, x + delta)
    assert_as_rounded(normed, norm.reference(x + delta))
    op_total, op_normed = torch.ops.loraserve.add_rms_norm(x, delta, norm.weight, norm.eps)
    assert torch.equal(op_total, total) and torch.equal(op_normed, normed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 65), (3, 127), (33, 3072), (100, 3072)])   # last: threaded
def test_silu_and_mul_matches(dtype, rows, inter):
    gen = _gen(2)
    x = _wide(rows, 2 * inter, dtype, gen, scale=4.0)
    x[0, :4] = torch.tensor([-120.0, 120.0, 0.0, -0.0], dtype=dtype)   # exp's saturation at both ends
    gate, up = x.chunk(2, dim=-1)
    assert_as_rounded(cpu_ops.silu_and_mul(x), F.silu(gate) * up)


def _attention_case(dtype, tokens, heads, kv_heads, head_dim, qk_norm, seed=3):
    gen = _gen(seed)
    cfg = types.SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    rope = RotaryEmbedding(cfg, head_dim, max_positions=300)
    qkv = _wide(tokens, (heads + 2 * kv_heads) * head_dim, dtype, gen, scale=2.0)
    positions = torch.randint(0, 300, (tokens,), generator=gen)
    positions[0] = 299                                               # the table's last row
    num_blocks, block_size = 16, 8
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    cache = [torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=gen).to(dtype) for _ in range(2)]
    norms = (_norm(head_dim, dtype, gen), _norm(head_dim, dtype, gen)) if qk_norm else None
    return rope, qkv, positions, slots, cache, norms


def _torch_norm(norm, x):
    return norm.reference(x)


def _kernel_norm(norm, x):
    return cpu_ops.rms_norm(x, norm.weight, norm.eps)


def _reference(rope, qkv, positions, slots, cache, norms, heads, kv_heads, head_dim, norm_fn=_torch_norm):
    """llama.Attention's torch path: split, q/k norm (`norm_fn`), rope, write_kv."""
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = (t.reshape(-1, n, head_dim) for t, n in ((q, heads), (k, kv_heads), (v, kv_heads)))
    if norms:
        q, k = norm_fn(norms[0], q), norm_fn(norms[1], k)
    q, k = rope(positions, q, k)
    k_cache, v_cache = (c.clone() for c in cache)
    write_kv(k_cache, v_cache, k, v, slots)
    return q, k, k_cache, v_cache


def _kernel(op, rope, qkv, positions, slots, cache, norms, heads, kv_heads):
    weights = (norms[0].weight, norms[1].weight, norms[0].eps) if norms else (None, None, 0.0)
    return op(qkv, positions, *rope.tables(qkv.dtype), *weights, heads, kv_heads, *cache, slots)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", [(1, 4, 2, 18), (3, 3, 1, 64), (33, 16, 8, 128),
                                                         (100, 16, 8, 128)])   # last: threaded
def test_qkv_rope_matches_norm_rope_and_kv_write(dtype, qk_norm, tokens, heads, kv_heads, head_dim):
    """bf16: the torch path's values exactly, given the q/k norm's rows (test_rms_norm_matches compares those to
    torch's: a norm value one bf16 step off moves rope's difference of two rounded products by as much, which no
    relative tolerance on the output bounds). fp32: torch's path end to end, to 1e-6."""
    rope, qkv, positions, slots, cache, norms = _attention_case(dtype, tokens, heads, kv_heads, head_dim, qk_norm)
    norm_fn = _kernel_norm if dtype == torch.bfloat16 else _torch_norm
    q_ref, k_ref, k_cache_ref, v_cache_ref = _reference(rope, qkv, positions, slots, cache, norms, heads, kv_heads,
                                                        head_dim, norm_fn)
    q, k = _kernel(cpu_ops.qkv_rope, rope, qkv, positions, slots, cache, norms, heads, kv_heads)
    if dtype == torch.bfloat16:
        assert torch.equal(q, q_ref) and torch.equal(k, k_ref)
    else:
        assert_as_rounded(q, q_ref)
        assert_as_rounded(k, k_ref)
    written = slots.tolist()
    k_flat, v_flat = (c.view(kv_heads, -1, head_dim) for c in cache)
    k_ref_flat, v_ref_flat = (c.view(kv_heads, -1, head_dim) for c in (k_cache_ref, v_cache_ref))
    assert torch.equal(k_flat[:, written], k.transpose(0, 1))            # the kernel's own k rows, as write_kv does
    assert torch.equal(v_flat, v_ref_flat)                                # v written, every other slot untouched
    untouched = [s for s in range(k_flat.shape[1]) if s not in set(written)]
    assert torch.equal(k_flat[:, untouched], k_ref_flat[:, untouched])


def test_qkv_rope_refuses_positions_and_slots_out_of_range():
    rope, qkv, positions, slots, cache, norms = _attention_case(torch.float32, 3, 4, 2, 18, qk_norm=False)
    for bad_positions, bad_slots in ((positions + 300, slots), (positions - 300, slots), (positions, slots + 128),
                                     (positions, slots - 128)):
        with pytest.raises(IndexError, match="past"):
            _kernel(cpu_ops.qkv_rope, rope, qkv, bad_positions, bad_slots, cache, None, 4, 2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,vocab", [(1, 1), (3, 15), (5, 17), (2, 64), (4, 67), (32, 32000), (3, 151_937)])
def test_argmax_matches_torch_first_maximum_and_first_nan(dtype, rows, vocab):
    gen = _gen()
    x = _wide(rows, vocab, dtype, gen, scale=4.0)   # rows apart by more than the vocabulary
    x[0, vocab // 2] = x[0, vocab - 1] = x.max() + 1   # a tie: the first one wins
    cases = [x, torch.full_like(x, 1.0), torch.full_like(x, float("-inf"))]
    if vocab > 3:
        nans = x.clone()
        nans[rows - 1, vocab - 1] = nans[rows - 1, 3] = float("nan")   # the first NaN, before the maximum
        cases.append(nans)
    for logits in cases:
        assert torch.equal(cpu_ops.argmax(logits), logits.argmax(dim=-1))
        assert torch.equal(torch.ops.loraserve.argmax(logits), logits.argmax(dim=-1))


def test_captured_tape_replays_the_ops_on_new_inputs():
    """A captured decode records each op once (rope's KV write included) and replays it on the buffers' new values."""
    dtype, heads, kv_heads, head_dim = torch.bfloat16, 4, 2, 64
    rope, qkv, positions, slots, cache, norms = _attention_case(dtype, 5, heads, kv_heads, head_dim, qk_norm=True)
    gen = _gen(9)
    norm, delta = _norm(qkv.shape[1], dtype, gen), torch.randn(qkv.shape, generator=gen).to(dtype)
    graph = tape_graph.TapeGraph()

    def step():
        total, h = norm.add_and_norm(qkv, delta)
        q, k = _kernel(cpu_ops.qkv_rope, rope, h, positions, slots, cache, norms, heads, kv_heads)
        return total, q, k, cpu_ops.silu_and_mul(h[:, :2 * head_dim]), norm(h)

    with torch.inference_mode():
        step()   # warm-up, as GraphRunner's: rope's tables in the dtype are made once, not recorded
        with tape_graph.graph(graph):
            captured = step()
        assert graph.num_ops == 4   # the slice is a view: nothing to record
        qkv.copy_(torch.randn(qkv.shape, generator=gen))
        positions.copy_(torch.randint(0, 300, positions.shape, generator=gen))
        slots.copy_(torch.randperm(128, generator=gen)[:5])
        graph.replay()
        replayed_cache = [c.clone() for c in cache]
        expected = step()
    for got, want in zip(captured, expected):
        assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(replayed_cache, cache))


def test_ops_have_fakes_of_the_kernels_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    rope, qkv, positions, slots, cache, norms = _attention_case(torch.float32, 3, 4, 2, 18, qk_norm=True)
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.empty(3, 20)
        assert torch.ops.loraserve.rms_norm(x, torch.empty(20), 1e-6).shape == (3, 20)
        assert [t.shape for t in torch.ops.loraserve.add_rms_norm(x, x, torch.empty(20), 1e-6)] == [(3, 20)] * 2
        assert torch.ops.loraserve.silu_and_mul(x).shape == (3, 10)
        q, k = _kernel(torch.ops.loraserve.qkv_rope, rope, qkv, positions, slots, cache, norms, 4, 2)
        assert q.shape == (3, 4, 18) and k.shape == (3, 2, 18)
        assert torch.ops.loraserve.argmax(x).shape == (3,) and torch.ops.loraserve.argmax(x).dtype == torch.int64


def test_other_dtypes_and_the_off_switch_leave_the_torch_path(monkeypatch):
    x = torch.randn(2, 8, dtype=torch.float16)
    assert cpu_ops.rms_norm(x, torch.ones(8, dtype=torch.float16), 1e-6) is None
    assert cpu_ops.silu_and_mul(x) is None
    assert cpu_ops.argmax(x) is None and cpu_ops.argmax(torch.randn(3)) is None   # fp16; not [B, V]
    monkeypatch.setattr(cpu_ops, "ENABLED", False)
    assert cpu_ops.silu_and_mul(x.float()) is None
