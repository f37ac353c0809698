"""SlotTable policy and the SlotPool buffer layout (the contract with backends and layers)."""
from __future__ import annotations

import pytest
import torch

from lora.adapter import LoRAAdapter, LoRAWeights
from lora.slots import MODULE_GROUPS, GroupShape, SlotPool, SlotTable
from lora.modules import EXPERT_MODULES

HIDDEN, KV, INTER, VOCAB, LAYERS = 16, 8, 24, 40, 2
GROUPS = {
    "qkv_proj": GroupShape(HIDDEN, (HIDDEN, KV, KV)),
    "o_proj": GroupShape(HIDDEN, (HIDDEN,)),
    "gate_up_proj": GroupShape(HIDDEN, (INTER, INTER)),
    "down_proj": GroupShape(INTER, (HIDDEN,)),
    "embed_tokens": GroupShape(VOCAB, (HIDDEN,)),
    "lm_head": GroupShape(HIDDEN, (VOCAB,)),
}
# (in, out) of each module, PEFT orientation: lora_a [r, in], lora_b [out, r]
DIMS = {"q_proj": (HIDDEN, HIDDEN), "k_proj": (HIDDEN, KV), "v_proj": (HIDDEN, KV),
        "o_proj": (HIDDEN, HIDDEN), "gate_proj": (HIDDEN, INTER), "up_proj": (HIDDEN, INTER),
        "down_proj": (INTER, HIDDEN), "embed_tokens": (VOCAB, HIDDEN), "lm_head": (HIDDEN, VOCAB)}


def make_adapter(rank: int, modules=tuple(DIMS), scaling: float = 2.0, name: str = "a") -> LoRAAdapter:
    weights = {}
    for module in modules:
        in_dim, out_dim = DIMS[module]
        layers = [-1] if module in ("embed_tokens", "lm_head") else range(LAYERS)
        for layer in layers:
            weights[(layer, module)] = LoRAWeights(
                torch.randn(rank, in_dim), torch.randn(out_dim, rank), scaling)
    return LoRAAdapter(name, f"/adapters/{name}", rank, frozenset(modules), weights)


def make_pool(max_rank=8, num_slots=3, dtype=torch.float32, groups=GROUPS, **kwargs) -> SlotPool:
    return SlotPool(LAYERS, groups, num_slots, max_rank, dtype, "cpu", **kwargs)


# -- SlotTable -----------------------------------------------------------------

def test_slot_table_free_slots_first_then_lru():
    table = SlotTable(3)
    assert table.assign(["a", "b"]) == [(0, "a"), (1, "b")]
    assert table.assign(["a", "c", "a"]) == [(2, "c")]  # a hit; duplicates count once
    assert [table.slot_of(n) for n in "abcd"] == [0, 1, 2, None]
    assert table.assign(["d"]) == [(1, "d")]  # b is the least recently used
    assert table.assign(["b", "a"]) == [(2, "b")]  # c is LRU among slots not in the batch
    assert table.stats() == dict(hits=2, misses=5, evictions=2, num_slots=3, used=3)


def test_slot_table_keeps_batch_and_pinned_adapters():
    table = SlotTable(3)
    table.assign(["p"])
    table.assign(["a"])
    table.assign(["b"])
    assert table.assign(["c", "a"], pinned={"p"}) == [(2, "c")]  # p is LRU but pinned
    with pytest.raises(RuntimeError, match="pinned"):
        table.assign(["x", "y", "c"], pinned={"p"})
    assert [table.slot_of(n) for n in "pacxy"] == [0, 1, 2, None, None]  # nothing changed
    with pytest.raises(RuntimeError, match="only 3 slots"):
        table.assign(["w", "x", "y", "z"])
    assert table.assign(["x", "y", "c"]) == [(0, "x"), (1, "y")]


def test_slot_table_remove_frees_the_slot():
    table = SlotTable(2)
    table.assign(["a", "b"])
    assert table.remove("a") == 0 and table.remove("a") is None
    assert table.assign(["c", "b"]) == [(0, "c")]
    assert table.stats()["evictions"] == 0


# -- SlotPool ------------------------------------------------------------------

