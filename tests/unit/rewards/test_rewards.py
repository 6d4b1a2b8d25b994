"""Rewards: scoring (failures counted, not raised; async rewards), building one from its target, and the
general-RL rewards: mixed weights, a local reward model, a remote endpoint, a generative judge. The
verifiers: test_verifiers.py; timeouts and concurrency: test_reward_timeouts.py."""

import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from glmlight.errors import ConfigError
from glmlight.rewards import build_reward, score_samples
from glmlight.rewards.judge import GenerativeJudge, parse_judge_score
from glmlight.rewards.mixed import ByDomain, MixedReward, RewardComponentError
from glmlight.rewards.reward_model import RemoteRewardModel, SequenceClassifierReward
from glmlight.rewards.verifiers import NumericMatch
from glmlight.sample import Sample, Status
from tests.conftest import encode
from tests.unit.rewards.test_verifiers import _s


def _sample(tokenizer, question="3+4=", completion="7", label="7", rollout_id=0):
    return Sample(prompt_ids=encode(tokenizer, question), response_ids=[5], loss_mask=[1], rollout_logprobs=[0.0],
                  versions=[0], rollout_id=rollout_id,
                  metadata={"completion_text": completion, "label": label, "domain": "math"})


def failing_reward(sample):
    raise RuntimeError("verifier crashed")


# ------------------------------------------------------------------------------------------ scoring and building
def test_reward_failures_are_counted_not_raised():
    def flaky(sample):
        if sample.metadata["label"] == "boom":
            raise RuntimeError("verifier crashed")
        return 1.0

    samples = [_s("1", "1"), _s("2", "boom"), _s("3", "nan")]
    samples[2].metadata["label"] = "1"
    counts = score_samples(flaky, samples)
    assert counts == Counter(scored=2, failed=1)
    assert samples[1].status is Status.FAILED and "verifier crashed" in samples[1].metadata["reward_error"]
    nan = score_samples(lambda s: float("nan"), [_s("1", "1")])
    assert nan["failed"] == 1


def test_async_reward():
    async def reward(sample):
        return 0.5, {"why": "async"}

    samples = [_s("1", "1"), _s("2", "2")]
    assert score_samples(reward, samples)["scored"] == 2
    assert [s.reward for s in samples] == [0.5, 0.5]
    assert samples[0].metadata["reward_info"] == {"why": "async"}


def test_build_reward_from_target():
    assert isinstance(build_reward({"_target_": "glmlight.rewards.verifiers.NumericMatch", "rel_tol": 0.1}),
                      NumericMatch)
    fn = build_reward({"_target_": "tests.conftest.digit_fraction_reward"})
    assert fn(_s("a1", "x")) == 0.5


# ------------------------------------------------------------------------------------------ MixedReward
MIXED = {"_target_": "glmlight.rewards.mixed.MixedReward", "_recursive_": False, "components": {
    "exact": {"weight": 0.7, "reward": {"_target_": "glmlight.rewards.verifiers.ExactMatch"}},
    "digits": {"weight": 0.3, "reward": {"_target_": "tests.conftest.digit_fraction_reward"}},
}}


def test_mixed_reward_weights_and_info(tokenizer):
    reward = build_reward(MIXED)
    assert isinstance(reward, MixedReward) and reward.weights == {"exact": 0.7, "digits": 0.3}
    right, wrong, half = (_sample(tokenizer, completion="7"), _sample(tokenizer, completion="8", rollout_id=1),
                          _sample(tokenizer, completion="8x", rollout_id=2))
    counts = score_samples(reward, [right, wrong, half])
    assert counts["scored"] == 3
    assert right.reward == pytest.approx(0.7 * 1 + 0.3 * 1)
    assert wrong.reward == pytest.approx(0.3)
    assert half.reward == pytest.approx(0.3 * 0.5)
    info = half.metadata["reward_info"]
    assert info["exact"] == 0.0 and info["digits"] == 0.5 and info["exact_info"] == {"pred": "8x"}
    assert reward.score(_sample(tokenizer))[0] == pytest.approx(1.0)


def test_mixed_reward_component_failure(tokenizer):
    spec = {"exact": {"weight": 1.0, "reward": {"_target_": "glmlight.rewards.verifiers.ExactMatch"}},
            "crash": {"weight": 2.0, "reward": failing_reward}}
    strict = MixedReward(spec)
    s = _sample(tokenizer)
    counts = score_samples(strict, [s])
    assert counts["failed"] == 1 and s.status is Status.FAILED and s.reward is None
    assert "reward component 'crash' failed" in s.metadata["reward_error"]
    with pytest.raises(RewardComponentError, match="'crash'"):
        strict.score(_sample(tokenizer))
    lenient = MixedReward(spec, on_component_error="zero")
    value, info = lenient.score(_sample(tokenizer))
    assert value == 1.0 and info["crash"] == 0.0 and info["failed_components"] == ["crash"]


