import pytest
import torch

from glmlight.sample import Experience, Sample, SampleError, Status


def _sample(**kw):
    base = dict(prompt_ids=[5, 6, 7], response_ids=[8, 9], loss_mask=[1, 1], rollout_logprobs=[-0.5, -1.0],
                versions=[2, 2], reward=1.0, group_id=3, rollout_id=11, metadata={"domain": "math"})
    base.update(kw)
    return Sample(**base)


def test_round_trip_dict():
    s = _sample(status=Status.TRUNCATED)
    d = s.to_dict()
    assert d["status"] == "truncated"
    assert Sample.from_dict(d) == s


@pytest.mark.parametrize("field", ["loss_mask", "rollout_logprobs", "versions"])
def test_length_mismatch_names_the_field(field):
    with pytest.raises(SampleError, match=field):
        _sample(**{field: [1]})


def test_other_validation_errors():
    with pytest.raises(SampleError, match="prompt_ids is empty"):
        _sample(prompt_ids=[])
    with pytest.raises(SampleError, match="0/1"):
        _sample(loss_mask=[1, 2])
    with pytest.raises(SampleError, match="no field"):
        Sample.from_dict({**_sample().to_dict(), "bogus": 1})


def test_first_version_ignores_observation_tokens():
    s = _sample(response_ids=[1, 2, 3], loss_mask=[0, 1, 1], rollout_logprobs=[0, -1, -1], versions=[-1, 4, 5])
    assert s.first_version == 4


def test_collate_pads_prompts_left_and_responses_right():
    a = _sample()
    b = _sample(prompt_ids=[1], response_ids=[2, 3, 4], loss_mask=[1, 0, 1], rollout_logprobs=[-1, 0, -2],
                versions=[1, -1, 1], reward=0.0, rollout_id=12)
    exp = Experience.collate([a, b], pad_token_id=0)
    assert exp.prompt_length == 3 and exp.response_length == 3
    assert exp.input_ids.tolist() == [[5, 6, 7, 8, 9, 0], [0, 0, 1, 2, 3, 4]]
    assert exp.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    assert exp.position_ids[1].tolist()[2:] == [0, 1, 2, 3]
    assert exp.response_mask.tolist() == [[1, 1, 0], [1, 1, 1]]
    assert exp.loss_mask.tolist() == [[1, 1, 0], [1, 0, 1]]
    assert exp.rollout_logprobs.tolist() == [[-0.5, -1.0, 0.0], [-1.0, 0.0, -2.0]]
    assert exp.versions.tolist() == [[2, 2, -1], [1, -1, 1]]
    assert exp.rewards.tolist() == [1.0, 0.0]
    assert exp.response_ids.tolist() == [[8, 9, 0], [2, 3, 4]]
    sub = exp.select([1])
    assert sub.samples == [b] and sub.input_ids.tolist() == [[0, 0, 1, 2, 3, 4]]
    assert (exp.input_ids.dtype, exp.attention_mask.dtype, exp.versions.dtype) == (torch.long,) * 3
    assert (exp.response_mask.dtype, exp.loss_mask.dtype, exp.rollout_logprobs.dtype) == (torch.float32,) * 3


def test_collate_keeps_an_empty_response_and_a_missing_reward():
    c = _sample(prompt_ids=[4, 4], response_ids=[], loss_mask=[], rollout_logprobs=[], versions=[], reward=None)
    exp = Experience.collate([c, _sample()], pad_token_id=0)
    assert exp.input_ids.tolist() == [[0, 4, 4, 0, 0], [5, 6, 7, 8, 9]]
    assert exp.attention_mask.tolist() == [[0, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert exp.response_mask.tolist() == [[0, 0], [1, 1]] and exp.loss_mask.tolist() == [[0, 0], [1, 1]]
    assert exp.versions.tolist() == [[-1, -1], [2, 2]] and exp.rewards.tolist() == [0.0, 1.0]
    only = Experience.collate([c], pad_token_id=0)  # no response at all: one padding column
    assert only.input_ids.tolist() == [[4, 4, 0]] and only.response_mask.tolist() == [[0]]


def test_collate_rejects_failed_and_empty():
    with pytest.raises(SampleError, match="FAILED"):
        Experience.collate([_sample(status=Status.FAILED)], pad_token_id=0)
    with pytest.raises(SampleError, match="empty"):
        Experience.collate([], pad_token_id=0)
