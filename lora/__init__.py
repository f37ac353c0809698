"""LoRA adapters: format, validation, host cache, device slots, backends, layers.

Imports nothing from `workers/` or `deployments/`. Nothing is imported here: the modules that only name
things (lora.names, lora.backend_names, lora.modules, lora.errors) stay free of torch for the ingress.
"""
