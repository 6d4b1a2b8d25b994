"""Reward functions in the three calling conventions glmlight understands (docs/configuration.md, Bring your own
reward), each named on the command line as it is:

    PYTHONPATH=. python scripts/train.py ... task.reward._target_=examples.byo.rewards.accuracy_reward

- `accuracy_reward`: TRL's GRPOTrainer convention, batched, the data's columns as keyword arguments;
- `compute_score`: verl's, one sample a call, the label as `ground_truth`;
- `exact_answer`: glmlight's own, one Sample a call.
"""

import re

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def last_number(text):
    """The last number in `text` ("1,250" -> "1250"), or None."""
    found = NUMBER.findall(text)
    return found[-1].replace(",", "").rstrip(".") if found else None


def accuracy_reward(completions, solution, **kwargs):
    # TRL: completions are [{"role": "assistant", "content": ...}] for conversational prompts, strings otherwise
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [None if s is None else float(last_number(t) == str(s)) for t, s in zip(texts, solution)]


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # verl's gsm8k: the number after "####", else (verl's "flexible" method) the last number in the answer
    strict = re.search(r"####\s*(-?[\d,.]+)", solution_str)
    answer = strict.group(1).replace(",", "").rstrip(".") if strict else last_number(solution_str)
    return {"score": float(answer == str(ground_truth)), "answer": answer, "data_source": data_source}


def exact_answer(sample):
    answer = sample.metadata["completion_text"].strip()
    return float(answer == str(sample.metadata["label"])), {"answer": answer}
