"""The CPU decode-attention kernel (workers/cpu_attention.c) against the torch ops it replaces."""
from __future__ import annotations

import pytest
import torch

from workers import cpu_attention
from workers.kv_cache import decode_attention


@pytest.fixture(autouse=True)
def two_threads():
    assert cpu_attention.available(), "the CPU attention kernel did not build (needs a C compiler)"
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _case(dtype, kv_heads=4, group=2, head_dim=64, block_size=8, width=5, batch=9, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 40
    k = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=gen).to(dtype)
    v = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=gen).to(dtype)
    q = torch.randn(batch, kv_heads * group, head_dim, generator=gen).to(dtype)
    tables = torch.randint(0, num_blocks, (batch, width + 3), generator=gen)[:, :width]   # a strided view
    lens = torch.randint(1, width * block_size + 1, (batch,), generator=gen)
    lens[0], lens[1] = 1, width * block_size             # the shortest and the longest context
    return q, k, v, tables, lens, head_dim ** -0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads,group,head_dim,block_size", [(4, 2, 64, 8), (2, 1, 128, 16), (1, 8, 32, 4)])
def test_matches_the_torch_ops(dtype, kv_heads, group, head_dim, block_size):
    q, k, v, tables, lens, scale = _case(dtype, kv_heads, group, head_dim, block_size)
    expected = decode_attention(q, k, v, tables, lens, scale, graph_safe=True)
    out = decode_attention(q, k, v, tables, lens, scale, graph_safe=False)
    assert out.dtype == dtype and out.shape == q.shape
    # The torch path rounds bf16 scores and probabilities before the weighted sum; the kernel keeps fp32.
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(out.float(), expected.float(), **tol)


