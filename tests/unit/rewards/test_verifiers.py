"""The verifiers (glmlight/rewards/verifiers.py): exact, numeric and boxed answers, and the numeric and
list answers of chat models in their own wording (the questions: tests/unit/data/test_chat_tasks.py)."""

import pytest

from glmlight.rewards.verifiers import BoxedMatch, ExactMatch, ListMatch, NumericMatch, extract_boxed
from glmlight.sample import Sample


def _s(text, label, **kw):
    return Sample(prompt_ids=[1], metadata={"completion_text": text, "label": label}, **kw)


def test_verifiers():
    assert ExactMatch()(_s(" 12 ", "12"))[0] == 1.0
    assert ExactMatch()(_s("12.0", "12"))[0] == 0.0
    assert NumericMatch()(_s("the answer is 1,234.0", "1234"))[0] == 1.0
    assert NumericMatch()(_s("no number", "3"))[0] == 0.0
    assert extract_boxed(r"x \boxed{\frac{1}{2}} y") == r"\frac{1}{2}"
    assert BoxedMatch()(_s(r"so \boxed{42}", "42"))[0] == 1.0
    assert BoxedMatch()(_s(r"so \boxed{42.0}", "42"))[0] == 1.0
    assert BoxedMatch(format_penalty=0.5)(_s("42", "42"))[0] == -0.5


# ------------------------------------------------------------------------------------------ chat models' answers
def _sample(text, label):
    return Sample(prompt_ids=[1], response_ids=[], metadata={"completion_text": text, "label": label})


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
