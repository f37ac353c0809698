"""A strict CPU emulator of torch_npu's four MoE ops, as workers/models/moe_kernels.py calls them.

Contract (torch_npu API reference in Ascend/op-plugin docs/zh/custom_APIs/torch_npu, schemas in
op_plugin_functions.yaml; Atlas A2/A3 unless said):
- npu_moe_gating_top_k_softmax(x, finished=None, k=1) -> (y, expert_idx, row_idx): x fp16/bf16/fp32, 2-D
  here; 0 < k <= x.size(-1), k <= 1024; y = topk(softmax(x)) in x's dtype, expert_idx int32, row_idx int32
  with row_idx[i, j] = j * N + i (k-major).
- npu_moe_init_routing_v2(x, expert_idx, *, scale, offset, active_num, expert_capacity, expert_num,
  drop_pad_mode, expert_tokens_num_type, expert_tokens_num_flag, quant_mode, active_expert_range,
  row_idx_type) -> (expanded_x, expanded_row_idx, expert_token_cumsum_or_count, expanded_scale):
  x 2-D [N, H] fp16/bf16/fp32; expert_idx int32 [N, K], ids in [0, expert_num); emulated dropless
  (drop_pad_mode 0), unquantized (quant_mode -1), the full expert range, active_num N*K (or -1 / 0);
  rows sorted by expert, stably by flat index i*K + j; row_idx_type 0: expanded_row_idx[i*K + j] = its
  sorted row, 1: expanded_row_idx[p] = the flat index of sorted row p (int32); the counts int64 [E],
  cumulative (type 0) or per expert (type 1), only with expert_tokens_num_flag (else nothing usable);
  expanded_scale is meaningless without a scale (NaN here, so that a reader fails).
- npu_grouped_matmul(x, weight, *, ..., group_list, split_item, group_type, group_list_type, ...) -> [y]:
  emulated for the "single single single" form: one 2-D x [M, K], one 3-D weight [E, K, N] (contiguous, or
  the transposed view of a contiguous [E, N, K]), split_item 2 or 3, group_type 0; group_list an int64
  1-D Tensor of E <= 1024 values, cumulative (type 0: non-decreasing, last == M) or counts (type 1: >= 0,
  sum == M); y [M, N] in x's dtype; fp32 allowed in this single-tensor form; bias / scales / quantization
  None.
- npu_moe_finalize_routing(expanded_permuted_rows, skip1, skip2, bias, scales, expanded_src_to_dst_row,
  expert_for_source_row, drop_pad_mode=0) -> out [N, H]: rows 2-D [N*K, H]; scales [N, K] of the rows'
  dtype; expanded_src_to_dst_row int32 [N*K]; expert_for_source_row int32 [N, K]; drop_pad_mode 0 (index
  k * N + i) or 2 (index i * K + k), dropless; out[i] = sum_k scales[i, k] * rows[idx] (+ skips / bias).
Violations raise RuntimeError (host checks). Checks of values (ids in range, group_list's form) run as
device asserts (`torch._assert_async`): a captured graph (workers/tape_graph.py) never reads them back.
Results are computed in fp32 from the inputs and rounded once; every op uses only fixed-shape device ops,
so it captures and replays like the real ones.
"""
from __future__ import annotations

from collections import Counter

import torch

FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def check(ok: bool, what: str) -> None:
    if not ok:
        raise RuntimeError(what)


def device_check(ok: torch.Tensor, what: str) -> None:
    torch._assert_async(ok, what)


def _transposed_contiguous(w: torch.Tensor) -> bool:
    E, K, N = w.shape
    return w.is_contiguous() or w.stride() == (K * N, 1, K)


