"""What Serve and the request router read of an LLMServer replica: `check_health` (Serve's health check:
raising replaces the replica), `record_routing_stats` (what deployments/routing/router.py reads), `is_healthy`
(the ingress's /health) and `stats` (callers, the adapter mirror's reports).

Apart from deployments/llm_server.py because none of it serves a request: it reports on the replica from the
engine's stats and the replica's metrics. A mixin of LLMServer, as deployments/replica_adapters.py is: it uses
the replica's `engine`, `metrics`, `adapters`, `replica_id` and `_routing_limits`, set in LLMServer.__init__.
"""
from __future__ import annotations

from typing import Any


class ReplicaHealth:
    async def stats(self) -> dict[str, Any]:
        engine = await self.engine.stats()
        self.metrics.record_engine(engine)
        return {"replica_id": self.replica_id, "healthy": self.engine.is_healthy(), "engine": engine,
                "adapters_loaded": sorted(self.adapters.loaded), "metrics": self.metrics.totals(),
                "vllm": self.metrics.vllm.snapshot()}

    async def record_routing_stats(self) -> dict[str, Any]:
        """What the request router reads (deployments/routing/router.py), every routing_stats_period_s."""
        engine = await self.engine.stats()
        lora = engine.get("lora", {})
        prefetcher = getattr(self, "_prefetcher", None)   # adapter-affinity routing only
        return {**self._routing_limits, "load": engine["running"] + engine["waiting"],
                **lora.get("residency", {}), "requests": lora.get("requests", {}),
                **({"homes": prefetcher.homes} if prefetcher else {})}

    async def is_healthy(self) -> bool:
        return await self.engine.check_health()

    async def check_health(self) -> None:
        """Called by Serve every health_check_period_s; raising makes Serve replace this replica."""
        if not await self.engine.check_health():
            raise RuntimeError(f"replica {self.replica_id}: the engine or one of its workers is dead "
                               f"({self.engine.error or 'a worker does not answer'})")
