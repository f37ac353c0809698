"""Cores shared by the fleet simulation's jobs (benchmarks/fleet_sim.py), as on the machine of the real benchmark.

There, 4 replicas' engines, their Serve actors, the ingress, the proxy and the client share 2 cores: a replica's
step is slower while other replicas step, and a request's way in is slower while many tokens stream out
(results/fleet_validation.md: a request's TTFT grows with the requests in flight on the whole fleet, not only on
its replica). Modelled as processor sharing: every job is one thread of CPU work; with n jobs running, each runs
at min(1, cores / (n + background)) of a core. Jobs: engine steps (their calibrated cost plus the serving work of
the tokens they give) and each request's serving path before its engine; `background`: the runnable threads of
everything else on the machine (Ray's own processes, the idle application, other users), on average.
"""
from __future__ import annotations

import itertools


class SharedCpu:
    def __init__(self, cores: float, clock, schedule, background: float = 0.0):
        """`schedule(t, handler, *args)`: the simulation's event queue; `clock()`: its time."""
        self.cores, self.clock, self.schedule, self.background = cores, clock, schedule, background
        self.jobs: dict[int, list] = {}   # job id -> [CPU seconds left, handler, args]
        self._ids = itertools.count()
        self._updated = 0.0
        self._version = 0                 # a finish event scheduled before the last change is stale

    def rate(self) -> float:
        return min(1.0, self.cores / (len(self.jobs) + self.background)) if self.jobs else 1.0

    def set_background(self, background: float) -> None:
        self._advance()
        self.background = background
        self._next_finish()

    def start(self, work_s: float, handler, *args) -> None:
        """Run `work_s` CPU seconds, then `handler(*args)`."""
        self._advance()
        self.jobs[next(self._ids)] = [work_s, handler, args]
        self._next_finish()

    def _advance(self) -> None:
        now = self.clock()
        done = (now - self._updated) * self.rate()
        for job in self.jobs.values():
            job[0] -= done
        self._updated = now

    def _next_finish(self) -> None:
        self._version += 1
        if self.jobs:
            job_id, job = min(self.jobs.items(), key=lambda item: item[1][0])
            self.schedule(self.clock() + max(0.0, job[0]) / self.rate(), self._finish, job_id, self._version)

    def _finish(self, job_id: int, version: int) -> None:
        if version != self._version:
            return
        self._advance()
        _, handler, args = self.jobs.pop(job_id)
        self._next_finish()
        handler(*args)
