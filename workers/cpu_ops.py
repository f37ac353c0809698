"""A decoder layer's element-wise ops on the CPU through cpu_ops.c (ctypes): RMSNorm (+ residual add), q/k
RMSNorm + rope + KV-cache write, SiLU-and-mul; and the greedy sampler's argmax.

Each is also the torch op loraserve::<name> (with a fake), so a captured decode records it on the tape
(workers/tape_graph.py) and FakeTensor mode / torch.compile see a fixed-shape op. An eager call (no dispatch
mode active, not tracing) calls the kernel directly: the custom op's Python dispatch costs about as much as
the kernel itself at decode sizes. Every function returns None where the kernel does not apply (another
device, e.g. the fake NPU; a dtype it has no code for; no C compiler; LORASERVE_CPU_OPS=0): the caller then
runs its torch reference (workers/models/llama.py, kv_cache.py).
"""
from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch

from lora import native

SOURCE = Path(__file__).with_name("cpu_ops.c")
_DTYPES = {torch.bfloat16: "bf16", torch.float32: "f32"}
_P, _I = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = {"rms_norm": [_P], "silu_and_mul": [_P], "qkv_rope": [_P], "argmax": [_P, _I, _I, _I, _P]}
# Off switch for A/B measurement in one process (benchmarks/step_profile.py); LORASERVE_CPU_OPS=0 at start.
ENABLED = os.environ.get("LORASERVE_CPU_OPS", "1") != "0"


_load, available = native.library(SOURCE, {f"{op}_{suffix}": types for op, types in _ARGTYPES.items()
                                            for suffix in _DTYPES.values()})


@functools.cache
def _fn(op: str, dtype: torch.dtype):
    return getattr(_load(), f"{op}_{_DTYPES[dtype]}")


def applies(x: torch.Tensor, *others: torch.Tensor) -> bool:
    """Whether the kernels take these tensors: all on the CPU, of x's dtype, one they have code for."""
    if not (ENABLED and x.is_cpu and x.dtype in _DTYPES and available()):
        return False
    for t in others:   # a loop, not all(<generator>): this runs on every norm of every step
        if not t.is_cpu or t.dtype != x.dtype:
            return False
    return True


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, D] with unit column stride and rows apart (a view; a copy only where no view has them)."""
    D = x.shape[-1]
    rows = x if x.dim() == 2 else x.reshape(-1, D)
    if rows.stride(1) != 1 or (rows.stride(0) < D and rows.shape[0] > 1):
        rows = rows.contiguous()
    return rows


def _no_status(name: str):
    def check(status: int) -> None:
        raise RuntimeError(f"{name}: the kernel returned {status}")
    return check


# ---- RMSNorm, with the residual add before it --------------------------------------------------------------
class _NormArgs(ctypes.Structure):
    """norm_args of cpu_ops.c, field for field."""
    _fields_ = [("x", _P), ("x_stride", _I), ("delta", _P), ("delta_stride", _I), ("sum", _P), ("w", _P),
                ("eps", ctypes.c_float), ("rows", _I), ("D", _I), ("out", _P)]


_norm_failed, _silu_failed = _no_status("rms_norm"), _no_status("silu_and_mul")


def _rms_norm_impl(x, weight, eps: float, delta=None):
    D = x.shape[-1]
    if weight.shape != (D,) or not weight.is_contiguous() or (delta is not None and delta.shape != x.shape):
        raise ValueError(f"rms_norm: x {tuple(x.shape)}, weight {tuple(weight.shape)}"
                         + (f", residual delta {tuple(delta.shape)}" if delta is not None else ""))
    rows = _rows(x)
    out = torch.empty(rows.shape[0], D, dtype=x.dtype)
    if delta is None:
        args = _NormArgs(rows.data_ptr(), rows.stride(0), None, 0, None, weight.data_ptr(), eps, rows.shape[0], D,
                         out.data_ptr())
        native.call(_fn("rms_norm", x.dtype), args, _norm_failed)
        return (out if x.dim() == 2 else out.view(x.shape)), None
    deltas, total = _rows(delta), torch.empty(rows.shape[0], D, dtype=x.dtype)
    args = _NormArgs(rows.data_ptr(), rows.stride(0), deltas.data_ptr(), deltas.stride(0), total.data_ptr(),
                     weight.data_ptr(), eps, rows.shape[0], D, out.data_ptr())
    native.call(_fn("rms_norm", x.dtype), args, _norm_failed)
    if x.dim() == 2:   # a decoder layer's [T, hidden]: no views (a few us each, 16 calls a step)
        return out, total
    return out.view(x.shape), total.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """llama.RMSNorm's forward: weight * round(x * rsqrt(mean(x^2) + eps)) over the last dim, or None."""
    if not applies(x, weight):
        return None
    if native.eager():
        return _rms_norm_impl(x, weight, eps)[0]
    return torch.ops.loraserve.rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(x + delta, rms_norm(x + delta)), the sum rounded once, or None."""
    if not applies(x, delta, weight):
        return None
    if native.eager():
        out, total = _rms_norm_impl(x, weight, eps, delta)
        return total, out
    return torch.ops.loraserve.add_rms_norm(x, delta, weight, eps)


# ---- SiLU-and-mul -------------------------------------------------------------------------------------------
class _SiluArgs(ctypes.Structure):
    """silu_args of cpu_ops.c, field for field."""
    _fields_ = [("x", _P), ("x_stride", _I), ("rows", _I), ("I", _I), ("out", _P)]


def _silu_and_mul_impl(x):
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul: the last dimension ({x.shape[-1]}) must be gate and up, of equal size")
    rows, inter = _rows(x), x.shape[-1] // 2
    out = torch.empty(rows.shape[0], inter, dtype=x.dtype)
    native.call(_fn("silu_and_mul", x.dtype), _SiluArgs(rows.data_ptr(), rows.stride(0), rows.shape[0], inter,
                                                        out.data_ptr()), _silu_failed)
    return out.view(*x.shape[:-1], inter)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up of x = [..., gate | up] -> [..., I], or None."""
    if not applies(x):
        return None
    return _silu_and_mul_impl(x) if native.eager() else torch.ops.loraserve.silu_and_mul(x)


