"""Questions in words for chat models (glmlight/data/chat_tasks.py) and the verifiers that read their
answers as a chat model writes them (NumericMatch: the last number; ListMatch: the last items)."""

import re

import pytest

from glmlight.builder import build_sources
from glmlight.cli import compose
from glmlight.config import validate
from glmlight.data.chat_tasks import ChatQuestionTask
from glmlight.errors import ConfigError, DataError
from glmlight.rewards.verifiers import ListMatch, NumericMatch
from glmlight.sample import Sample


def _sample(text, label):
    return Sample(prompt_ids=[1], response_ids=[], metadata={"completion_text": text, "label": label})


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


@pytest.mark.parametrize("text, ok", [
    ("2, 7, 9", True),
    ("The sorted list is: 2, 7, 9.", True),
    ("Sorting 7, 2, 9 from smallest to largest gives 2, 7, 9.", True),  # the question restated first
    ("1. 2\n2. 7\n3. 9", True),  # a numbered list: only the label's numbers count
    ("2, 7, 9 or maybe 9, 7, 2", False),  # several orders: the last one is the answer
    ("7, 2, 9", False),
    ("2, 9", False),
    ("", False),
])
def test_list_match_reads_the_last_items_in_the_models_wording(text, ok):
    reward, info = ListMatch()(_sample(text, "2, 7, 9"))
    assert reward == float(ok)
    if ok:
        assert info["pred"] == "2, 7, 9"


def test_list_match_on_words_and_repeated_items():
    m = ListMatch()
    assert m(_sample("The reversed list is Map, Sun, Cat. Hope this helps!", "map, sun, cat"))[0] == 1.0
    assert m(_sample("cat, sun, map", "map, sun, cat"))[0] == 0.0
    assert m(_sample("The sorted numbers are 2, 8, 8.", "2, 8, 8"))[0] == 1.0
    assert m(_sample("2, 8", "2, 8, 8"))[0] == 0.0


def test_numeric_match_reads_a_chat_models_arithmetic_answers():
    m = NumericMatch()
    assert m(_sample("To add 8 and 5, you simply add them together: 8 + 5 = 13.", "13"))[0] == 1.0
    assert m(_sample("The answer is 13. That is 1 more than 12.", "13"))[0] == 0.0  # the last number counts
    assert m(_sample("To add 5 and 9, we need to follow the order of operations", "14"))[0] == 0.0


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
