"""The Ascend LoRA backend's start-up probe: which contract (lora/backends/ascend.py's TODAY or PR676) the
installed sgl_kernel_npu kernels follow, told by their op schemas and a tiny known-answer call of sgmv and bgmv
under each, once per (device, dtype, op namespace); and, for lora.backends.get_backend, why the ascend backend
cannot serve here (a 310P chip, a dtype without kernels, sgl_kernel_npu absent or of an unknown contract)."""
from __future__ import annotations

import importlib.metadata
import logging

import torch

from lora.backends import ascend
from lora.backends.ascend import CONTRACTS, SCHEMAS, SGL_KERNEL_NPU_COMMIT, SGL_KERNEL_NPU_VERSION, TODAY, Contract
from lora.transfer import to_device

log = logging.getLogger(__name__)


def _installed_version() -> str:
    try:   # the package's own metadata has lagged its releases: the probe checks behaviour instead
        return importlib.metadata.version("sgl_kernel_npu")
    except importlib.metadata.PackageNotFoundError:
        return "(no package metadata)"


ADVICE = (f"install sgl-kernel-npu {SGL_KERNEL_NPU_VERSION} (commit {SGL_KERNEL_NPU_COMMIT}) built for your CANN "
          f"toolkit and SoC (docs/deployment.md: 'Run on a Ray cluster of NPUs'), or set lora_backend: torch_native")


def _kernel_ops(ops):
    """The op namespace holding the kernels: `ops`, else torch.ops.npu once sgl_kernel_npu registered them."""
    if ops is not None:
        return ops
    if not hasattr(torch.ops.npu, "sgmv_shrink"):
        try:
            import sgl_kernel_npu  # noqa: F401  registers torch.ops.npu.* (needs torch_npu and CANN)
        except Exception as exc:   # absent (ImportError), or a build for another CANN / torch (OSError, ...)
            raise RuntimeError(f"sgl_kernel_npu is not importable ({exc.__class__.__name__}: {exc}); {ADVICE}") from exc
    return torch.ops.npu


def _synchronize(device: torch.device) -> None:
    """A kernel's device-side failure surfaces here (launches are asynchronous)."""
    if device.type != "cpu":
        getattr(torch, device.type).synchronize()


def _known_answer(ops, device: torch.device, dtype: torch.dtype, by_token: bool, contract: Contract) -> str | None:
    """One tiny call under `contract` against torch's result (small integers: exact in every dtype, the
    rank buffer's included); None if equal, else what went wrong."""
    T, in_dim, R, out = 3, 32, 16, 16
    small = lambda n, shape: ((torch.arange(n) % 3) - 1).reshape(shape)  # noqa: E731
    x, a, b = small(T * in_dim, (T, in_dim)), small(2 * R * in_dim, (2, R, in_dim)), small(2 * out * R, (2, out, R))
    slots = [1, -1, 0]
    y0 = torch.ones(T, out)
    expected = y0.clone()
    for t, slot in enumerate(slots):
        if slot >= 0:
            expected[t] += b[slot] @ (a[slot] @ x[t])

    def indices(values: list[int]) -> torch.Tensor:
        # in the contract's dtype, zero-padded to twice its length: a kernel reading them at the other width
        # (int64 as int32 or back) still finds indices in range or negative, never a read past the weights
        return to_device([*values, *[0] * len(values)], device, contract.index_dtype)[:len(values)]

    index = (indices(slots),) if by_token else (indices(slots), indices([1] * T))
    try:   # a kernel's host check raises at the call, its device-side error at the synchronisation
        y = y0.to(device, dtype)
        ascend.run_kernels(y, x.to(device, dtype), a.to(device, dtype), (b.to(device, dtype),), (0, out), index,
                           by_token, ops, contract)
        _synchronize(device)
        got = y.float().cpu()
    except Exception as exc:
        return f"{exc.__class__.__name__}: {''.join(str(exc).strip().splitlines()[:1])}"
    return None if torch.equal(got, expected) else f"wrong result {got.tolist()}, expected {expected.tolist()}"


def probe(device: torch.device | str, dtype: torch.dtype, ops=None) -> Contract | None:
    """At start-up: which contract (TODAY or PR676) the installed kernels follow, by their op schemas and a
    tiny known-answer call of sgmv and bgmv under each (today's first: PR #676's TORCH_CHECKs refuse its
    int64 indices, so a call never reads indices of the wrong width on a kernel that checks). None when
    nothing of the kernels is used for `dtype` here; RuntimeError naming both contracts when neither
    gives the known answer. `ops`: the op namespace (default torch.ops.npu, importing sgl_kernel_npu)."""
    device = torch.device(device)
    if dtype not in ascend.device_dtypes(device):
        return None   # every call falls back to the torch ops: nothing of the kernels is used
    ops = _kernel_ops(ops)
    for name, types in SCHEMAS.items():
        packet = getattr(ops, name, None)
        got = tuple(str(arg.type) for arg in packet.default._schema.arguments) if packet is not None else None
        if got != types:
            found = "is missing" if got is None else f"takes {got}, expected {types}"
            raise RuntimeError(f"sgl_kernel_npu {_installed_version()}: op {name} {found}; {ADVICE}")
    failures = []
    for contract in CONTRACTS:
        wrong = next((f"{kind} {w}" for by_token, kind in ((False, "sgmv"), (True, "bgmv"))
                      if (w := _known_answer(ops, device, dtype, by_token, contract))), None)
        if wrong is None:
            if contract is not TODAY:
                log.warning("sgl_kernel_npu %s follows %s, not %s: calling it that way", _installed_version(),
                            contract, TODAY)
            return contract
        failures.append(f"with the conventions of {contract}: {wrong}")
    raise RuntimeError(f"sgl_kernel_npu {_installed_version()} follows neither contract this backend knows ("
                       + "; ".join(failures) + f"); {ADVICE}")


_PROBED: dict[tuple, Contract | None] = {}   # (device, dtype, ops) -> the probe's answer, once per process


def installed_contract(device: torch.device | str, dtype: torch.dtype, ops=None) -> Contract | None:
    """`probe`'s answer, probed once per (device, dtype, op namespace); raises as `probe` does."""
    key = str(torch.device(device)), dtype, id(ops) if ops is not None else None
    if key not in _PROBED:
        _PROBED[key] = probe(device, dtype, ops=ops)
    return _PROBED[key]


def unavailable_reason(device: torch.device | str, dtype: torch.dtype, ops=None) -> str | None:
    """The "kernels absent -> torch_native" decision (lora.backends.get_backend): why the ascend backend cannot
    serve `dtype` on `device` (a 310P chip, a dtype without kernels, sgl_kernel_npu absent or of an unknown
    contract), as one message; None: it can (the probe passed)."""
    device = torch.device(device)
    dtypes = ascend.device_dtypes(device)
    if not dtypes:
        return (f"{ascend._device_name(device.index or 0)}: sgl-kernel-npu has no build for 310P chips "
                f"(vllm-ascend runs the torch ops there too)")
    if dtype not in dtypes:
        return f"sgl_kernel_npu has no {dtype} kernels (only {', '.join(str(d) for d in dtypes)})"
    try:
        installed_contract(device, dtype, ops=ops)
    except RuntimeError as exc:
        return str(exc)
    return None
