"""Request routing across LLMServer replicas: adapter affinity (policy.py) on Serve's router API (router.py)."""