@pytest.mark.parametrize("components, message", [
    ({}, "at least one component"),
    ({"a": {"weight": 1.0}}, "component 'a' must be"),
    ({"a": {"reward": {"_target_": "glmlight.rewards.verifiers.ExactMatch"}, "wieght": 1}}, "unknown key"),
    ({"a": {"reward": {"_target_": "glmlight.rewards.verifiers.ExactMatch"}, "weight": "x"}}, "finite number"),
    ({"a": {"reward": {"_target_": "no.such.Reward"}, "weight": 1}}, "component 'a'.*cannot be imported"),
])
def test_mixed_reward_bad_config(components, message):
    with pytest.raises(ConfigError, match=message):
        MixedReward(components)


# ------------------------------------------------------------------------------------------ ByDomain
BY_DOMAIN = {"_target_": "glmlight.rewards.mixed.ByDomain", "_recursive_": False, "routes": {
    "math": {"_target_": "glmlight.rewards.verifiers.NumericMatch"},
    "sort": {"_target_": "glmlight.rewards.verifiers.ListMatch"},
}}


def test_by_domain_scores_each_sample_with_its_domains_rule(tokenizer):
    reward = build_reward(BY_DOMAIN)
    assert isinstance(reward, ByDomain) and sorted(reward.routes) == ["math", "sort"]
    # "12 then 13": the sum's rule reads the last number (13, wrong); the list rule finds the label's item 12.
    math = _sample(tokenizer, completion="12 then 13", label="12")
    sort = _sample(tokenizer, completion="12 then 13", label="12", rollout_id=1)
    sort.metadata["domain"] = "sort"
    lost = _sample(tokenizer, rollout_id=2)
    lost.metadata["domain"] = "poetry"
    counts = score_samples(reward, [math, sort, lost])
    assert (math.reward, sort.reward) == (0.0, 1.0)
    assert math.metadata["reward_info"]["domain"] == "math" and sort.metadata["reward_info"]["pred"] == "12"
    assert counts["scored"] == 2 and counts["failed"] == 1 and lost.status is Status.FAILED
    assert "no reward for domain 'poetry'" in lost.metadata["reward_error"]


def test_by_domain_bad_config():
    with pytest.raises(ConfigError, match="at least one route"):
        ByDomain({})
    with pytest.raises(ConfigError, match="ByDomain route 'math'.*cannot be imported"):
        ByDomain({"math": {"_target_": "no.such.Reward"}})


# ------------------------------------------------------------------------------------------ reward models
def _tiny_classifier(tokenizer, path, num_labels):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, num_labels=num_labels,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    model = LlamaForSequenceClassification(config).eval()
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return model


@pytest.mark.parametrize("num_labels", [1, 3])
def test_sequence_classifier_reward_matches_forward(tokenizer, tmp_path, num_labels):
    model = _tiny_classifier(tokenizer, tmp_path / "rm", num_labels)
    rm = build_reward({"_target_": "glmlight.rewards.reward_model.SequenceClassifierReward", "path": str(tmp_path / "rm")})
    s = _sample(tokenizer, completion="7")
    value, _ = rm(s)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "3+4="}, {"role": "assistant", "content": "7"}],
                                         tokenize=False)
    assert rm.text("3+4=", "7") == text  # the prompt text is the decoded prompt, special tokens dropped
    with torch.no_grad():
        logits = model(**tokenizer(text, return_tensors="pt")).logits[0]
    expected = logits[0] if num_labels == 1 else torch.softmax(logits, -1)[-1]
    assert value == pytest.approx(float(expected), abs=1e-5)
    assert rm(_sample(tokenizer, completion="8"))[0] != pytest.approx(value)


def test_sequence_classifier_reward_bad_path(tmp_path):
    with pytest.raises(ValueError, match="not a local directory"):
        SequenceClassifierReward(str(tmp_path / "missing"))