# ---- q/k norm + rope + KV write -----------------------------------------------------------------------------
class _QKVArgs(ctypes.Structure):
    """qkv_args of cpu_ops.c, field for field."""
    _fields_ = [("qkv", _P), ("qkv_stride", _I), ("tokens", _I), ("num_heads", _I), ("num_kv_heads", _I),
                ("head_dim", _I), ("positions", _P), ("cos", _P), ("sin", _P), ("max_positions", _I),
                ("q_weight", _P), ("k_weight", _P), ("eps", ctypes.c_float), ("k_cache", _P), ("v_cache", _P),
                ("num_slots", _I), ("slot_mapping", _P), ("q_out", _P), ("k_out", _P)]


def _check_qkv(qkv, positions, cos, sin, q_weight, k_weight, num_heads, num_kv_heads, k_cache, v_cache,
               slot_mapping) -> int:
    """Everything the kernel indexes by; returns head_dim."""
    D = cos.shape[-1]
    T = qkv.shape[0]
    ok = (qkv.dim() == 2 and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * D and qkv.stride(1) == 1
          and D % 2 == 0 and cos.shape == sin.shape and cos.dim() == 2 and cos.dtype == sin.dtype == qkv.dtype
          and cos.is_contiguous() and sin.is_contiguous()
          and positions.shape == (T,) and slot_mapping.shape == (T,)
          and positions.dtype == slot_mapping.dtype == torch.int64
          and positions.is_contiguous() and slot_mapping.is_contiguous()
          and k_cache.shape == v_cache.shape and k_cache.dim() == 4 and k_cache.shape[0] == num_kv_heads
          and k_cache.shape[-1] == D and k_cache.is_contiguous() and v_cache.is_contiguous()
          and k_cache.dtype == v_cache.dtype == qkv.dtype
          and all(w is None or (w.shape == (D,) and w.is_contiguous() and w.dtype == qkv.dtype)
                  for w in (q_weight, k_weight)) and (q_weight is None) == (k_weight is None))
    if not ok:
        raise ValueError(f"qkv_rope: qkv {tuple(qkv.shape)} {qkv.dtype}, {num_heads}/{num_kv_heads} heads, rope "
                         f"table {tuple(cos.shape)}, cache {tuple(k_cache.shape)}, positions / slots "
                         f"{tuple(positions.shape)} / {tuple(slot_mapping.shape)}")
    return D


def _qkv_rope_impl(qkv, positions, cos, sin, q_weight, k_weight, eps: float, num_heads: int, num_kv_heads: int,
                   k_cache, v_cache, slot_mapping):
    D = _check_qkv(qkv, positions, cos, sin, q_weight, k_weight, num_heads, num_kv_heads, k_cache, v_cache,
                   slot_mapping)
    T = qkv.shape[0]
    q = torch.empty(T, num_heads, D, dtype=qkv.dtype)
    k = torch.empty(T, num_kv_heads, D, dtype=qkv.dtype)
    args = _QKVArgs(qkv.data_ptr(), qkv.stride(0), T, num_heads, num_kv_heads, D, positions.data_ptr(),
                    cos.data_ptr(), sin.data_ptr(), cos.shape[0],
                    q_weight.data_ptr() if q_weight is not None else None,
                    k_weight.data_ptr() if k_weight is not None else None, eps,
                    k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[1] * k_cache.shape[2],
                    slot_mapping.data_ptr(), q.data_ptr(), k.data_ptr())
    native.call(_fn("qkv_rope", qkv.dtype), args, _qkv_out_of_range)
    return q, k


