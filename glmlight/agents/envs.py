"""Toy environments for the embedded default (docs/agents.md).

CalculatorEnv: the policy may call a calculator tool (`calc: <expr>`) and must
finish with `answer: <number>`; reward 1 for the right final answer. The task's
products of two 2-digit numbers are beyond the tiny model, but copying the
expression into a tool call and the tool's result into the answer is not: the
answer needs the environment. `correct_call_credit` pays a finished episode whose
answer is wrong a little for having called the tool on an expression whose value
is the target (a step of the only way to the answer, paid once, never as much as
the answer); `tool_bonus` pays every well-formed call (off by default: it can be
farmed).

RunningSumEnv: a long-horizon task whose length can exceed the context budget:
the environment reveals one number per turn and the policy must reply with the
running total each time; reward is the fraction of correct totals (with
`step_rewards`, each correct total is paid when it is given, so an episode cut
at the context budget keeps what it earned).

Each environment has an `expert(messages, summarize)`: the next action (or the
summary, under context compaction) of a policy that solves the task, read off
the conversation so far. The format warm start plays it through the task's own
agent loop (glmlight/agents/expert.py).
"""

from __future__ import annotations

import ast
import operator
import random
import hashlib
import re

from glmlight.agents.env import StepResult
from glmlight.prompt import Prompt
from glmlight.split import Side, question_key

CALC_SYSTEM = "Use 'calc: <expr>', then 'answer: <n>'."

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.USub: operator.neg,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}
_INT = re.compile(r"-?\d+")


def safe_eval(expr: str) -> int:
    """Integer arithmetic only (+ - * // %, parentheses); anything else raises ValueError."""
    if len(expr) > 64:
        raise ValueError("expression too long")

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError("only integer + - * // % and parentheses are allowed")

    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse {expr!r}") from None
    return ev(tree)


class CalculatorEnv:
    """`calc: <expr>` returns the exact value (`= 3901`), `est: <expr>` an estimate to one significant
    figure (`~ 4000`); `answer: <n>` ends the episode. See the module docstring for the rewards.
    `examples`: solved episodes placed between the system prompt and the question (a few-shot prompt
    for a pretrained chat model: the tool-call format shown, not trained)."""

    def __init__(self, tool_bonus: float = 0.0, correct_call_credit: float = 0.0, system_prompt: str | None = CALC_SYSTEM,
                 expert_calc_rate: float = 1.0, examples: list[dict[str, str]] | None = None):
        self.examples = few_shot(examples)
        if not 0.0 <= correct_call_credit < 1.0:
            raise ValueError(f"correct_call_credit must be in [0, 1), got {correct_call_credit}")
        if not 0.0 <= expert_calc_rate <= 1.0:
            raise ValueError(f"expert_calc_rate must be in [0, 1], got {expert_calc_rate}")
        self.tool_bonus, self.correct_call_credit, self.system_prompt = tool_bonus, correct_call_credit, system_prompt
        self.expert_calc_rate = expert_calc_rate
        self.target: int | None = None
        self.calls = 0
        self.called_target = False

    def reset(self, prompt: Prompt) -> list[dict[str, str]]:
        self.target, self.calls, self.called_target = int(prompt.label), 0, False
        return opening(self.system_prompt, self.examples, prompt.messages)

    def step(self, action: str) -> StepResult:
        line = action.strip().splitlines()[0].strip() if action.strip() else ""
        tool = next((t for t in ("calc:", "est:") if line.startswith(t)), None)
        if tool is not None:
            try:
                value = safe_eval(line[len(tool):])
            except (ValueError, ZeroDivisionError) as e:
                return StepResult(f"error: {e}", info={"tool_error": True})
            self.calls += 1
            if tool == "est:":
                return StepResult(f"~ {estimate(value)}", reward=self.tool_bonus, info={"tool_calls": self.calls})
            self.called_target = self.called_target or value == self.target
            return StepResult(f"= {value}", reward=self.tool_bonus, info={"tool_calls": self.calls})
        if line.startswith("answer:"):
            m = re.fullmatch(r"answer:\s*(-?\d+)", line)
            correct = m is not None and int(m.group(1)) == self.target
            reward = 1.0 if correct else (self.correct_call_credit if self.called_target else 0.0)
            return StepResult(None, reward=reward, done=True,
                              info={"correct": correct, "tool_calls": self.calls, "called_target": self.called_target})
        return StepResult("error: reply 'calc: <expr>' or 'answer: <n>'", info={"malformed": True})

    def expert(self, messages: list[dict[str, str]], summarize: bool = False) -> str:
        """Call a tool on the question, then answer with what it returned. The tool is the exact calculator
        on a fixed share `expert_calc_rate` of the questions (by a hash of the question), the estimator on
        the others: demonstrations of both habits, which the warm-started policy keeps in about that
        proportion; RL finds which one pays."""
        last = messages[-1]
        if last["role"] == "observation" and last["content"][:2] in ("= ", "~ "):
            return f"answer: {last['content'][2:].strip()}"
        asked = sum(m["role"] == "user" for m in self.examples)  # the question follows the examples
        question = [m["content"] for m in messages if m["role"] == "user"][asked].strip().rstrip("=").strip()
        tool = "calc" if _unit_hash(question) < self.expert_calc_rate else "est"
        return f"{tool}: {question}"


