"""Short verifiable questions for chat models, asked in plain words (`task.source=chat`).

Each item is a pure function of (seed, index), like `ArithmeticTask`'s, and, like it, the task draws
only from its side of the train / held-out split (`glmlight.split`): a question (with its suffix)
is a training question or a held-out one, never both. The label is the exact answer as a string: a number, or a
comma-separated list. `task.question` picks the kind:

- `arithmetic`: "What is 47 + 8?" with operands in [task.min_operand, task.max_operand] and an operator
  from task.operators; label "55".
- `sort`: "Sort these numbers from smallest to largest: 7, 2, 9." with list_length numbers in
  [min_operand, max_operand]; label "2, 7, 9".
- `reverse`: "Reverse the order of this list: cat, sun, map." with list_length distinct short words;
  label "map, sun, cat".
- `count_letter`: "How many times does the letter "a" appear in the word "banana"?" over a fixed list of
  common words; label "3".

`task.question_suffix` is appended to every question (e.g. an instruction on the answer's form).
The answers are checked by `glmlight.rewards.verifiers.NumericMatch` (numbers) and `ListMatch` (lists),
which read the last number or the last items of the completion, so a sentence around the answer is
fine and restating the question first is too.
"""

from __future__ import annotations

import random

from glmlight.config.schema import CHOICES
from glmlight.split import Side, question_key
from glmlight.errors import DataError
from glmlight.prompt import Prompt

QUESTIONS = CHOICES["task.question"]  # the kinds of question, named in the config's one list of allowed values

WORDS = ("cat", "dog", "sun", "map", "cup", "hat", "pen", "box", "car", "egg", "fish", "tree", "book", "milk",
         "door", "lamp", "rain", "ship", "star", "bird", "frog", "cake", "ring", "rose")
COUNT_WORDS = ("banana", "apple", "letter", "coffee", "balloon", "mississippi", "strawberry", "committee",
               "bookkeeper", "cherry", "pepper", "little", "butter", "summer", "address", "success", "assessment",
               "tomato", "potato", "parallel", "giraffe", "pizza", "bubble", "yellow", "hello", "window",
               "elephant", "teeth", "football", "mirror")


class ChatQuestionTask:
    """Synthetic questions in words (see the module docstring); indexable like a prompt source."""

    def __init__(self, question: str = "arithmetic", *, seed: int = 0, min_operand: int = 0, max_operand: int = 9,
                 operators: str = "+", list_length: tuple[int, int] = (3, 3), question_suffix: str = "",
                 system_prompt: str | None = None, size: int = 100_000, side: Side = Side()):
        if question not in QUESTIONS:
            raise DataError(f"task.question={question!r} is not one of {list(QUESTIONS)}")
        lo, hi = list_length
        if not 2 <= lo <= hi:
            raise DataError(f"task.list_length={list(list_length)} must be [min, max] with 2 <= min <= max")
        if question == "reverse" and hi > len(WORDS):
            raise DataError(f"task.list_length: reverse draws distinct words, at most {len(WORDS)}")
        if min_operand > max_operand or not operators or set(operators) - set("+-*"):
            raise DataError("task: chat questions need min_operand <= max_operand and operators drawn from '+-*'")
        self.question, self.seed, self.size = question, seed, size
        self.min_operand, self.max_operand, self.operators = min_operand, max_operand, operators
        self.list_length, self.suffix, self.system_prompt = (lo, hi), question_suffix, system_prompt
        self.side = side
        self[0]  # a side of the split with no question stops here, not in the middle of a run

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> Prompt:
        rng = random.Random(self.seed * 1_000_003 + index)
        text, label = self.side.draw(self.ask, lambda item: item[0], rng, f"task.question={self.question}")
        messages = [{"role": "user", "content": text}]
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return Prompt(messages=messages, label=label, domain=self.question, metadata={"question": text})

    def ask(self, rng: random.Random) -> tuple[str, str]:
        """One question of the task's kind (suffix included) and its label, from either side of the split."""
        text, label = getattr(self, f"_{self.question}")(rng)
        return (f"{text} {self.suffix}" if self.suffix else text), label

    def contains(self, prompt: Prompt) -> bool:
        """Whether `prompt`'s question can occur in this stream (it is on this task's side of the split)."""
        return self.side.holds(question_key(prompt))

    def _number(self, rng: random.Random) -> int:
        return rng.randint(self.min_operand, self.max_operand)

    def _arithmetic(self, rng: random.Random) -> tuple[str, str]:
        a, b = self._number(rng), self._number(rng)
        op = rng.choice(self.operators)
        answer = {"+": a + b, "-": a - b, "*": a * b}[op]
        return f"What is {a} {op} {b}?", str(answer)

    def _sort(self, rng: random.Random) -> tuple[str, str]:
        items = [self._number(rng) for _ in range(rng.randint(*self.list_length))]
        return (f"Sort these numbers from smallest to largest: {', '.join(map(str, items))}.",
                ", ".join(map(str, sorted(items))))

    def _reverse(self, rng: random.Random) -> tuple[str, str]:
        items = rng.sample(WORDS, rng.randint(*self.list_length))
        return f"Reverse the order of this list: {', '.join(items)}.", ", ".join(reversed(items))

    def _count_letter(self, rng: random.Random) -> tuple[str, str]:
        word = rng.choice(COUNT_WORDS)
        letter = rng.choice(sorted(set(word)))
        return f'How many times does the letter "{letter}" appear in the word "{word}"?', str(word.count(letter))