def test_reads_only_each_sequence_s_own_blocks():
    q, k, v, tables, lens, scale = _case(torch.float32)
    expected = decode_attention(q, k, v, tables, lens, scale, graph_safe=False)
    used = {int(tables[b, j]) for b in range(len(lens)) for j in range((int(lens[b]) + 7) // 8)}
    unused = [blk for blk in range(k.shape[1]) if blk not in used]
    k[:, unused], v[:, unused] = float("nan"), float("nan")      # poison every other block
    torch.testing.assert_close(decode_attention(q, k, v, tables, lens, scale, graph_safe=False), expected)


def test_out_of_range_contexts_and_blocks_fail_instead_of_reading_past_the_cache():
    q, k, v, tables, lens, scale = _case(torch.float32)
    for bad_lens, bad_tables in ((lens.clone().fill_(0), tables), (lens + 100, tables),
                                 (lens, tables.clone().fill_(k.shape[1])), (lens, tables.clone().fill_(-1))):
        with pytest.raises(ValueError, match="out of range"):
            decode_attention(q, k, v, bad_tables, bad_lens, scale, graph_safe=False)


def test_other_dtypes_and_the_graph_safe_path_keep_the_torch_ops():
    q, k, v, tables, lens, scale = _case(torch.float16)
    assert cpu_attention.decode_attention(q, k, v, tables, lens, scale) is None
    q, k, v, tables, lens, scale = _case(torch.float32)
    assert cpu_attention.decode_attention(q, k.transpose(2, 3), v, tables, lens, scale) is None   # not its layout


def _reference(q, k, v, tables, lens, scale):
    """Float64, sequence by sequence, from the cache blocks the table names."""
    kv_heads, _, block_size, _ = k.shape
    group = q.shape[1] // kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    for b, n in enumerate(lens.tolist()):
        pos = torch.arange(n)
        rows = tables[b, pos // block_size] * block_size + pos % block_size
        for h in range(q.shape[1]):
            keys = k[h // group].reshape(-1, k.shape[-1])[rows].double()
            vals = v[h // group].reshape(-1, v.shape[-1])[rows].double()
            out[b, h] = torch.softmax(keys @ q[b, h].double() * scale, 0) @ vals
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group,head_dim", [(4, 128), (3, 128), (5, 64), (2, 256), (2, 96), (1, 32)])
def test_matches_a_float64_reference(dtype, group, head_dim):
    """bf16's weighted sum of V in register tiles (head_dim 64: 4 heads a tile, 128: 2, 256: 1, a group's remainder
    one at a time) and in the scratch row (other head_dims) alike."""
    q, k, v, tables, lens, scale = _case(dtype, kv_heads=2, group=group, head_dim=head_dim, block_size=16, width=4)
    out = decode_attention(q, k, v, tables, lens, scale, graph_safe=False)
    # fp32 math inside either way: only bf16's one final rounding (2^-8 relative) separates them.
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=8e-3, atol=4e-3)
    torch.testing.assert_close(out.double(), _reference(q, k, v, tables, lens, scale), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_key_scoring_minus_infinity_gets_no_weight(dtype):
    """exp(-inf) is 0, as in torch: one such key must not turn the output into NaN."""
    q, k, v, tables, lens, scale = _case(dtype, kv_heads=2, group=2, head_dim=64)
    q = q.abs() + 0.1
    k[:, int(tables[1, 0]), 0, 0] = float("-inf")        # a key of sequence 1, every kv head
    out = decode_attention(q, k, v, tables, lens, scale, graph_safe=False)
    expected = decode_attention(q, k, v, tables, lens, scale, graph_safe=True)
    assert torch.isfinite(expected[1]).all() and torch.isfinite(out[1]).all()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(out.float(), expected.float(), **tol)


# ---- a mixed step's prompt rows through the kernel (kv_cache.attend_as_rows) -------------------------------------
def _prompts(dtype, chunks, kv_heads=2, group=8, head_dim=64, block_size=8, seed=3):
    """A cache holding sequences whose chunks (start, n) are being computed: every token's K/V already written (as
    qkv_rope writes them before attention), q for the chunks' rows, and each sequence's block table."""
    gen = torch.Generator().manual_seed(seed)
    tables, next_block = [], 1
    for start, n in chunks:
        blocks = -(-(start + n) // block_size)
        tables.append(list(range(next_block, next_block + blocks)))
        next_block += blocks
    k = torch.randn(kv_heads, next_block, block_size, head_dim, generator=gen).to(dtype)
    v = torch.randn(kv_heads, next_block, block_size, head_dim, generator=gen).to(dtype)
    q = torch.randn(sum(n for _, n in chunks), kv_heads * group, head_dim, generator=gen).to(dtype)
    return q, k, v, tables


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompt_rows_through_the_kernel_match_sdpa_per_chunk(dtype):
    from workers.kv_cache import chunk_attention, row_tables

    chunks = [(0, 1), (0, 13), (5, 9), (16, 3), (0, 40)]   # (tokens already cached, new tokens)
    q, k, v, tables = _prompts(dtype, chunks)
    padded, lens, rows = row_tables([n for _, n in chunks], [s + n for s, n in chunks], tables)
    out = decode_attention(q, k, v, padded, lens, 0.125, graph_safe=False, rows=rows)
    torch_rows = decode_attention(q, k, v, padded, lens, 0.125, graph_safe=True, rows=rows)
    row, tol = 0, dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    for (start, n), table in zip(chunks, tables):
        expected = chunk_attention(q[row:row + n], k, v, torch.tensor(table), start, 0.125)
        torch.testing.assert_close(out[row:row + n].float(), expected.float(), **tol)
        torch.testing.assert_close(torch_rows[row:row + n].float(), expected.float(), **tol)
        row += n


def test_a_row_s_table_index_out_of_range_fails():
    q, k, v, tables = _prompts(torch.float32, [(0, 4), (0, 3)])
    padded = torch.tensor([t + [0] * (1 - len(t)) for t in tables])
    lens = torch.tensor([1, 2, 3, 4, 1, 2, 3])
    for bad in ([0, 0, 0, 0, 1, 1, 2], [0, 0, 0, 0, 1, 1, -1]):
        with pytest.raises(ValueError, match="out of range"):
            decode_attention(q, k, v, padded, lens, 0.1, graph_safe=False, rows=torch.tensor(bad))
    with pytest.raises(ValueError, match="table rows"):
        decode_attention(q, k, v, padded, lens, 0.1, graph_safe=False, rows=torch.tensor([0, 1]))


def test_which_steps_attend_as_rows():
    from workers.kv_cache import attend_as_rows

    cpu = torch.device("cpu")
    assert attend_as_rows(cpu, torch.bfloat16, [4096, 3])                  # bf16: the kernel wins at any context
    assert attend_as_rows(cpu, torch.float32, [64, 1]) and not attend_as_rows(cpu, torch.float32, [65])
    assert not attend_as_rows(cpu, torch.float16, [8])                     # no code for it: SDPA
    assert not attend_as_rows(torch.device("meta"), torch.bfloat16, [8])   # not the CPU


def test_the_prefill_attention_benchmark_times_both_ways():
    from benchmarks import prefill_attention

    data = prefill_attention.run(threads=2, lengths=[16, 24], repeats=1)
    assert [(r["dtype"], r["prompt_len"]) for r in data["rows"]] == [("bfloat16", 16), ("bfloat16", 24),
                                                                     ("float32", 16), ("float32", 24)]
    assert all(r["sdpa_ms"] > 0 and r["kernel_ms"] > 0 for r in data["rows"])