class _RewardServer(BaseHTTPRequestHandler):
    """Speaks the reward-endpoint protocol: POST {prompt, completion} -> {score}."""

    calls: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).calls.append((self.path, body, self.headers.get("Authorization")))
        if self.path == "/score":
            self._reply(200, {"score": len(body["completion"]) / 10})
        elif self.path == "/no_score":
            self._reply(200, {"value": 1})
        elif self.path == "/forbidden":
            self._reply(403, {"error": "no"})
        else:
            self._reply(503, {"error": "busy"})

    def _reply(self, code, obj):
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture()
def reward_server():
    _RewardServer.calls = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _RewardServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_remote_reward_model(tokenizer, reward_server, monkeypatch):
    monkeypatch.setenv("RM_KEY", "secret")
    rm = RemoteRewardModel(f"{reward_server}/score", api_key_env="RM_KEY")
    samples = [_sample(tokenizer, completion="x" * k, rollout_id=k) for k in (1, 2, 3)]
    assert score_samples(rm, samples)["scored"] == 3
    assert [s.reward for s in samples] == pytest.approx([0.1, 0.2, 0.3])
    path, body, auth = _RewardServer.calls[0]
    assert path == "/score" and body["prompt"] == "3+4=" and auth == "Bearer secret"


@pytest.mark.parametrize("path, message", [("/no_score", "has no 'score' field"), ("/forbidden", "HTTP 403"),
                                           ("/busy", "failed after 2 attempts")])
def test_remote_reward_model_errors_fail_the_sample(tokenizer, reward_server, path, message):
    rm = RemoteRewardModel(f"{reward_server}{path}", max_retries=1, retry_backoff_s=0.01)
    s = _sample(tokenizer)
    assert score_samples(rm, [s])["failed"] == 1 and s.status is Status.FAILED
    assert message in s.metadata["reward_error"]
    assert len(_RewardServer.calls) == (2 if path == "/busy" else 1)  # only 5xx is retried


# ------------------------------------------------------------------------------------------ judge
@pytest.mark.parametrize("text, expected", [
    ("Score: 7/10", 0.7),
    ("The answer is right. score = 9", 0.9),
    ("Rating: 8 out of 10", 0.8),
    ("**Score:** 6/10", 0.6),
    ("Verdict: [[4]]", 0.4),
    ("I'd give it 3/4.", 0.75),
    ("Score: 2/10 at first; on reflection, Score: 8/10", 0.8),
    ("score: 0.5 / 1", 0.5),
])
def test_parse_judge_score(text, expected):
    assert parse_judge_score(text, scale=10) == pytest.approx(expected)


@pytest.mark.parametrize("text, message", [
    ("A fine answer.", "no score"), ("", "no score"), ("Score: 12/10", "outside"), ("Score: -1", "outside"),
    ("Score: 3/0", "outside"),
])
def test_parse_judge_score_malformed(text, message):
    with pytest.raises(ValueError, match=message):
        parse_judge_score(text, scale=10)


def test_generative_judge_through_engine(tokenizer, tiny_model, tmp_path):
    """A real judge model (the tiny GLM-5 taught to answer "Score: 7/10") behind the embedded engine;
    an untrained judge's malformed output fails the sample."""
    from glmlight.config.schema import WarmStartConfig
    from glmlight.data.sources import ListSource
    from glmlight.prompt import Prompt
    from glmlight.models.warm_start import supervised_warm_start
    from glmlight.engines.local.engine import LocalEngine

    untrained = LocalEngine(tiny_model, pad_token_id=tokenizer.pad_token_id)
    source = ListSource([Prompt(messages=[{"role": "user", "content": f"Rate: {i}"}], label="Score: 7/10")
                         for i in range(32)])
    supervised_warm_start(tiny_model, tokenizer, source, WarmStartConfig(steps=20, lr=1e-2, batch_size=8,
                                                                         cache_dir=str(tmp_path)), {"judge": 1})
    judge = GenerativeJudge(LocalEngine(tiny_model, pad_token_id=tokenizer.pad_token_id), template="Rate: {completion}",
                            max_new_tokens=16)
    good = _sample(tokenizer, completion="7")
    assert score_samples(judge, [good])["scored"] == 1
    assert good.reward == pytest.approx(0.7) and good.metadata["reward_info"]["judge_text"] == "Score: 7/10"
    bad = _sample(tokenizer, completion="7")
    counts = score_samples(GenerativeJudge(untrained, template="Rate: {completion}", max_new_tokens=8), [bad])
    assert counts["failed"] == 1 and bad.status is Status.FAILED and "judge output has no score" in bad.metadata["reward_error"]


def test_generative_judge_config_errors():
    with pytest.raises(ValueError, match="exactly one of engine"):
        GenerativeJudge()
    with pytest.raises(ValueError, match="must contain"):
        GenerativeJudge(engine=object(), template="no placeholder")
