"""The Qwen3-MoE sparse block on an NPU through torch_npu's MoE ops, as vllm-ascend's fused MoE calls them.

One kernel object per model runner, chosen once by platform (`moe_kernel`), as the W8A8 kernels are; a
platform or chip without the ops keeps the torch path of moe_experts.py (the same maths). Per block and step:

    probs, ids, _ = npu_moe_gating_top_k_softmax(logits.float(), k)       softmax in fp32, top-k (HF's router)
    x_sorted, idx, counts_cumsum, _ = npu_moe_init_routing_v2(x, ids, ...)
        rows sorted by expert (stable by flat (token, choice) index t*k + j); idx (row_idx_type 0, "gather")
        maps t*k + j to its sorted row; counts_cumsum [E] int64 (expert_tokens_num_type 0)
    gate_up = npu_grouped_matmul([x_sorted], [W13^T], group_list=counts_cumsum, group_list_type=0,
                                 group_type=0, split_item=2)[0]               one call for every expert
    down    = npu_grouped_matmul([silu(gate) * up], [W2^T], ...)[0]
    out     = npu_moe_finalize_routing(down, None, None, None, probs, idx, ids, drop_pad_mode=2)
        out[t] = sum_j probs[t, j] * down[idx[t*k + j]]   (mode 2: idx in row order t*k + j, dropless)

The counts stay on the device and every shape is fixed by the token count, so eager steps and captured
decode run the same calls and nothing is read back to the host (the torch path reads the counts back
once a layer, eagerly). Conventions honoured (torch_npu API reference, op-plugin
op_plugin_functions.yaml; vllm-ascend ops/fused_moe): expert ids int32; group_list an int64 tensor of
E values; the cumulative form (group_list_type 0, its last value the row count), which 310P computes
whatever type is asked, so one form serves every chip; weights [E, K, N] given as the transposed view of
our [E, N, K] (the op reads a transposed weight); fp32 only with single x / weight / y tensors (ours);
310P: fp16 only. Expert LoRA (lora/expert_layers.py) reads each sorted row's token and expert, recovered on
the device by inverting idx (as vllm-ascend's MoE LoRA does), and adds its deltas between the calls.
vllm-ascend combines with npu_moe_token_unpermute, noting accuracy trouble with finalize_routing in its
setting; finalize is the documented counterpart of init_routing_v2 and the one with a documented contract.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from workers.models.moe_experts import ExpertRows

log = logging.getLogger(__name__)
OPS = ("npu_moe_gating_top_k_softmax", "npu_moe_init_routing_v2", "npu_grouped_matmul", "npu_moe_finalize_routing")
CUMSUM = 0   # group_list_type / expert_tokens_num_type: cumulative counts
GATHER = 0   # row_idx_type: expanded_row_idx[t*k + j] = the sorted row of (t, j)
ROW_MAJOR_DROPLESS = 2   # finalize's drop_pad_mode: dropless, expanded_src_to_dst_row in order t*k + j


@dataclass(frozen=True)
class Dispatch:
    """What the routing ops returned for one block and step; the grouped GEMMs and the combine read it."""
    ops: object
    expanded_x: torch.Tensor        # [T*k, H] x's rows sorted by expert
    group_list: torch.Tensor        # [E] int64 cumulative rows per expert, on the device (never read back)
    expanded_row_idx: torch.Tensor  # [T*k] int32 (t*k + j) -> its sorted row
    expert_idx: torch.Tensor        # [T, k] int32
    scales: torch.Tensor            # [T, k] routing weights, the model's dtype

    def grouped_matmul(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """y[n] = x[n] @ weight[e].T for the sorted rows n of expert e; weight [E, out, in]."""
        return self.ops.npu_grouped_matmul([x], [weight.transpose(1, 2)], group_list=self.group_list,
                                           split_item=2, group_type=0, group_list_type=CUMSUM)[0]

    def finalize(self, y: torch.Tensor) -> torch.Tensor:
        """out[t] = sum_j scales[t, j] * y[sorted row of (t, j)]."""
        return self.ops.npu_moe_finalize_routing(y, None, None, None, self.scales, self.expanded_row_idx,
                                                 self.expert_idx, drop_pad_mode=ROW_MAJOR_DROPLESS)


class NpuMoeKernel:
    name = "npu:grouped_matmul"

    def __init__(self, ops):
        self.ops = ops   # torch_npu (the tests pass their strict CPU emulator of its four ops)

    def route(self, x: torch.Tensor, router, num_experts: int):
        """The step's (token, choice) rows sorted by expert, on the device, with their Dispatch."""
        logits = router.logits(x)
        probs, ids, _ = self.ops.npu_moe_gating_top_k_softmax(logits.float(), k=router.top_k)
        if router.norm_topk_prob:
            probs = probs / probs.sum(dim=-1, keepdim=True)
        scales = probs.to(x.dtype)
        T, k = ids.shape
        expanded_x, expanded_row_idx, group_list, _ = self.ops.npu_moe_init_routing_v2(
            x, ids, active_num=T * k, expert_num=num_experts, drop_pad_mode=0, expert_tokens_num_type=CUMSUM,
            expert_tokens_num_flag=True, quant_mode=-1, active_expert_range=[0, num_experts], row_idx_type=GATHER)
        # the (token, choice) each sorted row holds: the gather index inverted by a scatter (fixed shapes)
        flat = torch.arange(T * k, device=x.device)
        source = torch.empty_like(flat).scatter_(0, expanded_row_idx.long(), flat)
        return ExpertRows(source // k, ids.reshape(-1).long()[source], scales.reshape(-1)[source], None,
                          Dispatch(self.ops, expanded_x, group_list, expanded_row_idx, ids, scales))


def unavailable_reason(ops, dtype: torch.dtype, device_name: str) -> str | None:
    """Why these ops cannot run the experts here (None: they can)."""
    missing = [name for name in OPS if not hasattr(ops, name)]
    if missing:
        return f"the installed torch_npu has no {', '.join(missing)}"
    if "310P" in device_name and dtype != torch.float16:
        return f"{device_name}: npu_grouped_matmul and npu_moe_init_routing_v2 take float16 only there, not {dtype}"
    return None


def moe_kernel(platform: str, dtype: torch.dtype, ops=None, device_name: str | None = None) -> NpuMoeKernel | None:
    """The MoE kernel for this platform, or None for the torch path (other platforms; an NPU whose torch_npu or chip
    lacks the ops, said once)."""
    if platform != "npu":
        return None
    if ops is None:
        import torch_npu as ops   # only on the npu platform (REFERENCE: torch_npu breaks a CPU import)
    if device_name is None:
        device_name = torch.npu.get_device_name(torch.npu.current_device())
    reason = unavailable_reason(ops, dtype, device_name)
    if reason is not None:
        log.warning("MoE experts: %s; running the torch path (same results, one GEMM per active expert)", reason)
        return None
    return NpuMoeKernel(ops)
