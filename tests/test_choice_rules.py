"""n and best_of: one set of rules (deployments/choices.py) for HTTP bodies and handle calls alike, so a handle
caller cannot start more sequences than an HTTP caller can."""
import asyncio

import pytest
from pydantic import ValidationError

from deployments import protocol as oai
from deployments.choices import MAX_CHOICES, check_choices
from deployments.llm_server import LLMServer


@pytest.mark.parametrize("n, best_of, stream, match", [
    (MAX_CHOICES + 1, None, False, "n must be an integer"), (0, None, False, "n must be"),
    (True, None, False, "n must be"), (2, 1, False, r"best_of \(1\) must be >= n \(2\)"),
    (1, MAX_CHOICES + 1, False, "best_of must be"), (1, 2, True, "cannot be streamed"),
])
def test_the_rules(n, best_of, stream, match):
    with pytest.raises(ValueError, match=match):
        check_choices(n, best_of, stream)


def test_http_and_handle_share_them():
    check_choices(MAX_CHOICES, MAX_CHOICES, stream=True)
    with pytest.raises(ValidationError, match="cannot be streamed"):
        oai.CompletionRequest(model="m", prompt="x", n=1, best_of=2, stream=True)
    # the handle methods check before anything else (no engine is touched: `self` is None here)
    with pytest.raises(ValueError, match="n must be an integer"):
        asyncio.run(LLMServer.generate_choices(None, "x", n=MAX_CHOICES + 1))
    with pytest.raises(ValueError, match=r"best_of \(2\) must be >= n \(3\)"):
        asyncio.run(LLMServer.generate_choices(None, "x", n=3, best_of=2))
    with pytest.raises(ValueError, match=r"best_of \(3\) > n ranks the choices by their logprobs"):
        asyncio.run(LLMServer.generate_choices(None, "x", {"logprobs": False}, n=2, best_of=3))
    with pytest.raises(ValueError, match="n must be an integer"):
        asyncio.run(anext(LLMServer.generate_stream(None, "x", n=0)))
