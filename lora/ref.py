"""One adapter version's identity, made once when it is registered and carried from the engine's registry of
adapters (workers/adapters.py) to the device slots and the tensor-parallel ranks (docs/adapters-internals.md).

A name is what users ask for; a version is the content digest of the weights read for it. Two loads of a
name that read the same weights are the same version: they share host memory, a slot and cached KV. Loads
that read other weights are another version, served beside the old one until its last request ends.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, order=True)
class AdapterRef:
    name: str
    version: str                              # content digest of the weights (workers/adapters.content_version)
    # where it was read from and whether it keeps its slot, as registered: not part of the identity (the same
    # weights from another path are the same version; pinning does not change the weights)
    source: str = field(default="", compare=False)
    pinned: bool = field(default=False, compare=False)
    has_experts: bool = field(default=False, compare=False)   # MoE expert weights: it takes an expert slot too

    @property
    def prefix_key(self) -> bytes:
        """The identity the KV computed under these weights is cached by (workers/block_pool.hash_root)."""
        return f"{self.name}\0{self.version}".encode()

    def __str__(self) -> str:   # how messages name it: users know adapters by name
        return self.name
