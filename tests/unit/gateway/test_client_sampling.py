"""`task.agent.gateway.client_sampling=true`: a turn drawn at the request's temperature / top-p / top-k is
scored by the trainer at that sampling (the probability contract, glmlight/ops/logprobs.py), so at
identical weights the trainer's log-probs of the recorded tokens are the engine's (float32 rounding)."""

from collections import Counter

import openai
import torch

from glmlight.algorithms.grpo import GRPO, GRPOConfig
from glmlight.config.rollout import RolloutConfig
from glmlight.agents.options import AgentOptions
from glmlight.data.rollout import RolloutDataModule
from glmlight.data.sources import ArithmeticTask
from glmlight.engines.local.engine import LocalEngine
from glmlight.gateway.runner import GatewayOptions
from glmlight.sample import SAMPLING_KEY, Experience, Sample
from tests.support.tolerances import model_logprob_tolerance

# per turn: what the agent sends (None: nothing; the run's setting applies)
TURNS = [dict(temperature=0.3, top_p=0.8), dict(temperature=0.3, top_p=0.8), dict(temperature=None, top_p=None),
         dict(temperature=2.0, top_p=None)]


def _agent(turns):
    def agent(task):
        with openai.OpenAI(base_url=task.openai_base_url, api_key=task.api_key, max_retries=0) as client:
            messages = list(task.messages)
            for t, kw in enumerate(turns):
                sent = {k: v for k, v in kw.items() if v is not None}
                message = client.chat.completions.create(model="m", messages=messages, **sent).choices[0].message
                messages += [message.model_dump(exclude_none=True), {"role": "user", "content": f"more {t}"}]
    return agent


def _experience(tiny_model, tokenizer, client_sampling, turns=TURNS, top_k=0):
    engine = LocalEngine(tiny_model)
    cfg = RolloutConfig(rollout_batch_size=2, n_samples_per_prompt=2, max_new_tokens=12, max_context=512,
                        temperature=1.0, top_k=top_k)
    dm = RolloutDataModule(engine, tokenizer, ArithmeticTask(seed=0), lambda s: 1.0, cfg,
                           agent=AgentOptions(gateway=GatewayOptions(agent=_agent(turns), client_sampling=client_sampling),
                                              max_turns=8))
    return dm.next_experience()


def _gap(tiny_model, exp, top_k=0):
    module = GRPO(GRPOConfig(), tiny_model, temperature=1.0, top_k=top_k)
    lp = module.scoring.compute_logprobs(tiny_model.eval(), exp)
    m = exp.loss_mask.bool()
    assert int(m.sum()) > 20
    return float((lp - exp.rollout_logprobs)[m].abs().max())


def _tolerance(tiny_model, exp, temperature):
    """Engine runner vs trainer forward, float32 rounding only, at the lowest temperature of the batch (the
    logits divided by it: the largest rounding); scoring at another temperature is off by O(0.1)."""
    return model_logprob_tolerance(tiny_model, [s.prompt_ids + s.response_ids for s in exp.samples],
                                   temperature=temperature)


def test_turns_at_the_clients_sampling_are_scored_at_it(tiny_model, tokenizer):
    """The real openai client sends temperature 0.3 / top_p 0.8 on two turns, nothing on the third (the run's
    temperature 1.0), temperature 2.0 on the fourth, against a run at temperature 1.0: the trainer's
    log-probs of the recorded tokens equal the engine's within float32 rounding."""
    exp = _experience(tiny_model, tokenizer, client_sampling=True)
    assert all(s.metadata["turns"] == 4 for s in exp.samples)
    gap, tol = _gap(tiny_model, exp), _tolerance(tiny_model, exp, temperature=0.3)
    assert gap <= tol, (gap, tol)


