"""The ingress replica parses, routes and relays; it never runs a model, so it must not load one's libraries.

Every Serve app starts an ingress replica (a new process): importing torch and transformers there cost ~4.5 s of a
core and ~210 MB per replica (6.4 s / 332 MB against 1.8 s / 123 MB, measured on the CI machine). The modules
below are what the ingress and a config's validation import, and the modules of Serve's app builder
(`deployments.app`, imported by every `serve deploy` and the CLI) and of the LLM replica (whose engine runs in a
process of its own); a new top-level import of an engine library in any of them fails here, naming the chain.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from processes import REPO

ENGINE_LIBRARIES = ("torch", "transformers", "safetensors", "xgrammar", "peft")
MODULES = ["deployments.openai_api", "deployments.config", "deployments.adapter_registry", "deployments.llm_server",
           "deployments.app", "workers.config", "workers.errors", "lora.names"]
# One process imports the modules in turn: a module whose import reaches an engine library gets the chain that
# did; what an earlier module imported was checked then (none of it is an engine library).
PROBE = """
import json, sys, traceback
banned = set(sys.argv[1].split(","))
class Banned(BaseException):
    pass
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in banned:
            chain = [f"{'/'.join(f.filename.split('/')[-2:])}:{f.lineno}" for f in traceback.extract_stack()[:-1]
                     if not f.filename.startswith("<")]
            raise Banned(f"{name} imported by {' <- '.join(reversed(chain))}")
sys.meta_path.insert(0, Refuse())
found = {}
for module in sys.argv[2:]:
    try:
        __import__(module)
        found[module] = None
    except Banned as exc:
        found[module] = str(exc)
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def engine_imports() -> dict[str, str | None]:
    """Per module of MODULES: None, or the engine library its import reached and the chain that did."""
    probe = subprocess.run([sys.executable, "-c", PROBE, ",".join(ENGINE_LIBRARIES), *MODULES], cwd=REPO,
                           capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stdout + probe.stderr[-2000:]
    return json.loads(probe.stdout.splitlines()[-1])


@pytest.mark.parametrize("module", MODULES)
def test_the_ingress_and_config_modules_import_no_engine_library(module, engine_imports):
    assert engine_imports[module] is None, engine_imports[module]


def test_the_engine_package_still_exports_its_names():
    """`from workers import LLMEngine` (the package's names are loaded on first use, not at import)."""
    import workers
    from workers.engine import LLMEngine

    assert workers.LLMEngine is LLMEngine and "LLMEngine" in workers.__all__
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        workers.Nope  # noqa: B018
