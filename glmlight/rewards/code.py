"""Code-execution reward: run the completion's program against test cases in the sandbox.

Tests come from the sample's metadata:

- `metadata["tests"]`: a list of `{"input": str, "output": str}` stdin/stdout pairs;
- `metadata["test_code"]`: asserts appended to the program (passes if it exits 0).

A program that fails, times out, crashes, exceeds a limit or trips the sandbox
scores 0.0 for that test: that is the program's failure and the sample is still
scored. Only a broken sandbox (`SandboxError`) or a sample without completion
text or tests raises, which `score_samples` counts as a reward failure.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from glmlight.rewards.sandbox import SandboxConfig, SandboxResult, run_sandboxed
from glmlight.sample import Sample

_FENCE = re.compile(r"```([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)
_PYTHON_TAGS = {"python", "py", "python3"}


def extract_code(text: str) -> str:
    """The last ```python fenced block; else the last untagged fenced block; else the whole text."""
    blocks = _FENCE.findall(text)
    python_blocks = [body for tag, body in blocks if tag.lower() in _PYTHON_TAGS]
    untagged_blocks = [body for tag, body in blocks if not tag]
    for candidates in (python_blocks, untagged_blocks):
        if candidates:
            return candidates[-1]
    return text


def outputs_match(got: str, expected: str) -> bool:
    """Equal up to trailing whitespace on each line and trailing blank lines."""
    return _normalize(got) == _normalize(expected)


def _normalize(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


@dataclass
class _Case:
    index: int
    program: str
    stdin: str
    expected: str | None  # None: pass iff the program exits 0 (test_code)


class CodeReward:
    """Reward = fraction of passed test cases (or 1.0/0.0 with `all_or_nothing`), plus an info dict.

    `decode` (the tokenizer's decode) turns `sample.response_ids` into the
    completion; without it, `sample.metadata["completion_text"]` is used.
    Test cases of one sample run concurrently, at most `max_workers` sandboxes
    at a time across all samples scored by this instance.
    """

    def __init__(
        self,
        decode: Callable[[list[int]], str] | None = None,
        *,
        config: SandboxConfig | None = None,
        all_or_nothing: bool = False,
        max_workers: int = 2,
        stderr_chars: int = 300,
    ) -> None:
        self.decode = decode
        self.config = config or SandboxConfig()
        self.all_or_nothing = all_or_nothing
        self.stderr_chars = stderr_chars
        self.max_workers = max_workers
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="code-reward")

    def __getstate__(self) -> dict[str, Any]:  # task.reward_options.executor=process: each worker its own pool
        return {k: v for k, v in self.__dict__.items() if k != "_pool"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._pool = ThreadPoolExecutor(max_workers=self.max_workers, thread_name_prefix="code-reward")

    def __call__(self, sample: Sample) -> tuple[float, dict[str, Any]]:
        code = extract_code(self.completion_text(sample))
        cases = self._cases(code, sample)
        results = list(self._pool.map(self._run_case, cases))
        outcomes = [self._outcome(case, res) for case, res in zip(cases, results)]
        passed = sum(o["passed"] for o in outcomes)
        if self.all_or_nothing:
            reward = 1.0 if passed == len(cases) else 0.0
        else:
            reward = passed / len(cases)
        violations = sorted({v for o in outcomes for v in o["violations"]})
        info = {
            "passed": passed,
            "total": len(cases),
            "tests": outcomes,
            "violations": violations,
            "network_isolated": all(r.network_isolated for r in results),
        }
        return reward, info

    async def acall(self, sample: Sample) -> tuple[float, dict[str, Any]]:
        """The same reward for async callers; the sandboxes run in worker threads."""
        return await asyncio.to_thread(self, sample)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def completion_text(self, sample: Sample) -> str:
        if self.decode is not None:
            return self.decode(list(sample.response_ids))
        text = sample.metadata.get("completion_text")
        if text is None:
            raise ValueError("CodeReward needs a decode function or sample.metadata['completion_text']")
        return str(text)

    def _cases(self, code: str, sample: Sample) -> list[_Case]:
        tests = sample.metadata.get("tests") or []
        cases = [_Case(i, code, str(t.get("input", "")), str(t["output"])) for i, t in enumerate(tests)]
        test_code = sample.metadata.get("test_code")
        if test_code:
            cases.append(_Case(len(cases), f"{code}\n\n{test_code}\n", "", None))
        if not cases:
            raise ValueError("sample has neither metadata['tests'] nor metadata['test_code']")
        return cases

    def _run_case(self, case: _Case) -> SandboxResult:
        return run_sandboxed(case.program, case.stdin, config=self.config)

    def _outcome(self, case: _Case, res: SandboxResult) -> dict[str, Any]:
        passed = res.ok and (case.expected is None or outputs_match(res.stdout, case.expected))
        return {
            "index": case.index,
            "passed": bool(passed),
            "returncode": res.returncode,
            "timed_out": res.timed_out,
            "killed_by_signal": res.killed_by_signal,
            "violations": list(res.violations),
            "duration_s": round(res.duration_s, 3),
            "stderr_tail": res.stderr[-self.stderr_chars :] if not passed else "",
        }
