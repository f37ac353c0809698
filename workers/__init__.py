"""The engine: config, controller, workers, model runner, models, TP layers, KV cache, graphs, devices."""
from workers.config import EngineConfig, SamplingParams
from workers.engine import LLMEngine
from workers.sequence import RequestOutput

__all__ = ["EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams"]