def test_buffer_layout_and_nbytes():
    R, L = 8, 3
    pool = make_pool(R, L, dtype=torch.bfloat16)
    linear = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    expected_keys = {(layer, g) for layer in range(LAYERS) for g in linear}
    assert set(pool.buffers) == expected_keys | {(-1, "embed_tokens"), (-1, "lm_head")}
    a, b = pool.buffers[(1, "qkv_proj")]
    assert a.shape == (L, 3 * R, HIDDEN) and [t.shape for t in b] == [(L, HIDDEN, R), (L, KV, R), (L, KV, R)]
    a, b = pool.buffers[(0, "down_proj")]
    assert a.shape == (L, R, INTER) and [t.shape for t in b] == [(L, HIDDEN, R)]
    a, b = pool.buffers[(-1, "embed_tokens")]
    assert a.shape == (L, VOCAB, R) and [t.shape for t in b] == [(L, HIDDEN, R)]
    a, b = pool.buffers[(-1, "lm_head")]
    assert a.shape == (L, R, HIDDEN) and [t.shape for t in b] == [(L, VOCAB, R)]
    tensors = [t for a, b in pool.buffers.values() for t in (a, *b)]
    assert all(t.dtype == torch.bfloat16 and t.is_contiguous() for t in tensors)
    assert pool.nbytes() == 2 * sum(a.numel() + sum(t.numel() for t in b) for a, b in pool.buffers.values())
    assert pool.slot_ranks == [0, 0, 0]
    only_o = make_pool(groups={"o_proj": GROUPS["o_proj"]})
    assert set(only_o.buffers) == {(0, "o_proj"), (1, "o_proj")}


def test_stacked_slices_start_at_s_times_max_rank():
    R, r = 8, 4
    pool = make_pool(R)
    adapter = make_adapter(r, modules=("q_proj", "v_proj", "up_proj"), scaling=0.5)
    pool.load(1, adapter)
    assert pool.slot_ranks == [0, r, 0]
    for layer in range(LAYERS):
        a, b = pool.buffers[(layer, "qkv_proj")]
        q, v = adapter.weights[(layer, "q_proj")], adapter.weights[(layer, "v_proj")]
        torch.testing.assert_close(a[1, 0:r], q.lora_a)
        torch.testing.assert_close(a[1, 2 * R:2 * R + r], v.lora_a)
        assert not a[1, r:2 * R].any() and not a[1, 2 * R + r:].any()  # k slice and rank padding
        torch.testing.assert_close(b[0][1, :, :r], q.lora_b * 0.5)
        torch.testing.assert_close(b[2][1, :, :r], v.lora_b * 0.5)
        assert not b[1][1].any() and not b[0][1, :, r:].any()
        a, b = pool.buffers[(layer, "gate_up_proj")]
        up = adapter.weights[(layer, "up_proj")]
        torch.testing.assert_close(a[1, R:R + r], up.lora_a)
        assert not a[1, :R].any() and not b[0][1].any()
        torch.testing.assert_close(b[1][1, :, :r], up.lora_b * 0.5)
    assert not any(t[[0, 2]].any() for a, b in pool.buffers.values() for t in (a, *b))  # other slots


def test_full_rank_delta_equals_peft_delta():
    """A kernel computing all R ranks of each slice gets exactly the adapter's delta."""
    R, r = 8, 3
    pool = make_pool(R)
    adapter = make_adapter(r, modules=("q_proj", "k_proj", "v_proj"), scaling=1.5)
    pool.load(0, adapter)
    x = torch.randn(5, HIDDEN)
    a, b = pool.buffers[(1, "qkv_proj")]
    shrunk = x @ a[0].T  # [T, 3R]
    for s, module in enumerate(("q_proj", "k_proj", "v_proj")):
        w = adapter.weights[(1, module)]
        expected = x @ w.lora_a.T @ w.lora_b.T * w.scaling
        torch.testing.assert_close(shrunk[:, s * R:(s + 1) * R] @ b[s][0].T, expected)


def test_smaller_adapter_overwrites_in_place_with_zero_fill():
    R = 64
    pool = make_pool(R, num_slots=2)
    pointers = {key: (a.data_ptr(), *(t.data_ptr() for t in b)) for key, (a, b) in pool.buffers.items()}
    pool.load(1, make_adapter(8, name="other"))
    before_slot1 = {key: (a[1].clone(), *(t[1].clone() for t in b)) for key, (a, b) in pool.buffers.items()}
    pool.load(0, make_adapter(64, name="big"))
    small = make_adapter(4, modules=("q_proj", "embed_tokens"), name="small")
    pool.load(0, small)
    assert pool.slot_ranks == [4, 8]
    for (layer, group), (a, b) in pool.buffers.items():
        assert (a.data_ptr(), *(t.data_ptr() for t in b)) == pointers[(layer, group)]
        if group == "embed_tokens":
            assert not a[0, :, 4:].any() and a[0, :, :4].any()
        elif group == "qkv_proj":
            assert a[0, :4].any() and not a[0, 4:].any()  # only q, rank 4
        else:
            assert not a[0].any()  # not targeted by the small adapter
        assert not any(t[0, :, 4:].any() for t in b)
        assert all(torch.equal(t, u[1]) for t, u in zip(before_slot1[(layer, group)], (a, *b)))


