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


# ------------------------------------------------------------------------------- math answers against math-verify
# (completion, label, math-verify's judgement): numeric and LaTeX gold answers, the wrappings models use.
MATH_CASES = [
    (r"\boxed{4}", r"\frac{3}{4}", 0),
    (r"\boxed{2}", r"2\sqrt{2}", 0),
    (r"\boxed{0.5}", r"\frac{1}{2}", 1),
    (r"\boxed{\dfrac{1}{2}}", r"\frac{1}{2}", 1),
    (r"\boxed{\tfrac{2}{3}}", r"\frac{2}{3}", 1),
    (r"\boxed{\$18}", "18", 1),
    (r"\boxed{18 \text{ dollars}}", "18", 1),
    (r"\boxed{x = 3}", "3", 1),
    (r"\boxed{18}", "18", 1),
    (r"\boxed{17}", "18", 0),
    (r"The answer is \boxed{1,000}.", "1000", 1),
    (r"\boxed{1000}", "1,000", 1),
    (r"\boxed{\frac{3}{4}}", "0.75", 1),
    (r"\boxed{\frac{6}{8}}", r"\frac{3}{4}", 1),
    (r"\boxed{2\sqrt{2}}", r"\sqrt{8}", 1),
    (r"\boxed{-5}", "-5", 1),
    (r"\boxed{5}", "-5", 0),
    (r"\boxed{50\%}", "50", 0),  # math-verify reads 50\% as 0.5
    (r"\boxed{3.14}", r"\pi", 0),
    ("So the total is 42.", "42", 1),
    ("So the total is 41.", "42", 0),
    (r"\boxed{12.0}", "12", 1),
    (r"\boxed{(1, 2)}", "(1,2)", 1),
    (r"\boxed{x^2+2x+1}", "(x+1)^2", 1),
    (r"\boxed{3}", "3.5", 0),
    (r"first \boxed{7} then \boxed{9}", "9", 1),
    (r"first \boxed{9} then \boxed{7}", "9", 0),
    (r"The answer is $\frac{1}{3}$", r"\frac{1}{3}", 1),
    (r"\boxed{1/2}", "0.5", 1),
    (r"\boxed{10}", "100", 0),
    (r"\boxed{18.00}", r"\$18", 1),
    (r"\boxed{-\frac{1}{4}}", "-0.25", 1),
    (r"\boxed{\frac{1}{4}}", "-0.25", 0),
]
NUMERIC_LABEL = {c for c in MATH_CASES if c[1] in ("18", "1000", "1,000", "0.75", "-5", "50", "42", "12", "3.5", "9",
                                                     "0.5", "100", "-0.25", r"\frac{1}{2}", r"\frac{2}{3}",
                                                     r"\frac{3}{4}", r"\frac{1}{3}", r"\$18")}


def test_math_verify_judges_the_tricky_answers():
    pytest.importorskip("math_verify")
    from glmlight.rewards.mathverify import MathVerify

    mv = MathVerify()
    got = [mv(_s(text, label))[0] for text, label, _ in MATH_CASES]
    assert got == [float(want) for _, _, want in MATH_CASES]
    assert len(MATH_CASES) >= 25


@pytest.mark.parametrize("verifier", [BoxedMatch(), NumericMatch()], ids=["BoxedMatch", "NumericMatch"])
def test_boxed_and_numeric_match_agree_with_math_verify_on_numbers(verifier):
    """Never right where math-verify says wrong; on numeric labels (plain, fractions, \\$) its judgement
    exactly (BoxedMatch: on boxed answers); a symbolic label makes NumericMatch raise, one line."""
    for text, label, want in MATH_CASES:
        try:
            got = verifier(_s(text, label))[0]
        except ValueError as e:
            assert isinstance(verifier, NumericMatch) and (text, label, want) not in NUMERIC_LABEL, (text, label)
            assert "is not a number" in str(e) and "MathVerify" in str(e)
            continue
        assert not (got > 0 and not want), (text, label)
        if (text, label, want) in NUMERIC_LABEL and (isinstance(verifier, NumericMatch) or "boxed" in text):
            assert got == want, (text, label)


def test_math_verify_runs_under_the_thread_executor():
    """math-verify's own timeouts (signal.alarm) fail outside the main thread; MathVerify runs without them,
    in the default worker threads, each call under task.reward_options.timeout_s."""
    pytest.importorskip("math_verify")
    from glmlight.rewards.base import score_samples
    from glmlight.rewards.mathverify import MathVerify

    samples = [_s(r"\boxed{\frac{1}{2}}", "0.5", rollout_id=i) for i in range(8)] + [_s(r"\boxed{3}", "4", rollout_id=8)]
    counts = score_samples(MathVerify(), samples, {"executor": "thread", "max_concurrency": 4})
    assert counts["scored"] == 9 and not counts["failed"], [s.metadata.get("reward_error") for s in samples]
    assert [s.reward for s in samples] == [1.0] * 8 + [0.0]
    assert samples[0].metadata["reward_info"]["format_ok"] is True


def test_math_verify_under_the_process_executor_and_a_bad_label():
    pytest.importorskip("math_verify")
    from glmlight.rewards.base import score_samples
    from glmlight.rewards.mathverify import MathVerify

    samples = [_s(r"\boxed{2\sqrt{2}}", r"\sqrt{8}"), _s(r"\boxed{1}", "")]
    counts = score_samples(MathVerify(), samples, {"executor": "process", "max_concurrency": 1})
    assert counts["scored"] == 1 and counts["failed"] == 1
    assert samples[0].reward == 1.0
    assert "cannot parse the label" in samples[1].metadata["reward_error"]
