"""A request's sampling parameters live in its SamplerState row, written once when it takes the slot: a step
names only slots and token indices, and a slot taken again holds nothing of its earlier occupant."""
import torch

from sampler_rows import step_rows
from workers.config import SamplingParams
from workers.plan import SamplerInit, StepPlan
from workers.sampler import SamplerState

VOCAB = 50


def test_a_step_carries_slots_not_sampling_lists():
    names = set(StepPlan.__dataclass_fields__)
    assert {"sampler_slots", "steps", "sampler_inits"} <= names
    assert not names & {"temperatures", "top_ks", "top_ps", "seeds", "penalties", "min_ps", "hold_stops"}


def test_rows_hold_what_admission_wrote_and_steps_gather_them():
    state = SamplerState(4, VOCAB, 4, "cpu")
    rich = SamplingParams(temperature=0.5, top_k=7, top_p=0.8, min_p=0.1, presence_penalty=0.5,
                          frequency_penalty=0.25, repetition_penalty=1.5, min_tokens=3, logit_bias={4: 2.0},
                          top_logprobs=2)
    state.admit([SamplerInit(2, rich, 2**32 + 9, [1, 2], [], [5]), SamplerInit(0, SamplingParams(), 11, [], [], [])])
    t = state.tensors([2, 0], [1, 6])
    assert t.temperatures.tolist() == [0.5, 1.0] and t.top_ks.tolist() == [7, VOCAB] and t.seeds.tolist() == [9, 11]
    assert torch.allclose(t.top_ps, torch.tensor([0.8, 1.0])) and torch.allclose(t.min_ps, torch.tensor([0.1, 0.0]))
    assert t.penalties.tolist() == [[0.5, 0.25, 1.5], [0.0, 0.0, 1.0]]
    assert t.hold_stops.tolist() == [True, False] and t.use_bias and t.num_top_logprobs == 2
    assert t.needs_sorting and not t.all_greedy and t.slots.tolist() == [2, 0] and t.steps.tolist() == [1, 6]
    assert state.stop_mask[2].nonzero().flatten().tolist() == [5] and state.prompt_mask[2, [1, 2]].all()
    assert state.tensors([2], [3]).hold_stops is None      # min_tokens reached: nothing held back


def test_a_slot_taken_again_keeps_nothing_of_its_earlier_occupant():
    rich = SamplingParams(temperature=0.7, top_k=3, presence_penalty=1.0, repetition_penalty=1.3, min_tokens=2,
                          min_p=0.2, logit_bias={1: 5.0})
    _, state = step_rows(rich, [3], VOCAB)
    state.admit([SamplerInit(0, rich, 3, [7], [8, 8], [9])])
    plain, _ = step_rows(SamplingParams(temperature=0.0), [4], VOCAB, state=state)
    assert plain.all_greedy and not plain.needs_sorting and not plain.use_bias
    assert plain.penalties is None and plain.min_ps is None and plain.hold_stops is None
    for history in (state.output_counts, state.prompt_mask, state.stop_mask, state.bias_values):
        assert not history[0].any()
