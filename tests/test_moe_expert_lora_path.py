"""The expert LoRA path's bytes and host work: gate and up sharing one A (PEFT's fused target_parameters format) are
marked by the slot pool and read once by the CPU kernel (lora/backends/cpu_sgmv.c `a_shared`), results staying the
torch maths'; the rows' plan is built with tensor ops (lora.batch.plan_rows), the same groups as plan_step's."""
from __future__ import annotations

import pytest
import torch

from lora.adapter import LoRAAdapter, LoRAWeights
from lora.backends import cpu_sgmv
from lora.batch import KernelGroups, plan_rows, plan_step, segments
from lora.slots import GroupShape, SlotPool

E, H, I, R = 4, 64, 32, 16
needs_kernel = pytest.mark.skipif(not cpu_sgmv.available(), reason="the CPU LoRA kernel did not build here")


def _groups(plan_groups):
    return sorted((g.slot, g.rank, list(range(g.rows.start, g.rows.stop)) if isinstance(g.rows, slice)
                   else g.rows.tolist()) for g in plan_groups)


@pytest.mark.parametrize("gemm_min_tokens", [None, 3])
@pytest.mark.parametrize("seed", range(4))
def test_plan_rows_groups_as_plan_step(seed, gemm_min_tokens):
    gen = torch.Generator().manual_seed(seed)
    ranks = torch.randint(0, 3, (12,), generator=gen) * 8                 # some indices of rank 0 (empty)
    index = torch.randint(-1, 12, (40,), generator=gen)
    index[index % 5 == 1], ranks[4] = 4, 16                                # one index with many rows
    lens, slots = segments(index.tolist())
    want = plan_step(tuple(lens), tuple(slots), tuple(ranks.tolist()), 16, gemm_min_tokens=gemm_min_tokens)
    got = plan_rows(index, ranks, 16, gemm_min_tokens=gemm_min_tokens)
    assert _groups(got.groups) == _groups(want.groups) and _groups(got.gemm) == _groups(want.gemm)
    if gemm_min_tokens is None:
        assert got.kernel is None and want.kernel is None
        return
    kernel = lambda k: sorted((s, r, k.rows[a:b].tolist()) for s, r, a, b in  # noqa: E731
                              zip(k.slot.tolist(), k.rank.tolist(), k.start[:-1].tolist(), k.start[1:].tolist()))
    assert kernel(got.kernel) == kernel(want.kernel) and got.kernel.num_groups > 0 and got.gemm


def expert_adapter(name: str, rank: int, shared: bool, seed: int) -> LoRAAdapter:
    gen = torch.Generator().manual_seed(seed)
    a_gate = torch.randn(E, rank, H, generator=gen) * 0.2
    a_up = a_gate.clone() if shared else torch.randn(E, rank, H, generator=gen) * 0.2
    weights = {(0, "experts.gate_proj"): LoRAWeights(a_gate, torch.randn(E, I, rank, generator=gen) * 0.2, 2.0),
               (0, "experts.up_proj"): LoRAWeights(a_up, torch.randn(E, I, rank, generator=gen) * 0.2, 2.0),
               (0, "experts.down_proj"): LoRAWeights(torch.randn(E, rank, I, generator=gen) * 0.2,
                                                     torch.randn(E, H, rank, generator=gen) * 0.2, 2.0)}
    return LoRAAdapter(name, "src", rank, frozenset(m for _, m in weights), weights)


def make_pool(dtype=torch.float32) -> SlotPool:
    groups = {"experts_gate_up": GroupShape(H, (I, I), (0,), E), "experts_down": GroupShape(I, (H,), (0,), E)}
    return SlotPool(1, groups, 3, R, dtype, "cpu")


def test_nothing_to_plan():
    plan = plan_rows(torch.tensor([-1, 3, -1]), torch.zeros(4, dtype=torch.int64), 16, gemm_min_tokens=64)
    assert plan.groups == () and plan.kernel is None and plan.gemm == ()


def test_the_pool_marks_the_blocks_whose_slices_share_a():
    pool = make_pool()
    pool.load(0, expert_adapter("fused", 16, True, 0), 0)
    pool.load(1, expert_adapter("two_d", 8, False, 1), 1)
    pool.load(2, expert_adapter("fused_low", 4, True, 2), 2)
    table = pool.a_shared[(0, "experts_gate_up")]
    assert table.tolist() == [1] * E + [0] * E + [1] * E and (0, "experts_down") not in pool.a_shared
    pool.clear(2)
    assert table.tolist() == [1] * E + [0] * 2 * E
    pool.load(0, expert_adapter("two_d_again", 8, False, 3), 0)   # a slot reused by the other format
    assert table.tolist() == [0] * 3 * E


@needs_kernel
@pytest.mark.parametrize("shared_rank", [16, 6])   # 6: slice 0's last live rows are a block short of 4
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_reads_slice_0s_a_for_shared_blocks(dtype, shared_rank):
    """With the flag set, slice 1 is computed from slice 0's A rows (in bf16 its h copied from slice 0's): equal to
    the torch maths when they are equal (the pool's promise), bit for bit the unflagged call's, and visibly from
    slice 0 when they are not (the flag is obeyed, not ignored)."""
    pool = make_pool(dtype)
    pool.load(0, expert_adapter("fused", shared_rank, True, 0), 0)
    pool.load(1, expert_adapter("two_d", 8, False, 1), 1)
    a, b = pool.buffers[(0, "experts_gate_up")]
    table = pool.a_shared[(0, "experts_gate_up")]
    offsets = (0, I, 2 * I)
    x = torch.randn(12, H, dtype=dtype)
    slots = [0, 5, 2, 1, 7, 4, 4, 0, 6, 3, 5, 7]                     # combined (expert slot, expert) per row
    groups = {}
    for t, s in enumerate(slots):
        groups.setdefault(s, []).append(t)
    plan = KernelGroups.of(list(groups), [shared_rank if s < E else 8 for s in groups], list(groups.values()))

    def run(a_shared):
        y = torch.zeros(12, 2 * I, dtype=dtype)
        cpu_sgmv.prepare(a, b, offsets, a_shared).run(y, x, plan)
        return y

    def reference(a_used):
        y = torch.zeros(12, 2 * I)
        for t, s in enumerate(slots):
            for k in range(2):
                y[t, k * I:(k + 1) * I] += b[k][s].float() @ (a_used[s, k * R:(k + 1) * R].float() @ x[t].float())
        return y

    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(run(table).float(), reference(a), **tol)
    torch.testing.assert_close(run(table).float(), run(None).float(), rtol=0, atol=0)
    a[0, R:2 * R] += 1.0                                            # expert 0 of the shared slot: slice 1 differs now
    only_slice_0 = a.clone()
    only_slice_0[:E, R:2 * R] = only_slice_0[:E, :R]
    torch.testing.assert_close(run(table).float(), reference(only_slice_0), **tol)
    assert not torch.allclose(run(None).float(), reference(only_slice_0), **tol)