def test_the_runs_sampling_keeps_the_common_path(tiny_model, tokenizer):
    """With client_sampling off (the requests' settings ignored) and with top-k on, nothing is recorded
    per token and the batch is scored at the run's settings, as before."""
    for client_sampling, top_k in ((False, 0), (True, 5)):
        turns = TURNS if not client_sampling else [dict(temperature=None, top_p=None)] * 2
        exp = _experience(tiny_model, tokenizer, client_sampling, turns, top_k=top_k)
        assert exp.sampling is None and not any(SAMPLING_KEY in s.metadata for s in exp.samples)
        gap, tol = _gap(tiny_model, exp, top_k), _tolerance(tiny_model, exp, temperature=1.0)
        assert gap <= tol, (gap, tol)


def test_sampling_ranges_collate_per_token():
    """metadata["sampling"] ranges ([start, end, temperature, top_k, top_p] in response positions) become
    a [B, T, 3] tensor, NaN where the run's settings apply; rows without ranges are all NaN."""
    a = Sample(prompt_ids=[1], response_ids=[5, 6, 7, 8], loss_mask=[1, 1, 0, 1], rollout_logprobs=[0.0] * 4,
               versions=[0] * 4, metadata={SAMPLING_KEY: [[0, 2, 0.3, 0, 0.8], [3, 4, 2.0, 7, 1.0]]})
    b = Sample(prompt_ids=[1, 2], response_ids=[5, 6], loss_mask=[1, 1], rollout_logprobs=[0.0] * 2, versions=[0] * 2)
    exp = Experience.collate([a, b], pad_token_id=0)
    nan = float("nan")
    want = torch.tensor([[[0.3, 0, 0.8], [0.3, 0, 0.8], [nan] * 3, [2.0, 7, 1.0]], [[nan] * 3] * 4])
    torch.testing.assert_close(exp.sampling, want, equal_nan=True)
    assert Experience.collate([b], pad_token_id=0).sampling is None
    assert exp.select([1]).sampling.isnan().all()


def test_entropy_and_micro_batches_take_the_per_token_sampling(tiny_model, monkeypatch):
    """The entropy (whole batch with gradient, and a few positions at a time without) is each position's
    at its own settings; a micro-batch trimmed to its own columns keeps its rows' settings."""
    from glmlight.algorithms import microbatch, scoring
    from glmlight.ops.logprobs import entropy_from_logits

    a = Sample(prompt_ids=[1, 2, 3], response_ids=[5, 6, 7, 8], loss_mask=[1, 1, 0, 1], rollout_logprobs=[0.0] * 4,
               versions=[0] * 4, metadata={SAMPLING_KEY: [[0, 2, 0.3, 0, 0.8], [3, 4, 2.0, 7, 1.0]]})
    b = Sample(prompt_ids=[1], response_ids=[5, 6], loss_mask=[1, 1], rollout_logprobs=[0.0] * 2, versions=[0] * 2)
    exp = Experience.collate([a, b], pad_token_id=0)
    module = GRPO(GRPOConfig(), tiny_model, temperature=0.7, top_k=0, top_p=0.9)
    logits = torch.randn(2, 4, 40, generator=torch.Generator().manual_seed(0))
    settings = {(0, 0): (0.3, 0, 0.8), (0, 1): (0.3, 0, 0.8), (0, 3): (2.0, 7, 1.0), (1, 0): (0.7, 0, 0.9),
                (1, 1): (0.7, 0, 0.9)}
    want = torch.zeros(2, 4)
    for (r, c), (t, k, p) in settings.items():
        want[r, c] = entropy_from_logits(logits[r, c], t, k, p)
    monkeypatch.setattr(scoring, "ENTROPY_CHUNK_ELEMENTS", 2 * 40)
    torch.testing.assert_close(module.scoring.entropy(logits, exp.loss_mask, False, exp), want, rtol=0, atol=1e-6)
    got = module.scoring.entropy(logits.clone().requires_grad_(), exp.loss_mask, True, exp)
    torch.testing.assert_close(got.detach(), want, rtol=0, atol=1e-6)
    mb = microbatch.trim(exp.select([1]))
    assert mb.sampling.shape == (1, 2, 3) and mb.sampling.isnan().all()
