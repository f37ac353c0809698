"""The docs stay true to the code: docs/configuration.md is what deployments/config_docs.py writes from EngineConfig
and LLMConfig now, and every relative link of the README and of docs/ leads to a file of the repository."""
from __future__ import annotations

import json
import re
from pathlib import Path

from deployments import config_docs

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_configuration_page_is_what_the_generator_writes_now():
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert page == config_docs.render(), \
        "docs/configuration.md is stale: run `.venv/bin/python -m deployments.config_docs > docs/configuration.md`"


def test_every_config_field_is_on_the_page_with_its_default():
    page = config_docs.render()
    assert "| `max_loras_per_batch` | `int` | `8` |" in page   # a value read from the class, not written here
    assert "| `routing` |" in page and "`'adapter-affinity'`" in page
    for name in config_docs.ENGINE_FIELDS | set(config_docs.LLMConfig.model_fields):
        assert f"| `{name}` |" in page, name


def test_a_field_without_a_comment_fails_the_generator():
    class Documented:
        plain: int = 1          # says what it is
        # LoRA
        bare: int = 2

    try:
        config_docs.field_rows(Documented)
    except AssertionError as e:
        assert "Documented.bare has no comment" in str(e)
    else:
        raise AssertionError("a field without help was accepted")


def relative_links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)   # code blocks hold no links
    return [target for target in LINK.findall(text) if not re.match(r"[a-z]+:|#", target)]


def test_every_relative_link_of_the_readme_and_docs_resolves():
    assert len(PAGES) > 5
    broken = [f"{page.relative_to(ROOT)}: {target}" for page in PAGES for target in relative_links(page)
              if not (page.parent / target.split("#")[0]).exists()]
    assert not broken, broken


def test_the_readme_starts_with_the_two_commands_and_stays_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    first_block = "\n".join(lines[:lines.index("```bash", 0) + 4])
    assert "make serve" in first_block and "make test" in first_block
    assert len(lines) <= 220


def test_the_request_path_names_every_file_the_request_was_measured_to_run():
    """benchmarks/request_path.py measured which files one streamed chat request runs and the path that joins
    its stages; the page names each file, puts the path's in bold, and states both numbers (run it again after
    moving code: this fails until the page and the measurement agree). Issue 40: at most 20 files on the path."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    path = page.split("<!-- request-path:start -->", 1)[1].split("<!-- request-path:end -->", 1)[0]
    named = set(re.findall(r"`((?:deployments|workers|lora)/[\w/]+\.(?:py|c|h))`", path))
    missing = [f for f in named if not (ROOT / f).is_file()]
    assert not missing, missing
    measured = json.loads((ROOT / "benchmarks" / "results" / "request_path.json").read_text())
    gone = [f for f in measured["files"] if not (ROOT / f).is_file()]
    assert not gone, f"measured files that no longer exist: {gone}; run python -m benchmarks.request_path"
    assert not set(measured["files"]) - named, sorted(set(measured["files"]) - named)
    bold = re.findall(r"\*\*`((?:deployments|workers|lora)/[\w/]+\.py)`\*\*", path)
    assert sorted(bold) == sorted(measured["path"]), (sorted(set(bold) ^ set(measured["path"])))
    assert set(measured["path"]) <= set(measured["files"])
    assert len(measured["path"]) == measured["num_path_files"] <= 20
    [(on_path, with_helpers)] = re.findall(r"Files on the path: (\d+) Python files, [\d,]+ lines; with the "
                                           r"helpers they call, (\d+) Python files", path)
    assert int(on_path) == measured["num_path_files"]
    assert int(with_helpers) == measured["num_files"] == len(measured["files"])