def test_a_full_rank_adapter_over_another_leaves_nothing_of_it():
    """Slices a new adapter fills at full rank are not cleared first; every other one must be."""
    R = 8
    pool = make_pool(R, num_slots=1)
    pool.load(0, make_adapter(R, name="everything"))
    q_only = make_adapter(R, modules=("q_proj",), scaling=1.0, name="q-only")
    pool.load(0, q_only)
    for (layer, group), (a, b) in pool.buffers.items():
        if group == "qkv_proj":
            torch.testing.assert_close(a[0, :R], q_only.weights[(layer, "q_proj")].lora_a)
            torch.testing.assert_close(b[0][0], q_only.weights[(layer, "q_proj")].lora_b)
            assert not a[0, R:].any() and not b[1][0].any() and not b[2][0].any()   # k and v: gone
        else:
            assert not a[0].any() and not any(t[0].any() for t in b)


def test_embedding_is_stored_transposed():
    pool = make_pool(8)
    adapter = make_adapter(5, modules=("embed_tokens", "lm_head"), scaling=3.0)
    pool.load(2, adapter)
    embed, head = adapter.weights[(-1, "embed_tokens")], adapter.weights[(-1, "lm_head")]
    a, b = pool.buffers[(-1, "embed_tokens")]
    torch.testing.assert_close(a[2, :, :5], embed.lora_a.T)
    torch.testing.assert_close(b[0][2, :, :5], embed.lora_b * 3.0)
    a, b = pool.buffers[(-1, "lm_head")]
    torch.testing.assert_close(a[2, :5], head.lora_a)
    torch.testing.assert_close(b[0][2, :, :5], head.lora_b * 3.0)


def test_scaling_is_folded_in_fp32_then_cast():
    pool = make_pool(8, dtype=torch.bfloat16)
    adapter = make_adapter(4, modules=("o_proj",), scaling=0.1)
    pool.load(0, adapter)
    w = adapter.weights[(0, "o_proj")]
    assert torch.equal(pool.buffers[(0, "o_proj")][1][0][0, :, :4], (w.lora_b * 0.1).to(torch.bfloat16))


def test_clear_zeroes_the_slot():
    pool = make_pool(8)
    pool.load(0, make_adapter(8))
    pool.load(1, make_adapter(8))
    pool.clear(0)
    assert pool.slot_ranks == [0, 8, 0]
    assert not any(t[0].any() for a, b in pool.buffers.values() for t in (a, *b))
    assert all(t[1].any() for a, b in pool.buffers.values() for t in (a, *b))


def test_invalid_adapters_are_refused_before_touching_the_slot():
    pool = make_pool(8, groups={k: GROUPS[k] for k in ("qkv_proj", "o_proj")})
    pool.load(0, make_adapter(4, modules=("q_proj",)))
    snapshot = [t.clone() for a, b in pool.buffers.values() for t in (a, *b)]
    with pytest.raises(ValueError, match="max_lora_rank"):
        pool.load(0, make_adapter(16, modules=("q_proj",)))
    with pytest.raises(ValueError, match="no LoRA buffer"):
        pool.load(0, make_adapter(4, modules=("q_proj", "down_proj")))
    with pytest.raises(ValueError, match="out of range"):
        pool.load(3, make_adapter(4, modules=("q_proj",)))
    after = [t for a, b in pool.buffers.values() for t in (a, *b)]
    assert all(torch.equal(s, t) for s, t in zip(snapshot, after))
    assert pool.slot_ranks[0] == 4


def test_shard_gets_full_tensors_and_returns_local_ones():
    seen = []

    def shard(module, weights):  # column-parallel, rank 1 of 2: B's second half of output rows
        seen.append((module, tuple(weights.lora_a.shape), tuple(weights.lora_b.shape)))
        half = weights.lora_b.shape[0] // 2
        return weights.lora_a, weights.lora_b[half:]

    pool = make_pool(8, groups={"o_proj": GroupShape(HIDDEN, (HIDDEN // 2,))}, shard=shard)
    adapter = make_adapter(4, modules=("o_proj",), scaling=2.0)
    pool.load(0, adapter)
    assert seen == [("o_proj", (4, HIDDEN), (HIDDEN, 4))] * LAYERS
    w = adapter.weights[(1, "o_proj")]
    torch.testing.assert_close(pool.buffers[(1, "o_proj")][1][0][0, :, :4], w.lora_b[HIDDEN // 2:] * 2.0)
    assert set(MODULE_GROUPS) - set(EXPERT_MODULES) == set(DIMS)   # experts: tests/test_moe_units.py
