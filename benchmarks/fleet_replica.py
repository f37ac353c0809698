"""One LLMServer replica in the fleet simulation (benchmarks/fleet_sim.py): its adapter loads and its engine's steps.

What it models, and where the rule comes from:
- Arrival (deployments/replica_adapters.py `_adapter_for_request`): the request first goes through Serve's
  multiplexed loader, which loads an adapter it does not hold under one replica-wide lock (ray/serve/multiplex.py
  `load_model`, `_model_cache_lock`): cold loads are serialised, `disk_load_s` each. The host cache is an LRU of
  `max_loaded_loras`; an adapter that running requests use is never evicted (lora/cache.py reference counts), nor
  here one that a waiting request needs (the engine would read it again at admission: a second cold load).
- Admission (workers/controller.py `_admit`): waiting requests in arrival order; one whose adapter would be a
  distinct adapter past `max_loras_per_batch` is skipped (not a stop); `max_num_seqs` and the step's token
  budget (`max_num_batched_tokens`, decodes first, prefill chunks after) stop it. The budget's rotation among
  waiting adapters (workers/lora_budget.py) and KV-block limits are not modelled.
- A step: every running decode gives one token, prefill chunks fill the rest of the token budget; a prompt's
  last chunk gives its first token. An adapter entering the step without a device slot (LRU of
  `max_loras_per_batch` slots) is copied in first (`slot_load_s`). Its time is the calibrated linear cost
  (StepCosts) plus the serving work of the tokens it gives (`per_token_s`: the replica's streaming, Serve's
  handle, the ingress and the proxy, which share the replicas' cores on this machine), stretched when replicas
  share cores (fleet_sim.py `Scenario.cores`: the real benchmark's size on this machine).
- Prefetch (deployments/routing/prefetch.py, lora/cache.py `prefetch`): a home adapter's read into free room, or
  in place of the least recently used of the `victims` (adapters this replica is not the home of) that nothing
  holds; never in place of another.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field


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
        self.waiting: deque[SimRequest] = deque()
        self.prefilling: list[SimRequest] = []
        self.decoding: int = 0
        self.finishing: dict[int, list[SimRequest]] = {}    # step number -> requests whose last token it gives
        self.uses: dict[str, int] = {}                      # adapter -> running requests (slot holders)
        self.queued: dict[str, int] = {}                    # adapter -> waiting requests
        self.in_flight = 0
        self.step_no = 0
        self.busy = False                                   # a step is running
        self.cold_loads = 0
        self.steps = 0
        self.adapters_per_step = 0

    # ---- arrival and adapter loads ------------------------------------------------------------------------
    def arrive(self, req: SimRequest) -> str | None:
        """Returns the adapter whose cold load must start now (the caller schedules `loaded`), else None."""
        self.in_flight += 1
        req.replica = self.index
        req.hit = req.adapter in self.host
        if req.hit:
            self.host.move_to_end(req.adapter)
            self._queue(req)
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

    def loaded(self, adapter: str) -> str | None:
        """A cold load ended: the adapter is in host memory; returns the next load to start, if any."""
        assert self.loading[0] == adapter
        self.loading.popleft()
        self._evict_for_one()
        self.host[adapter] = None
        for req in self.blocked.pop(adapter):
            self._queue(req)
        return self.loading[0] if self.loading else None

    def _queue(self, req: SimRequest) -> None:
        self.waiting.append(req)
        self.queued[req.adapter] = self.queued.get(req.adapter, 0) + 1

    def _evict_for_one(self) -> None:
        while len(self.host) >= self.spec.max_loaded_loras:
            victim = next((a for a in self.host if a not in self.uses and a not in self.queued), None)
            if victim is None:
                return                      # every cached adapter is in use: the cache grows past its size
            del self.host[victim]
            self.slots.pop(victim, None)

    def evicts_next(self) -> str | None:
        if len(self.host) < self.spec.max_loaded_loras:
            return None
        return next((a for a in self.host if a not in self.uses and a not in self.queued), None)

    # ---- a step -------------------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.decoding)

    def start_step(self) -> float:
        """Schedule one step (admission, prefill chunks, slot loads); returns its duration."""
        spec = self.spec
        budget = spec.max_num_batched_tokens - self.decoding
        prefill_tokens, chunks = 0, []
        for req in self.prefilling:
            if budget <= 0:
                break
            n = min(req.prefill_left, budget)
            chunks.append((req, n))
            budget -= n
        running = self.decoding + len(self.prefilling)
        skipped: deque[SimRequest] = deque()
        while self.waiting and budget > 0 and running < spec.max_num_seqs:
            req = self.waiting.popleft()
            if req.adapter not in self.uses and len(self.uses) >= spec.max_loras_per_batch:
                skipped.append(req)
                continue
            self.uses[req.adapter] = self.uses.get(req.adapter, 0) + 1
            left = self.queued[req.adapter] - 1
            if left:
                self.queued[req.adapter] = left
            else:
                del self.queued[req.adapter]
            self.host.move_to_end(req.adapter)
            req.prefill_left = req.prompt_tokens
            self.prefilling.append(req)
            n = min(req.prompt_tokens, budget)
            chunks.append((req, n))
            budget -= n
            running += 1
        skipped.extend(self.waiting)
        self.waiting = skipped
        slot_loads = 0
        for adapter in self.uses:
            if adapter in self.slots:
                self.slots.move_to_end(adapter)
                continue
            if len(self.slots) >= spec.max_loras_per_batch:
                victim = next(a for a in self.slots if a not in self.uses)
                del self.slots[victim]
            self.slots[adapter] = None
            slot_loads += 1
        for req, n in chunks:
            req.prefill_left -= n
            prefill_tokens += n
        self._chunks = chunks
        self.busy = True
        self.steps += 1
        self.adapters_per_step += len(self.uses)
        tokens = self.decoding + sum(req.prefill_left == 0 for req, _ in chunks)
        return self.costs.step_s(self.decoding + len(chunks), len(self.uses), prefill_tokens, slot_loads, tokens)

    def end_step(self, now: float) -> list[SimRequest]:
        """Tokens of the step: first tokens of finished prompts, decodes; returns the requests that ended."""
        self.busy = False
        self.step_no += 1
        ended = self.finishing.pop(self.step_no, [])
        self.decoding -= len(ended)
        for req, _ in self._chunks:
            if req.prefill_left == 0:
                req.first_token_at = now
                if req.output_tokens <= 1:
                    ended.append(req)
                else:
                    self.decoding += 1
                    self.finishing.setdefault(self.step_no + req.output_tokens - 1, []).append(req)
        self.prefilling = [r for r in self.prefilling if r.prefill_left > 0]
        for req in ended:
            req.finished_at = now
            self.in_flight -= 1
            left = self.uses[req.adapter] - 1
            if left:
                self.uses[req.adapter] = left
            else:
                del self.uses[req.adapter]
        return ended