class TorchNpuMoeEmulator:
    def __init__(self):
        self.calls: Counter[str] = Counter()

    def npu_moe_gating_top_k_softmax(self, x, finished=None, k=1):
        self.calls["npu_moe_gating_top_k_softmax"] += 1
        check(x.dtype in FLOATS and x.dim() == 2, f"x must be 2-D fp16/bf16/fp32, got {x.dim()}-D {x.dtype}")
        check(finished is None, "emulated without finished")
        check(0 < k <= x.shape[-1] and k <= 1024, f"k must be in (0, min({x.shape[-1]}, 1024)], got {k}")
        y, idx = torch.topk(torch.softmax(x.float(), dim=-1), k, dim=-1)
        N = x.shape[0]
        row_idx = torch.arange(N * k, dtype=torch.int32, device=x.device).view(k, N).t()
        return y.to(x.dtype), idx.to(torch.int32), row_idx

    def npu_moe_init_routing_v2(self, x, expert_idx, *, scale=None, offset=None, active_num=-1, expert_capacity=-1,
                                expert_num=-1, drop_pad_mode=0, expert_tokens_num_type=0,
                                expert_tokens_num_flag=False, quant_mode=-1, active_expert_range=(), row_idx_type=0):
        self.calls["npu_moe_init_routing_v2"] += 1
        check(x.dim() == 2 and x.dtype in FLOATS, f"x must be 2-D fp16/bf16/fp32, got {x.dim()}-D {x.dtype}")
        check(expert_idx.dtype == torch.int32, f"expert_idx must be int32, got {expert_idx.dtype}")
        check(expert_idx.dim() == 2 and expert_idx.shape[0] == x.shape[0],
              f"expert_idx must be [{x.shape[0]}, K], got {tuple(expert_idx.shape)}")
        N, K = expert_idx.shape
        check(scale is None and offset is None and quant_mode == -1, "emulated unquantized, without scale / offset")
        check(drop_pad_mode == 0, "emulated dropless (drop_pad_mode 0)")
        check(0 < expert_num <= 10240, f"expert_num must be in (0, 10240], got {expert_num}")
        check(list(active_expert_range) in ([], [0, expert_num]), "emulated for the full expert range")
        check(active_num in (-1, 0, N * K), f"emulated with every row active (-1, 0 or {N * K}), got {active_num}")
        check(expert_tokens_num_type in (0, 1), f"emulated cumsum (0) / count (1), got {expert_tokens_num_type}")
        check(row_idx_type in (0, 1), f"row_idx_type must be 0 or 1, got {row_idx_type}")
        flat = expert_idx.reshape(-1).long()
        device_check(((flat >= 0) & (flat < expert_num)).all(), "expert ids past expert_num")
        order = torch.argsort(flat, stable=True)   # the sorted rows' flat (i*K + j) indices
        expanded_x = x[order // K]
        if row_idx_type == 0:
            expanded_row_idx = torch.empty_like(order).scatter_(0, order, torch.arange(N * K, device=x.device))
        else:
            expanded_row_idx = order
        counts = torch.zeros(expert_num, dtype=torch.int64, device=x.device).index_add_(0, flat, torch.ones_like(flat))
        if not expert_tokens_num_flag:
            tokens = torch.empty(0, dtype=torch.int64, device=x.device)
        else:
            tokens = counts.cumsum(0) if expert_tokens_num_type == 0 else counts
        expanded_scale = torch.full((N,), float("nan"), device=x.device)
        return expanded_x, expanded_row_idx.to(torch.int32), tokens, expanded_scale

    def npu_grouped_matmul(self, x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None,
                           antiquant_offset=None, per_token_scale=None, group_list=None, activation_input=None,
                           activation_quant_scale=None, activation_quant_offset=None, split_item=0, group_type=None,
                           group_list_type=0, act_type=0, output_dtype=None, tuning_config=None):
        self.calls["npu_grouped_matmul"] += 1
        check(isinstance(x, (list, tuple)) and isinstance(weight, (list, tuple)), "x and weight are lists of tensors")
        check(len(x) == 1 and len(weight) == 1, "emulated for one x and one weight tensor (single single single)")
        check(all(t is None for t in (bias, scale, offset, antiquant_scale, antiquant_offset, per_token_scale,
                                      activation_input, activation_quant_scale, activation_quant_offset)),
              "emulated without bias, scales or quantization")
        check(split_item in (2, 3) and group_type == 0, f"single x / weight / y need split_item 2 or 3 and "
                                                        f"group_type 0, got {split_item}, {group_type}")
        check(act_type == 0 and output_dtype in (None, x[0].dtype), "emulated without activation, output in x's dtype")
        (xs,), (w,) = x, weight
        check(xs.dim() == 2 and w.dim() == 3, f"x 2-D and weight 3-D, got {xs.dim()}-D, {w.dim()}-D")
        check(xs.dtype in FLOATS and w.dtype == xs.dtype,
              f"x and weight fp16/bf16/fp32 alike, got {xs.dtype}, {w.dtype}")
        check(xs.is_contiguous(), "x is not transposed")
        check(_transposed_contiguous(w), f"weight [E, K, N] contiguous or transposed, got strides {w.stride()}")
        (M, Kx), (E, K, N) = xs.shape, w.shape
        check(Kx == K, f"x [{M}, {Kx}] @ weight [{E}, {K}, {N}]")
        check(K < 65536 and N < 65536, "inner dims below 65536")
        check(isinstance(group_list, torch.Tensor), "group_list must be a Tensor here")
        check(group_list.dtype == torch.int64, f"group_list must be int64, got {group_list.dtype}")
        check(group_list.dim() == 1 and group_list.numel() == E <= 1024,
              f"group_list must be 1-D of the {E} groups (at most 1024), got {tuple(group_list.shape)}")
        check(group_list_type in (0, 1), f"group_list_type 0 (cumsum) or 1 (counts) here, got {group_list_type}")
        if group_list_type == 0:
            ends = group_list
            device_check((group_list[1:] >= group_list[:-1]).all() & (group_list[0] >= 0) & (group_list[-1] == M),
                         f"group_list (cumsum) must be non-decreasing from >= 0 to M = {M}")
        else:
            ends = group_list.cumsum(0)
            device_check((group_list >= 0).all() & (ends[-1] == M), f"group_list (counts) must be >= 0, sum M = {M}")
        group = torch.searchsorted(ends, torch.arange(M, device=xs.device), right=True).clamp(max=E - 1)
        y = torch.bmm(xs.float().unsqueeze(1), w.float()[group]).squeeze(1)   # each row against its own expert
        return [y.to(xs.dtype)]

    def npu_moe_finalize_routing(self, expanded_permuted_rows, skip1, skip2, bias, scales, expanded_src_to_dst_row,
                                 expert_for_source_row, drop_pad_mode=0):
        self.calls["npu_moe_finalize_routing"] += 1
        rows = expanded_permuted_rows
        check(rows.dim() == 2 and rows.dtype in FLOATS, f"expanded_permuted_rows 2-D fp16/bf16/fp32, got {rows.dtype}")
        check(drop_pad_mode in (0, 2), f"emulated dropless (drop_pad_mode 0 or 2), got {drop_pad_mode}")
        check(skip1 is not None or skip2 is None, "skip2 without skip1")
        check(scales is not None and scales.dim() == 2 and scales.dtype == rows.dtype,
              f"scales [N, K] of the rows' dtype {rows.dtype}, got {None if scales is None else scales.dtype}")
        (N, K), H = scales.shape, rows.shape[1]
        index = expanded_src_to_dst_row
        check(index.dtype == torch.int32 and index.shape == (N * K,) and rows.shape[0] == N * K,
              f"expanded_src_to_dst_row int32 [{N * K}] for rows [{N * K}, H], got {index.dtype} "
              f"{tuple(index.shape)}, rows {tuple(rows.shape)}")
        check(expert_for_source_row is None or (expert_for_source_row.dtype == torch.int32
                                                and expert_for_source_row.shape == (N, K)),
              "expert_for_source_row int32 [N, K]")
        for skip in (skip1, skip2):
            check(skip is None or (skip.dtype == rows.dtype and skip.shape == (N, H)),
                  "skips [N, H] of the rows' dtype")
        check(bias is None or (expert_for_source_row is not None and bias.dtype == rows.dtype and bias.dim() == 2),
              "bias [E, H] of the rows' dtype, with expert_for_source_row")
        device_check(((index >= 0) & (index < N * K)).all(), "expanded_src_to_dst_row past the rows")
        index = index.long().view(K, N).t() if drop_pad_mode == 0 else index.long().view(N, K)
        picked = rows.float()[index]                                             # [N, K, H]
        if bias is not None:
            picked = picked + bias.float()[expert_for_source_row.long()]
        out = (scales.float().unsqueeze(-1) * picked).sum(1)
        for skip in (skip1, skip2):
            if skip is not None:
                out = out + skip.float()
        return out.to(rows.dtype)