def few_shot(examples: list[dict[str, str]] | None) -> list[dict[str, str]]:
    """Solved example turns for a few-shot prompt, checked: user and assistant turns only."""
    out = [dict(role=str(m["role"]), content=str(m["content"])) for m in (examples or ())]
    if any(m["role"] not in ("user", "assistant") for m in out):
        raise ValueError("examples are a solved conversation of user and assistant turns (the environment's replies "
                         "as the turns the task's agent.observation_role renders them in)")
    return out


def opening(system_prompt: str | None, examples: list[dict[str, str]], messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """An episode's first messages: the system prompt, the solved examples, then the prompt's own turns."""
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return system + examples + [m for m in messages if m["role"] != "system"]


def estimate(value: int) -> int:
    """`value` rounded to one significant figure (3901 -> 4000, 56 -> 60, 7 -> 7)."""
    digits = len(str(abs(value)))
    return int(round(value, -(digits - 1))) if digits > 1 else value


def _unit_hash(text: str) -> float:
    """A number in [0, 1) that depends only on `text` (the same on every machine and run)."""
    return int.from_bytes(hashlib.sha1(text.encode()).digest()[:8], "big") / 2**64


class RunningSumTask:
    """Prompts for RunningSumEnv: `num_steps` numbers in [min_value, max_value], a pure function of (seed, index),
    drawn from the task's `side` of the train / held-out split (glmlight.split; the question is the
    sequence of numbers)."""

    def __init__(self, num_steps: int = 8, max_value: int = 9, seed: int = 0, size: int = 100_000, min_value: int = 1,
                 side: Side = Side()):
        if min_value > max_value:
            raise ValueError(f"running sum numbers need min_value <= max_value, got {min_value} > {max_value}")
        self.num_steps, self.max_value, self.seed, self.size = num_steps, max_value, seed, size
        self.min_value, self.side = min_value, side
        self[0]  # a side of the split with no question stops here, not in the middle of a run

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> Prompt:
        rng = random.Random(self.seed * 1_000_003 + index)
        deltas = self.side.draw(self._draw, _question, rng, "running_sum")
        return Prompt(messages=[{"role": "user", "content": f"Running sum. Start: {deltas[0]}"}],
                      label=str(sum(deltas)), domain="agent", metadata={"deltas": deltas, "question": _question(deltas)})

    def _draw(self, rng: random.Random) -> list[int]:
        return [rng.randint(self.min_value, self.max_value) for _ in range(self.num_steps)]

    def contains(self, prompt: Prompt) -> bool:
        """Whether `prompt`'s question can occur in this stream (it is on this task's side of the split)."""
        return self.side.holds(question_key(prompt))


def _question(deltas: list[int]) -> str:
    return "running sum " + " ".join(map(str, deltas))


class RunningSumEnv:
    """`modulus`: reply with the running total modulo this number (10: its last digit), so that the
    state stays one digit however long the episode; the opening turn says so.
    `expert_summary_rate`: the share of expert episodes (by a hash of the conversation when the
    summary is asked for) whose summary is the running total; the others summarise with the last
    number revealed, a summary that loses the state (see `expert`).
    `system_prompt` and `examples` (solved turns, e.g. an episode with a summary and its resume turn)
    open every episode: a few-shot prompt for a pretrained chat model; the expert reads past them."""

    def __init__(self, step_rewards: bool = False, modulus: int | None = None,
                 expert_summary_rate: float = 1.0, system_prompt: str | None = None,
                 examples: list[dict[str, str]] | None = None) -> None:
        if modulus is not None and modulus < 2:
            raise ValueError(f"modulus must be >= 2 or None, got {modulus}")
        if not 0.0 <= expert_summary_rate <= 1.0:
            raise ValueError(f"expert_summary_rate must be in [0, 1], got {expert_summary_rate}")
        self.step_rewards, self.modulus, self.expert_summary_rate = step_rewards, modulus, expert_summary_rate
        self.system_prompt, self.examples = system_prompt, few_shot(examples)
        self.deltas: list[int] = []
        self.t = 0
        self.correct = 0

    def reset(self, prompt: Prompt) -> list[dict[str, str]]:
        self.deltas, self.t, self.correct = list(prompt.metadata["deltas"]), 0, 0
        if self.modulus is None:
            return opening(self.system_prompt, self.examples, prompt.messages)
        return opening(self.system_prompt, self.examples, [{"role": "user", "content": f"Sum mod {self.modulus}: {self.deltas[0]}"}])

    def step(self, action: str) -> StepResult:
        total = sum(self.deltas[: self.t + 1])
        if self.modulus is not None:
            total %= self.modulus
        m = _INT.search(action)
        ok = m is not None and int(m.group()) == total
        self.correct += int(ok)
        self.t += 1
        n = len(self.deltas)
        paid = (1.0 / n if ok else 0.0) if self.step_rewards else 0.0
        if self.t >= n:
            final = paid if self.step_rewards else self.correct / n
            return StepResult(None, reward=final, done=True, info={"correct_totals": self.correct})
        return StepResult(f"+{self.deltas[self.t]}", reward=paid, info={"correct_totals": self.correct})

    def expert(self, messages: list[dict[str, str]], summarize: bool = False) -> str:
        """The running total: the last number stated (the start, an answer, or a summary) plus every number
        revealed after it. As a summary, the same total (all the rest of the episode needs) on a share
        `expert_summary_rate` of the episodes; on the others the last number revealed, which the expert
        then goes on from: demonstrations of a summary that works and of one that loses the state, which
        the warm-started policy keeps in about that proportion. RL (the summary tokens' advantage) finds
        which one pays."""
        messages = [m for m in messages if m["role"] != "system"][len(self.examples):]
        revealed = [m for m in messages if _revealed(m)]
        if summarize and _unit_hash(" | ".join(m["content"] for m in messages)) >= self.expert_summary_rate:
            return _INT.search(revealed[-1]["content"]).group().lstrip("+") if revealed else "0"
        total = 0
        for m in messages:
            found = _INT.findall(m["content"])
            if _revealed(m):
                total += sum(int(x) for x in found)
            elif m["role"] in ("user", "assistant") and found:
                total = int(found[-1])
        return str(total % self.modulus if self.modulus is not None else total)


def _revealed(message: dict[str, str]) -> bool:
    """A number the running-sum environment revealed ("+3"), in whichever role the template renders it."""
    return message["role"] in ("observation", "user", "tool") and message["content"].startswith("+")