def _qkv_out_of_range(status: int) -> None:
    raise IndexError("qkv_rope: a position is past the rope table or a slot past the KV cache")


def qkv_rope(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float, num_heads: int,
             num_kv_heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A step's q [T, H, D] and k [T, KVH, D] from its qkv projection [T, (H + 2 KVH) D]: q/k RMSNorm-ed by
    q_weight / k_weight (None: no q/k norm), rotated at `positions` by the tables cos / sin [max_positions, D] in
    qkv's dtype (RotaryEmbedding.tables); k and v written to the KV cache at slot_mapping (kv_cache.write_kv), or None."""
    if not (applies(qkv, k_cache, v_cache) and (q_weight is None or applies(qkv, q_weight, k_weight))
            and cos.is_cpu and positions.is_cpu and slot_mapping.is_cpu):
        return None
    args = (qkv, positions, cos, sin, q_weight, k_weight, eps, num_heads, num_kv_heads, k_cache, v_cache,
            slot_mapping)
    return _qkv_rope_impl(*args) if native.eager() else torch.ops.loraserve.qkv_rope(*args)


# ---- greedy sampling ----------------------------------------------------------------------------------------
def _argmax_impl(logits):
    rows = _rows(logits)
    out = torch.empty(rows.shape[0], dtype=torch.int64)
    _fn("argmax", logits.dtype)(rows.data_ptr(), rows.stride(0), rows.shape[0], rows.shape[1], out.data_ptr())
    return out


def argmax(logits: torch.Tensor) -> torch.Tensor | None:
    """logits [B, V].argmax(-1) (torch's: the first maximum, the first NaN where a row has one), or None."""
    if logits.dim() != 2 or not applies(logits):
        return None
    return _argmax_impl(logits) if native.eager() else torch.ops.loraserve.argmax(logits)


# ---- the torch ops (captured decode, FakeTensor mode, torch.compile) ----------------------------------------
_LIB = torch.library.Library("loraserve", "FRAGMENT")   # beside cpu_attention.py's and cpu_sgmv.py's ops
_LIB.define("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor")
_LIB.define("add_rms_norm(Tensor x, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)")
_LIB.define("silu_and_mul(Tensor x) -> Tensor")
_LIB.define("argmax(Tensor logits) -> Tensor")
_LIB.define("qkv_rope(Tensor qkv, Tensor positions, Tensor cos, Tensor sin, Tensor? q_weight, Tensor? k_weight, "
            "float eps, int num_heads, int num_kv_heads, Tensor(a!) k_cache, Tensor(b!) v_cache, "
            "Tensor slot_mapping) -> (Tensor, Tensor)")
_LIB.impl("rms_norm", native.recordable(lambda x, weight, eps: _rms_norm_impl(x, weight, eps)[0]), "CPU")
_LIB.impl("add_rms_norm",
          native.recordable(lambda x, delta, weight, eps: _rms_norm_impl(x, weight, eps, delta)[::-1]), "CPU")
_LIB.impl("silu_and_mul", native.recordable(_silu_and_mul_impl), "CPU")
_LIB.impl("argmax", _argmax_impl, "CPU")
_LIB.impl("qkv_rope", native.recordable(_qkv_rope_impl), "CPU")


def _fake_qkv_rope(qkv, positions, cos, sin, q_weight, k_weight, eps, num_heads, num_kv_heads, k_cache, v_cache,
                   slot_mapping):
    D = _check_qkv(qkv, positions, cos, sin, q_weight, k_weight, num_heads, num_kv_heads, k_cache, v_cache,
                   slot_mapping)
    return qkv.new_empty(qkv.shape[0], num_heads, D), qkv.new_empty(qkv.shape[0], num_kv_heads, D)


torch.library.register_fake("loraserve::rms_norm", lambda x, weight, eps: x.new_empty(x.shape), lib=_LIB)
torch.library.register_fake("loraserve::add_rms_norm",
                            lambda x, delta, weight, eps: (x.new_empty(x.shape), x.new_empty(x.shape)), lib=_LIB)
torch.library.register_fake("loraserve::silu_and_mul",
                            lambda x: x.new_empty(*x.shape[:-1], x.shape[-1] // 2), lib=_LIB)
torch.library.register_fake("loraserve::qkv_rope", _fake_qkv_rope, lib=_LIB)
torch.library.register_fake("loraserve::argmax", lambda logits: logits.new_empty(logits.shape[0], dtype=torch.int64),
                            lib=_LIB)
