"""`make clients`: guidellm, lm-eval, LangChain and the Agents SDK against the demo server (run.py)."""
