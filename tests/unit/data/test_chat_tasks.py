"""Questions in words for chat models (glmlight/data/chat_tasks.py) and their task configs. The verifiers
that read their answers as a chat model writes them (NumericMatch: the last number; ListMatch: the last
items): tests/unit/rewards/test_verifiers.py."""

import re

import pytest

from glmlight.run.build import build_sources
from glmlight.config.compose import compose
from glmlight.config.schema import validate
from glmlight.data.chat_tasks import ChatQuestionTask
from glmlight.errors import ConfigError, DataError


def test_items_are_fixed_by_seed_and_index_and_labels_answer_the_question():
    a, b = ChatQuestionTask("arithmetic", seed=3, max_operand=99, operators="+-*"), ChatQuestionTask(
        "arithmetic", seed=3, max_operand=99, operators="+-*")
    assert [a[i] for i in range(5)] == [b[i] for i in range(5)]
    assert [a[i].messages for i in range(5)] != [ChatQuestionTask("arithmetic", seed=4, max_operand=99,
                                                                   operators="+-*")[i].messages for i in range(5)]
    for i in range(50):
        x, op, y = re.fullmatch(r"What is (\d+) ([-+*]) (\d+)\?", a[i].messages[0]["content"]).groups()
        assert a[i].label == str(eval(f"{x}{op}{y}"))  # noqa: S307 - our own digits
    s = ChatQuestionTask("sort", list_length=(3, 5), question_suffix="Reply with the list only.")
    for i in range(50):
        text = s[i].messages[0]["content"]
        nums = [int(n) for n in re.search(r": ([\d, ]+)\.", text).group(1).split(", ")]
        assert 3 <= len(nums) <= 5 and s[i].label == ", ".join(map(str, sorted(nums)))
        assert text.endswith(" Reply with the list only.")
    r = ChatQuestionTask("reverse", list_length=(4, 4))
    words = re.search(r": (.+)\.$", r[0].messages[0]["content"]).group(1).split(", ")
    assert len(set(words)) == 4 and r[0].label == ", ".join(words[::-1])
    c = ChatQuestionTask("count_letter", system_prompt="Be brief.")
    letter, word = re.search(r'letter "(.)" appear in the word "(\w+)"', c[0].messages[1]["content"]).groups()
    assert c[0].messages[0] == {"role": "system", "content": "Be brief."} and c[0].label == str(word.count(letter))


def test_chat_task_configs():
    for name, question in [("chat_arithmetic", "arithmetic"), ("chat_sort", "sort"), ("chat_reverse", "reverse"),
                           ("chat_count_letter", "count_letter")]:
        cfg = validate(compose([f"task={name}"]))
        train, held_out = build_sources(cfg.task, cfg.seed)
        assert train.question == held_out.question == question and train[0] != held_out[0]
    with pytest.raises(ConfigError, match="task.question='divide' is not one of"):
        validate(compose(["task=chat_arithmetic", "task.question=divide"]))
    with pytest.raises(ConfigError, match=r"task.list_length.*must be \[min, max\] with 2 <= min <= max"):
        build_sources(validate(compose(["task=chat_sort", "task.list_length=[3,2]"])).task, 0)
    with pytest.raises(DataError, match="reverse draws distinct words"):
        ChatQuestionTask("reverse", list_length=(3, 40))
