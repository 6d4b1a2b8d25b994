"""A scripted environment for multi-turn loop tests: tool results for the first two actions, done (reward 1)
after the third."""

from __future__ import annotations

from glmlight.agents import StepResult


class ThreeTurnToolEnv:
    observation = "tool says {n}"  # the tool result of action t (1, 2), formatted with t and n = 5 + t

    def __init__(self):
        self.t = 0

    def reset(self, prompt):
        return list(prompt.messages)

    def step(self, action):
        self.t += 1
        return StepResult(None, reward=1.0, done=True) if self.t >= 3 else StepResult(
            self.observation.format(t=self.t, n=5 + self.t))
