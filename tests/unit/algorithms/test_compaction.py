"""CompactionRL: segmentation, resume prompt, token-level loss, summary advantages, end to end. Its
advantages (cross-trajectory GAE, per-turn rewards, normalisation): tests/unit/ops/test_ops_gae.py."""

import glob
import os

import pytest
import torch
from torch.testing import assert_close

import glmlight
from glmlight.agents import StepResult, encode_observation, generation_prompt
from glmlight.agents.compaction import CompactingAgentLoop
from glmlight.agents.loop import episode_to_samples
from glmlight.prompt import Prompt
from glmlight.models.tokenizer import encode_chat, stop_token_ids
from glmlight.ops.reduce import aggregate_loss
from glmlight.engines.base import Generation, SamplingParams
from glmlight.sample import Status
from tests.conftest import overrides_for_tests
from glmlight import compose


class ScriptedPolicy:
    """A RolloutEngine whose answers are scripted: actions 'a1', 'a2', ...; summaries 'S1', 'S2', ...
    (it answers a summary request when the context ends with the request ids). `summary_finish`:
    the finish reason of summary answers (e.g. "error": the engine failed after retries)."""

    def __init__(self, tokenizer, request_ids, summary_finish="stop"):
        self.tok, self.request_ids = tokenizer, request_ids
        self.actions = self.summaries = 0
        self.version = 0
        self.summary_finish = summary_finish

    def generate(self, prompts, params):
        out = []
        for ctx in prompts:
            if ctx[-len(self.request_ids):] == self.request_ids:
                self.summaries += 1
                text = f"S{self.summaries}"
            else:
                self.actions += 1
                text = f"a{self.actions}"
            ids = self.tok(text, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
            finish = self.summary_finish if text.startswith("S") else "stop"
            if finish == "error":
                ids = []
            out.append(Generation(ids, [-0.5] * len(ids), finish, [0] * len(ids)))
        return out


class Echo:
    """Observations 'o1', 'o2', ...; done after `n` actions."""

    def __init__(self, n):
        self.n, self.t = n, 0

    def reset(self, prompt):
        return [{"role": "system", "content": "sys"}, {"role": "user", "content": "go"}]

    def step(self, action):
        self.t += 1
        return StepResult(None, reward=1.0, done=True) if self.t >= self.n else StepResult(f"o{self.t}")


def _loop(tokenizer, max_context=60, threshold=26, k=2, summary_finish="stop"):
    request = encode_observation(tokenizer, "Summarize.", role="user") + generation_prompt(tokenizer)
    policy = ScriptedPolicy(tokenizer, request, summary_finish)
    stops = stop_token_ids(tokenizer)
    loop = CompactingAgentLoop(policy, tokenizer, lambda: Echo(6),
                               lambda ctx: SamplingParams(max_new_tokens=4, stop_token_ids=stops),
                               max_turns=10, max_context=max_context, threshold=threshold, keep_last_steps=k,
                               summary_max_tokens=4)
    return loop, policy


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_segmentation_masks_and_resume_prompt(tokenizer):
    loop, policy = _loop(tokenizer)
    ep = loop.run([Prompt(messages=[{"role": "user", "content": "go"}])])[0]
    assert ep.status is Status.COMPLETED and ep.reward == 1.0 and ep.turns == 6
    assert len(ep.segments) >= 1 and policy.summaries == len(ep.segments)
    eos, gen = tokenizer.eos_token_id, generation_prompt(tokenizer)
    first = ep.segments[0]
    # Segment 1: the opening prompt; its response ends with the summary request (mask 0) and the summary (mask 1).
    assert first.prompt_ids == encode_chat(tokenizer, [{"role": "system", "content": "sys"},
                                                       {"role": "user", "content": "go"}])
    summary = _ids(tokenizer, "S1") + [eos]
    assert first.response_ids[-len(summary):] == summary and first.loss_mask[-len(summary):] == [1] * len(summary)
    request = loop.request_ids
    cut = len(first.response_ids) - len(summary)
    assert first.response_ids[cut - len(request):cut] == request and set(first.loss_mask[cut - len(request):cut]) == {0}
    # every action token is trained on, every observation / template token is not
    n_before = sum(1 for t, m in zip(first.response_ids, first.loss_mask) if t == eos and m) - 1  # actions in seg 1
    trained = tokenizer.decode([t for t, m in zip(first.response_ids, first.loss_mask) if m], skip_special_tokens=True)
    untrained = tokenizer.decode([t for t, m in zip(first.response_ids, first.loss_mask) if not m],
                                 skip_special_tokens=True)
    assert trained == "".join(f"a{i}" for i in range(1, n_before + 1)) + "S1"  # actions and the summary
    assert untrained == "".join(f"o{i}" for i in range(1, n_before + 1)) + "Summarize."  # observations, request
    # Segment 2's prompt: the opening messages + a resume turn with the summary + the last k=2 steps.
    head = encode_chat(tokenizer, [{"role": "system", "content": "sys"}, {"role": "user", "content": "go"},
                                   {"role": "user", "content": "Summary: "}], add_generation_prompt=False)
    tail = []
    for i in (n_before - 1, n_before):
        tail += gen + _ids(tokenizer, f"a{i}") + [eos] + encode_observation(tokenizer, f"o{i}")
    second_prompt = ep.segments[1].prompt_ids if len(ep.segments) > 1 else ep.prompt_ids
    assert second_prompt == head + _ids(tokenizer, "S1") + tail + gen


@pytest.mark.parametrize("finish, status", [("error", Status.FAILED), ("abort", Status.ABORTED)])
def test_a_failed_summary_ends_the_episode_and_is_never_resumed_from(tokenizer, finish, status):
    loop, policy = _loop(tokenizer, summary_finish=finish)
    ep = loop.run([Prompt(messages=[{"role": "user", "content": "go"}])])[0]
    assert policy.summaries == 1 and ep.status is status and ep.done
    assert ep.segments == []  # no segment was closed on a summary that does not exist
    (sample,) = episode_to_samples(ep, group_id=0, rollout_id=0)
    assert sample.status is status
    assert sample.reward is None if status is Status.FAILED else True


def test_tail_shrinks_until_the_prompt_fits(tokenizer):
    loop, _ = _loop(tokenizer, max_context=60, threshold=26, k=5)
    ep = loop.run([Prompt(messages=[{"role": "user", "content": "go"}])])[0]
    prompt = ep.segments[1].prompt_ids if len(ep.segments) > 1 else ep.prompt_ids
    assert len(prompt) + 26 <= 60


def test_threshold_must_leave_room_for_the_summary(tokenizer):
    with pytest.raises(ValueError, match="no room"):
        _loop(tokenizer, threshold=8)


def test_the_agent_loop_records_each_paid_turn_on_its_last_action_token(tokenizer):
    loop, _ = _loop(tokenizer, max_context=200, threshold=26)  # room for the whole episode: one segment
    class Paying(Echo):
        def step(self, action):
            r = super().step(action)
            return StepResult(r.observation, reward=0.5 if self.t % 2 else 0.0, done=r.done)
    loop.env_factory = lambda: Paying(4)
    ep = loop.run([Prompt(messages=[{"role": "user", "content": "go"}])])[0]
    (s,) = episode_to_samples(ep, 0, 0)
    paid = s.metadata["turn_rewards"]
    assert [r for _, r in paid] == [0.5, 0.5] and s.reward == 1.0  # turns 1 and 3
    for pos, _ in paid:  # the last token of the action that was paid: an action token followed by an observation
        assert s.loss_mask[pos] == 1 and s.loss_mask[pos + 1] == 0
    assert s.response_ids[paid[0][0]] == tokenizer.eos_token_id


def test_token_level_loss_differs_from_per_segment_mean():
    # segment A: 1 token with loss 4; segment B: 3 tokens with loss 0.
    loss = torch.tensor([[4.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    # token level over all segments: 4 / 4 = 1; mean of per-segment means: (4 + 0) / 2 = 2
    assert_close(aggregate_loss(loss, mask, "token_mean"), torch.tensor(1.0))
    assert_close(aggregate_loss(loss, mask, "seq_mean_token_mean"), torch.tensor(2.0))


def test_compaction_end_to_end(tmp_path):
    import csv

    run = glmlight.build(compose(overrides_for_tests(
        tmp_path, "algo=compaction", "rollout.mode=sync", "trainer.max_steps=2", "~callbacks.held_out_eval",
        "~callbacks.sample_table", "rollout.rollout_batch_size=2", "rollout.max_new_tokens=4")))
    run.fit()
    assert run.module.policy_version == 2
    rows = list(csv.DictReader(open(glob.glob(os.path.join(str(tmp_path), "csv", "*", "metrics.csv"))[0])))
    compactions = [float(r["rollout/compactions"]) for r in rows if r.get("rollout/compactions")]
    assert compactions and sum(compactions) > 0  # compaction actually triggers in the embedded default
    assert any(float(r["rollout/segments_per_trajectory"]) > 1 for r in rows if r.get("rollout/segments_per_trajectory"))
    lengths = [float(r["rollout/summary_length"]) for r in rows if r.get("rollout/summary_length")]
    assert lengths and all(1 <= x <= 4 for x in lengths)  # summary_max_tokens: 4
    summary_tokens = [float(r["train/summary_tokens"]) for r in rows if r.get("train/summary_tokens")]
    assert summary_tokens and all(x > 0 for x in summary_tokens)


def test_summary_advantages_by_hand():
    """The summary tokens are the last summary_lengths[segment] action tokens of a closed segment; their
    mean advantage is reported separately for successful and other trajectories."""
    from types import SimpleNamespace

    from glmlight.algorithms.compaction import summary_advantages, summary_mask
    from glmlight.sample import Sample

    def seg(segment, lengths, reward):
        return Sample(prompt_ids=[1], response_ids=[2, 3, 4, 5], loss_mask=[1, 1, 1, 1], rollout_logprobs=[0.0] * 4,
                      versions=[0] * 4, segment=segment, reward=reward, metadata={"summary_lengths": lengths})

    # trajectory A (success): segment 0 closed by a 2-token summary; trajectory B (fail): segment 0, 1-token summary
    samples = [seg(0, [2], 1.0), seg(1, [2], 1.0), seg(0, [1], 0.5)]
    mask = torch.tensor([[1, 1, 0, 1, 1, 0], [1, 1, 1, 1, 0, 0], [1, 0, 0, 1, 1, 0]], dtype=torch.float32)
    adv = torch.tensor([[0.1, 0.2, 0.0, 0.5, 0.7, 0.0], [0.3, 0.3, 0.3, 0.3, 0.0, 0.0],
                        [-0.1, 0.0, 0.0, -0.2, -0.4, 0.0]])
    batch = SimpleNamespace(samples=samples, advantages=adv)
    m = summary_mask(batch, mask)
    assert m.tolist() == [[0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 1, 0]]
    out = summary_advantages(batch, mask)
    assert out["train/summary_tokens"] == 3.0
    assert out["train/summary_advantage_success"] == pytest.approx((0.5 + 0.7) / 2)
    assert out["train/summary_advantage_other"] == pytest.approx(-0.4)


@pytest.fixture
def chatml_tokenizer():
    """The character tokenizer with a ChatML template (SmolLM2's form): every turn is closed by
    `<|im_end|>` and a newline, which also ends the assistant's turn (eos)."""
    from glmlight.models.tokenizer import build_char_tokenizer
    from tests.support.gguf_files import CHAT_TEMPLATE

    tok = build_char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token = "<|im_end|>"
    tok.chat_template = CHAT_TEMPLATE
    return tok


def test_resume_prompt_with_a_template_that_closes_its_turns(chatml_tokenizer):
    """With ChatML the summary belongs inside the resume turn, before that turn's `<|im_end|>`: the
    resume prompt is what the template renders for the opening messages, a user turn "Summary: <summary>"
    and the last k steps (the summary's own ids spliced in, never re-encoded)."""
    tok = chatml_tokenizer
    loop, policy = _loop(tok, max_context=200, threshold=100, k=1)
    ep = loop.run([Prompt(messages=[{"role": "user", "content": "go"}])])[0]
    assert ep.status is Status.COMPLETED and len(ep.segments) >= 1
    n_before = sum(1 for t, m in zip(ep.segments[0].response_ids, ep.segments[0].loss_mask)
                   if t == tok.eos_token_id and m) - 1  # actions before the first summary
    second = ep.segments[1].prompt_ids if len(ep.segments) > 1 else ep.prompt_ids
    steps = []
    for i in (n_before,):  # k = 1: the last step
        steps += [{"role": "assistant", "content": f"a{i}"}, {"role": "observation", "content": f"o{i}"}]
    want = encode_chat(tok, [{"role": "system", "content": "sys"}, {"role": "user", "content": "go"},
                             {"role": "user", "content": "Summary: S1"}, *steps])
    assert tok.decode(second) == tok.decode(want)
    assert second == want
