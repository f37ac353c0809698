"""ShmQueue: one writer, a few readers, pickled messages through a ring of shared-memory slots.

The per-step path of tensor parallelism (worker_group.py): the engine writes each step to every
rank, each rank writes its answer back on a queue of its own. A Ray call per rank per step cost
~0.7 ms here; a write and a read of shared memory cost microseconds. The design is vLLM's
`MessageQueue` (vllm/distributed/device_communicators/shm_broadcast.py): a ring of fixed-size
slots, each with a sequence number the writer sets last, and a read counter per reader that the
writer checks before it reuses a slot. A message larger than a slot spans consecutive slots.
Ordering: x86 and ARM64 processes see a plain aligned 8-byte store whole; the writer stores the
payload before the sequence number and a reader reads the sequence number before the payload,
and the interpreter's calls in between order them (x86 keeps stores in order; numpy's stores
are calls, not reordered across by the compiler).

A waiter spins for a moment, then sleeps with a growing interval up to MAX_SLEEP_S: an idle rank
wakes ~1000 times a second (a fraction of a percent of a core) and sees a step at most
MAX_SLEEP_S late. `check` runs every CHECK_INTERVAL_S of waiting: the caller's liveness test.
"""
from __future__ import annotations

import os
import pickle
import time
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from typing import Callable

import numpy as np

SPIN_S = 100e-6          # busy-wait this long (sched_yield between polls) before sleeping
MAX_SLEEP_S = 1e-3       # the longest sleep between polls: the bound on waking up for a step after idle
CHECK_INTERVAL_S = 0.05


class QueueTimeout(TimeoutError):
    pass


def wait_until(ready: Callable[[], bool], timeout_s: float | None = None, check: Callable[[], None] | None = None,
               max_sleep_s: float = MAX_SLEEP_S, spin_s: float = SPIN_S) -> None:
    """Poll `ready` (spin, then back off); raise QueueTimeout past `timeout_s`; call `check` now and then."""
    if ready():
        return
    start = time.monotonic()
    spin_until, next_check, sleep = start + spin_s, start + CHECK_INTERVAL_S, 10e-6
    while not ready():
        now = time.monotonic()
        if now < spin_until:
            os.sched_yield()
            continue
        if check is not None and now >= next_check:
            check()
            next_check = now + CHECK_INTERVAL_S
        if timeout_s is not None and now - start > timeout_s:
            raise QueueTimeout(f"no progress within {timeout_s:.0f}s")
        time.sleep(sleep)
        sleep = min(sleep * 2, max_sleep_s)


def attach(name: str) -> shared_memory.SharedMemory:
    """Open a segment another process created and owns: this process's resource tracker must not unlink it
    when we exit (Python < 3.13 registers every attach; `track=False` came in 3.13). Not unregistered after the
    fact: a child started by multiprocessing shares its parent's tracker, which would lose the creator's entry."""
    register = resource_tracker.register
    resource_tracker.register = lambda name, rtype: None
    try:
        return shared_memory.SharedMemory(name=name)
    finally:
        resource_tracker.register = register


@dataclass(frozen=True)
class QueueHandle:
    """What a reader needs to open the queue in another process (picklable)."""
    name: str
    readers: int
    slots: int
    slot_bytes: int


class ShmQueue:
    """Header: per slot [sequence, payload bytes, more-follows], then one read counter per reader; then the slots.

    Sequence numbers start at 1 and never repeat, so a slot's number says which message chunk it holds."""

    def __init__(self, handle: QueueHandle, segment: shared_memory.SharedMemory, reader: int | None,
                 owner: bool = False):
        self.handle, self.segment, self.reader, self.owner = handle, segment, reader, owner
        words = 3 * handle.slots + handle.readers
        self._header = np.ndarray((words,), np.int64, buffer=segment.buf)
        self._slot_info = self._header[:3 * handle.slots].reshape(handle.slots, 3)
        self._read = self._header[3 * handle.slots:]
        self._data = segment.buf[8 * words:8 * words + handle.slots * handle.slot_bytes]
        self._next = 1   # the writer's next sequence number, or this reader's next to read

    @classmethod
    def create(cls, readers: int, slots: int = 8, slot_bytes: int = 1 << 20) -> ShmQueue:
        size = 8 * (3 * slots + readers) + slots * slot_bytes
        segment = shared_memory.SharedMemory(create=True, size=size)
        segment.buf[:8 * (3 * slots + readers)] = bytes(8 * (3 * slots + readers))
        return cls(QueueHandle(segment.name, readers, slots, slot_bytes), segment, None, owner=True)

    @classmethod
    def open(cls, handle: QueueHandle, reader: int | None) -> ShmQueue:
        """Another process's queue, as its reader number `reader`, or as its writer (None)."""
        return cls(handle, attach(handle.name), reader)

    # ---- writer ------------------------------------------------------------------
    def put(self, message, timeout_s: float | None = None, check: Callable[[], None] | None = None) -> None:
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        size, slots = self.handle.slot_bytes, self.handle.slots
        for offset in range(0, max(len(payload), 1), size):
            seq = self._next
            # the slot's previous chunk (seq - slots) must have been read by every reader
            wait_until(lambda: int(self._read.min()) >= seq - slots, timeout_s, check)
            slot = (seq - 1) % slots
            chunk = payload[offset:offset + size]
            self._data[slot * size:slot * size + len(chunk)] = chunk
            self._slot_info[slot, 1] = len(chunk)
            self._slot_info[slot, 2] = offset + size < len(payload)
            self._slot_info[slot, 0] = seq   # last: publishes the chunk
            self._next = seq + 1

    # ---- reader ------------------------------------------------------------------
    def get(self, timeout_s: float | None = None, check: Callable[[], None] | None = None,
            max_sleep_s: float = MAX_SLEEP_S, spin_s: float = SPIN_S):
        size, slots, parts = self.handle.slot_bytes, self.handle.slots, []
        while True:
            seq, slot = self._next, (self._next - 1) % slots
            wait_until(lambda: self._slot_info[slot, 0] == seq, timeout_s, check, max_sleep_s, spin_s)
            nbytes, more = int(self._slot_info[slot, 1]), bool(self._slot_info[slot, 2])
            parts.append(bytes(self._data[slot * size:slot * size + nbytes]))
            self._read[self.reader] = seq   # the writer may reuse the slot now
            self._next = seq + 1
            if not more:
                return pickle.loads(b"".join(parts))

    def close(self) -> None:
        """Drop this process's mapping; the creator also removes the segment."""
        self._header = self._slot_info = self._read = None
        self._data.release()
        self.segment.close()
        if self.owner:
            self.segment.unlink()
