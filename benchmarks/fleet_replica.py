"""One LLMServer replica in the fleet simulation (benchmarks/fleet_sim.py): its adapter loads and its engine's steps.

What it models, and where the rule comes from:
- Arrival (deployments/replica_adapters.py `_adapter_for_request`): the request first goes through Serve's
  multiplexed loader, which loads an adapter it does not hold under one replica-wide lock (ray/serve/multiplex.py
  `load_model`, `_model_cache_lock`): cold loads are serialised, `disk_load_s` each. The host cache is an LRU of
  `max_loaded_loras`; an adapter that running requests use is never evicted (lora/cache.py reference counts), nor
  here one that a waiting request needs (the engine would read it again at admission: a second cold load); a copy
  of another replica's home adapter goes first if it is in the older half (lora/cache.py `prefer_evicting`).
- Admission (benchmarks/fleet_admission.py): the engine's own LoRABudget and admission order, driven as
  workers/controller.py drives them: the budget rotates among waiting adapters by age, a holder paused for an
  older waiter keeps its sequence place and sits the step out; `max_num_seqs` and the step's token budget
  (`max_num_batched_tokens`, decodes first, prefill chunks after) stop admission. KV blocks are not modelled.
- A step: every running decode that is not paused gives one token, prefill chunks fill the rest of the token
  budget; a prompt's last chunk gives its first token. An adapter of the step without a device slot (LRU of
  `max_loras_per_batch` slots; a paused adapter's may go to another) is copied in first (`slot_load_s`). Its
  time is the calibrated linear cost (StepCosts) plus the serving work of the tokens it gives (`per_token_s`: the
  replica's streaming, Serve's handle, the ingress and the proxy, which share the replicas' cores on this
  machine), stretched when replicas share cores (fleet_sim.py `Scenario.cores`: the real benchmark's size here).
- Prefetch (deployments/routing/prefetch.py, lora/cache.py `prefetch`): a home adapter's read into free room, or
  in place of the least recently used of the `victims` (adapters this replica is not the home of) that nothing
  holds; never in place of another.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from benchmarks.fleet_admission import EngineQueues


@dataclass(frozen=True)
class StepCosts:
    base_s: float
    per_seq_s: float
    per_adapter_s: float
    per_prefill_token_s: float
    slot_load_s: float
    disk_load_s: float
    per_token_s: float = 0.0     # serving work of each token a step gives, outside the engine

    def step_s(self, seqs: int, adapters: int, prefill_tokens: int, slot_loads: int, tokens: int = 0) -> float:
        return (self.base_s + self.per_seq_s * seqs + self.per_adapter_s * adapters
                + self.per_prefill_token_s * prefill_tokens + self.slot_load_s * slot_loads
                + self.per_token_s * tokens)


@dataclass(frozen=True)
class ReplicaSpec:
    max_num_seqs: int
    max_loras_per_batch: int
    max_loaded_loras: int
    max_num_batched_tokens: int
    max_ongoing_requests: int


@dataclass(eq=False)
class SimRequest:
    at: float                    # arrival at the router
    adapter: str
    prompt_tokens: int
    output_tokens: int
    replica: int = -1
    routed_at: float = -1.0
    hit: bool = False            # its adapter was resident (host or device) on its replica when it arrived
    prefill_left: int = 0
    decode_left: int = 0         # tokens still to give after the first
    adapter_ref: str | None = None   # what workers/lora_budget.py reads of a sequence: set at admission
    lora_skips: int = 0
    # where its first token waited (benchmarks/fleet_waits.py): at its replica, in the engine's queue, admitted
    reached_at: float = -1.0
    queued_at: float = -1.0      # its adapter in host memory: in the engine's waiting queue
    admitted_at: float = -1.0
    queued_step: int = 0         # the engine's step count then
    admitted_step: int = 0
    budget_skips: int = 0        # steps it waited for room in the LoRA budget (lora_skips when admitted)
    full_at_queue: bool = False  # it found the engine's `max_num_seqs` places taken
    first_token_at: float = -1.0
    finished_at: float = -1.0
    attempts: int = 0
    context: object = field(default=None, repr=False)   # the router's per-request state


class Replica:
    def __init__(self, index: int, spec: ReplicaSpec, costs: StepCosts):
        self.index, self.spec, self.costs = index, spec, costs
        self.host: OrderedDict[str, None] = OrderedDict()   # LRU, most recent last
        self.slots: OrderedDict[str, None] = OrderedDict()
        self.loading: deque[str] = deque()                  # cold loads, one at a time (Serve's lock)
        self.blocked: dict[str, list[SimRequest]] = {}      # adapter -> requests waiting on its load
        self.engine = EngineQueues(spec.max_num_seqs, spec.max_loras_per_batch)
        self.uses: dict[str, int] = {}                      # adapter -> running requests, paused ones too
        self.queued: dict[str, int] = {}                    # adapter -> waiting requests
        self.in_flight = 0
        self.busy = False                                   # a step is running
        self.cold_loads = 0
        self.steps = 0
        self.adapters_per_step = 0
        self.evict_first: frozenset[str] = frozenset()      # its copies of other replicas' home adapters

    # ---- arrival and adapter loads ------------------------------------------------------------------------
    def arrive(self, req: SimRequest, now: float) -> str | None:
        """Returns the adapter whose cold load must start now (the caller schedules `loaded`), else None."""
        self.in_flight += 1
        req.replica, req.reached_at = self.index, now
        req.hit = req.adapter in self.host
        if req.hit:
            self.host.move_to_end(req.adapter)
            self._queue(req, now)
            return None
        first = req.adapter not in self.blocked
        self.blocked.setdefault(req.adapter, []).append(req)
        if not first:
            return None
        self.loading.append(req.adapter)
        self.cold_loads += 1
        return req.adapter if len(self.loading) == 1 else None

    def prefetch(self, adapter: str, victims: frozenset[str] = frozenset()) -> str | None:
        """A home adapter read ahead of requests (deployments/routing/prefetch.py); returns it if its load starts
        now. Queued with the cold loads (the engine reads it on a load thread: this is the slower case). A full
        cache first evicts the least recently used of `victims` that nothing holds, else nothing starts."""
        if adapter in self.host or adapter in self.blocked:
            return None
        if len(self.host) + len(self.loading) >= self.spec.max_loaded_loras:
            victim = next((a for a in self.host if a in victims and a not in self.uses and a not in self.queued),
                          None)
            if victim is None:
                return None
            del self.host[victim]
            self.slots.pop(victim, None)
        self.blocked[adapter] = []
        self.loading.append(adapter)
        return adapter if len(self.loading) == 1 else None

    def loaded(self, adapter: str, now: float) -> str | None:
        """A cold load ended: the adapter is in host memory; returns the next load to start, if any."""
        assert self.loading[0] == adapter
        self.loading.popleft()
        self._evict_for_one()
        self.host[adapter] = None
        for req in self.blocked.pop(adapter):
            self._queue(req, now)
        return self.loading[0] if self.loading else None

    def _queue(self, req: SimRequest, now: float) -> None:
        req.queued_at, req.queued_step = now, self.engine.step_count
        req.full_at_queue = len(self.engine.running) >= self.spec.max_num_seqs
        self.engine.waiting.append(req)
        self.queued[req.adapter] = self.queued.get(req.adapter, 0) + 1

    def _evict_for_one(self) -> None:
        while len(self.host) >= self.spec.max_loaded_loras:
            victim = self._victim()
            if victim is None:
                return                      # every cached adapter is in use: the cache grows past its size
            del self.host[victim]
            self.slots.pop(victim, None)

    def evicts_next(self) -> str | None:
        return self._victim() if len(self.host) >= self.spec.max_loaded_loras else None

    def _victim(self) -> str | None:
        """lora/cache.py `_victim`: the least recently used that nothing holds, a copy of another replica's home
        adapter first if one is in the older half."""
        evictable = [a for a in self.host if a not in self.uses and a not in self.queued]
        older = evictable[:max(1, len(evictable) // 2)]
        return next((a for a in older if a in self.evict_first), older[0] if older else None)

    # ---- a step -------------------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.engine.waiting or self.engine.running)

    def start_step(self, now: float) -> float:
        """Schedule one step (admission, prefill chunks, slot loads); returns its duration."""
        self._decodes, chunks, admitted = self.engine.schedule(self.spec.max_num_batched_tokens)
        for req, _ in admitted:
            req.admitted_at = now
            self.uses[req.adapter] = self.uses.get(req.adapter, 0) + 1
            left = self.queued[req.adapter] - 1
            if left:
                self.queued[req.adapter] = left
            else:
                del self.queued[req.adapter]
            self.host.move_to_end(req.adapter)
        chunks += admitted
        active = self.engine.active_adapters()
        slot_loads = 0
        for adapter in active:
            if adapter in self.slots:
                self.slots.move_to_end(adapter)
                continue
            if len(self.slots) >= self.spec.max_loras_per_batch:
                victim = next(a for a in self.slots if a not in active)
                del self.slots[victim]
            self.slots[adapter] = None
            slot_loads += 1
        prefill_tokens = 0
        for req, n in chunks:
            req.prefill_left -= n
            prefill_tokens += n
        self._chunks = chunks
        self.busy = True
        self.steps += 1
        self.adapters_per_step += len(active)
        tokens = len(self._decodes) + sum(req.prefill_left == 0 for req, _ in chunks)
        return self.costs.step_s(len(self._decodes) + len(chunks), len(active), prefill_tokens, slot_loads, tokens)

    def end_step(self, now: float) -> list[SimRequest]:
        """Tokens of the step: decodes, first tokens of finished prompts; returns the requests that ended."""
        self.busy = False
        ended = []
        for req in self._decodes:
            req.decode_left -= 1
            if not req.decode_left:
                ended.append(req)
        for req, _ in self._chunks:
            if req.prefill_left == 0:
                req.first_token_at = now
                req.decode_left = req.output_tokens - 1
                if req.decode_left <= 0:
                    ended.append(req)
        self.engine.finish(ended)
        for req in ended:
            req.finished_at = now
            self.in_flight -= 1
            left = self.uses[req.adapter] - 1
            if left:
                self.uses[req.adapter] = left
            else:
                del self.uses[req.adapter]
        return ended
