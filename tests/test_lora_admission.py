"""Admission under the LoRA budget (workers/lora_budget.py): a waiting adapter's wait is bounded by
lora_max_wait_steps, not by the generations of the adapters holding the budget; paused sequences keep their
tokens exact; a slot, once loaded, is used for at least that many steps (no thrash). No Ray: a tiny engine."""
import pytest

from factories import PROMPTS, make_adapter
from lora_fixtures import ALL7
from workers import EngineConfig, LLMEngine, SamplingParams


@pytest.fixture(scope="module")
def model(model_dir):
    return model_dir("qwen3")


@pytest.fixture(scope="module")
def adapters(model, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora-admission")
    return {name: str(make_adapter(model, out / name, r=8, alpha=16, target_modules=ALL7, seed=i))
            for i, name in enumerate("ABCD")}


def engine_with(model, adapters, **kw):
    engine = LLMEngine(EngineConfig(model=str(model), device="cpu", max_lora_rank=8, **kw))
    for name, source in adapters.items():
        engine.load_adapter(name, source)
    return engine


def tokens(max_tokens):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def test_a_waiting_adapter_gets_in_within_the_bound_not_after_whole_generations(model, adapters):
    """A and B hold a budget of 2 with long generations and new requests every other step; C arrives at step 2."""
    def serve(max_wait):
        engine = engine_with(model, adapters, max_loras_per_batch=2, lora_max_wait_steps=max_wait)
        ids, first_c, done = {}, None, {}
        for step in range(400):
            if step < 20 and step % 2 == 0:
                for name in "AB":
                    ids[engine.add_request(PROMPTS[step % 4], tokens(40), adapter=name)] = (step % 4, name)
            if step == 2:
                ids[engine.add_request(PROMPTS[1], tokens(40), adapter="C")] = (1, "C")
            for out in engine.step():
                if ids[out.request_id][1] == "C" and first_c is None:
                    first_c = step
                if out.finished:
                    done[out.request_id] = out.token_ids
            if not engine.has_unfinished():
                break
        return first_c, {ids[rid]: toks for rid, toks in done.items()}, engine.controller.budget.num_pauses

    wait = 4
    first_c, outputs, pauses = serve(wait)
    assert pauses > 0 and first_c <= 2 + 2 * wait + 2   # arrival + its wait + the victim's least hold + admission
    unbounded, _, none = serve(10**6)   # control: no rotation, C waits for A's or B's stream to drain
    assert none == 0 and unbounded >= 40
    solo = engine_with(model, adapters)
    for (prompt, name), got in outputs.items():   # the paused sequences resumed on the KV they kept
        assert got == solo.generate(PROMPTS[prompt], tokens(40), adapters=[name])[0].token_ids, (prompt, name)


def test_a_slot_once_loaded_is_used_for_the_bound_before_it_rotates(model, adapters):
    """Four adapters over a budget of 2, a request a step in turn: the budget rotates, and an adapter paused for
    another had held the budget for at least lora_max_wait_steps steps; slot loads fall as the bound grows."""
    def serve(max_wait):
        engine = engine_with(model, adapters, max_loras_per_batch=2, lora_max_wait_steps=max_wait)
        controller, held = engine.controller, {}
        short_holds = []
        for step in range(300):
            if step < 48:
                engine.add_request(PROMPTS[step % 8], tokens(10), adapter="ABCD"[step % 4])
            engine.step()
            holders = {s.adapter_ref for s in controller.running if s.adapter and not controller.budget.is_paused(s)}
            for key in list(held):
                if key not in holders:   # left the budget: paused (it still has sequences) or drained
                    if key in controller.budget.paused and held[key] < max_wait:
                        short_holds.append((key, held.pop(key)))
                    held.pop(key, None)
            for key in holders:
                held[key] = held.get(key, 0) + 1
            if not engine.has_unfinished():
                break
        assert not engine.has_unfinished(), "every request finished"
        return short_holds, controller.budget.num_pauses, engine.stats()["lora"]["slots"]["misses"]

    short, pauses, loads = serve(4)
    assert pauses > 0 and short == []
    _, quick_pauses, quick_loads = serve(1)
    assert quick_pauses > pauses and quick_loads > loads


def test_no_pause_for_a_request_that_cannot_start(model, adapters):
    """A budget of 1 and KV blocks for one of the two: C cannot start while B holds its blocks, so B is never
    paused for it (it would sit out for nothing); C starts once B is done, both with their solo tokens."""
    engine = engine_with(model, adapters, max_loras_per_batch=1, lora_max_wait_steps=2, kv_block_size=4,
                         max_model_len=64, num_kv_blocks=17)
    solo = engine_with(model, adapters)
    b = engine.add_request(PROMPTS[3], tokens(24), adapter="B")
    engine.step()
    c = engine.add_request(PROMPTS[5], tokens(24), adapter="C")
    done, finished_at = {}, {}
    for step in range(500):
        for out in engine.step():
            if out.finished:
                done[out.request_id], finished_at[out.request_id] = out.token_ids, step
        if not engine.has_unfinished():
            break
    assert finished_at[b] <= 24 and engine.controller.budget.num_pauses == 0   # B ran every step
    assert done[b] == solo.generate(PROMPTS[3], tokens(24), adapters=["B"])[0].token_ids
    assert done[c] == solo.generate(PROMPTS[5], tokens(24), adapters=["C"])[0].token_ids


def test_a_busy_adapters_queue_does_not_starve_one_with_room_in_the_budget(model, adapters):
    """Two places, a budget of 2: A sends a request every step, B one at step 3. B's adapter has room all along, so
    it waits only for the places of the A requests that arrived before it (arrival order), not for A's queue to
    empty (60 steps of arrivals)."""
    engine = engine_with(model, adapters, max_loras_per_batch=2, max_num_seqs=2)
    b_id, first_b = None, None
    for step in range(400):
        if step < 60:
            engine.add_request(PROMPTS[step % 4], tokens(6), adapter="A")
        if step == 3:
            b_id = engine.add_request(PROMPTS[1], tokens(6), adapter="B")
        if any(out.request_id == b_id for out in engine.step()) and first_b is None:
            first_b = step
        if not engine.has_unfinished():
            break
    assert first_b is not None and first_b <= 3 + 3 * 8, first_b   # 3 A requests before it, ~7 steps each
