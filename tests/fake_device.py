"""A fake NPU on the CPU: tensors "on the device" are told apart from host tensors, and any op that
mixes a host tensor into a device op raises, as NPUs and CUDA do ("Expected all tensors to be on
the same device"). The CPU suite cannot otherwise see such bugs: every tensor is on the CPU.

`install()` names torch's PrivateUse1 backend "npu" (what torch_npu does) and registers a minimal
`torch.npu` (device count, set_device, synchronize: nothing to do on the CPU), so `device="npu"`
parses without torch_npu. `FakeDevice()` is a context: factory calls asking for `DEVICE` (npu:0)
allocate host memory and hand back a `DeviceTensor` that reports device npu:0. Ops on device tensors run on their host
data and return device tensors; a host tensor of one or more dimensions among their inputs is an
error, except in the explicit transfers (`.to(device)` / `.cpu()`, `copy_` between the two, reading
a value back with `.item()` / `.tolist()`). Host 0-dim tensors pass, as devices take CPU scalars.
"""
from __future__ import annotations

import types

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

import workers.worker

DEVICE_TYPE = "npu"
aten = torch.ops.aten
# The explicit transfers: the only ops that may take tensors of both kinds. Under inference mode `.cpu()` /
# `.to(...)` reach a tensor subclass as aten.to.* (not decomposed into _to_copy).
TO_OPS = {aten._to_copy.default, aten.to.dtype_layout}
TRANSFERS = {*TO_OPS, aten.copy_.default, aten._local_scalar_dense.default}


class HostDeviceMix(RuntimeError):
    pass


def install() -> None:
    """Once per process (torch allows one PrivateUse1 name); refuses where a real torch_npu is loaded."""
    module = getattr(torch, DEVICE_TYPE, None)
    if module is not None:
        assert getattr(module, "IS_FAKE", False), "a real torch_npu is loaded: the fake device tier is CPU-only"
        return
    fake = types.ModuleType(f"torch.{DEVICE_TYPE}")
    fake.IS_FAKE = True
    fake.is_available, fake.device_count, fake.current_device = (lambda: True), (lambda: 1), (lambda: 0)
    fake.is_initialized, fake._is_in_bad_fork, fake._lazy_init = (lambda: True), (lambda: False), (lambda: None)
    fake.set_device = fake.synchronize = fake.manual_seed_all = lambda *args: None
    fake.get_device_name = lambda index=0: "Ascend910B1 (fake)"
    # torch's Python-backend hooks: a device guard and hooks for PrivateUse1, so that indexing and
    # device contexts work on tensors that report the device (their data stays on the host)
    _setup_privateuseone_for_python_backend(rename=DEVICE_TYPE, backend_module=fake)


install()
DEVICE = torch.device(DEVICE_TYPE, 0)


def _is_device(arg) -> bool:
    return (isinstance(arg, torch.device) and arg.type == DEVICE_TYPE
            or isinstance(arg, str) and arg.split(":")[0] == DEVICE_TYPE)


class DeviceTensor(torch.Tensor):
    """Host data, reported as on DEVICE."""

    @staticmethod
    def __new__(cls, host: torch.Tensor):
        assert not isinstance(host, DeviceTensor) and host.device.type == "cpu"
        out = torch.Tensor._make_wrapper_subclass(cls, host.size(), strides=host.stride(),
                                                  storage_offset=host.storage_offset(), dtype=host.dtype,
                                                  device=DEVICE, requires_grad=host.requires_grad)
        out.host = host
        return out

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self):
        return f"DeviceTensor({self.host!r})"

    def tolist(self):   # a read back to the host (a sync on a real device), not a mixing op
        return self.host.tolist()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves, _ = tree_flatten((args, kwargs))
        hosts = [t for t in leaves if isinstance(t, torch.Tensor) and not isinstance(t, DeviceTensor) and t.dim() > 0]
        if hosts and func not in TRANSFERS:
            raise HostDeviceMix(f"{func}: host tensor(s) {[tuple(t.shape) for t in hosts]} mixed into an op on "
                                f"{DEVICE} (Expected all tensors to be on the same device)")
        wrappers = {}

        def unwrap(t):
            if isinstance(t, DeviceTensor):
                wrappers[id(t.host)] = t
                return t.host
            return t

        to_host = func in TO_OPS and kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "cpu"
        host_args, host_kwargs = tree_map(unwrap, args), tree_map(unwrap, kwargs)
        if func in TO_OPS and _is_device(host_kwargs.get("device")):
            host_kwargs["device"] = torch.device("cpu")
        out = func(*host_args, **host_kwargs)
        if to_host:   # a copy, as from a device (aten.to may hand back its input)
            return out.clone() if id(out) in wrappers else out
        if func is aten.copy_.default and not isinstance(args[0], DeviceTensor):
            return args[0]   # device -> host copy into a host tensor

        # Wrappers made under inference mode are inference tensors; a view of a tensor made outside it must
        # not be one (torch refuses to set its version counter), so new wrappers follow their inputs.
        inference = any(t.is_inference() for t in wrappers.values()) if wrappers else torch.is_inference_mode_enabled()

        def wrap(t):
            if isinstance(t, torch.Tensor) and not isinstance(t, DeviceTensor):
                own = wrappers.get(id(t))   # in place / out=: the caller's own tensor
                if own is not None:
                    return own
                with torch.inference_mode(inference):
                    return DeviceTensor(t)
            return t

        return tree_map(wrap, out)


class FakeDevice(TorchDispatchMode):
    """Allocations asking for DEVICE become DeviceTensors; so do host->device transfers. A worker created
    inside asks to pin host memory (it holds its device); this host has no pinned allocator, so the ask is
    recorded in `pin_requests` and copies stay pageable."""

    def __enter__(self):
        self.pin_requests: list[bool] = []
        self._allow_pinning = workers.worker.allow_pinning
        workers.worker.allow_pinning = self.pin_requests.append
        return super().__enter__()

    def __exit__(self, *exc):
        workers.worker.allow_pinning = self._allow_pinning
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_device(kwargs.get("device")) and not any(isinstance(a, DeviceTensor) for a in tree_flatten(args)[0]):
            kwargs["device"] = torch.device("cpu")
            kwargs.pop("pin_memory", None)
            out = func(*args, **kwargs)
            return tree_map(lambda t: DeviceTensor(t) if isinstance(t, torch.Tensor) else t, out)
        return func(*args, **kwargs)


def on_device(t: torch.Tensor) -> bool:
    return isinstance(t, DeviceTensor)
