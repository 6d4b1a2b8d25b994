"""An engine that answers each request with the next scripted (token ids, finish reason) and records every
context it was given: what the splice tests compare with the chat template's own rendering."""

from glmlight.engines.base import Generation


class ScriptedEngine:
    def __init__(self, answers):
        self.answers, self.contexts, self.version = list(answers), [], 0

    def generate(self, prompts, params):
        self.contexts += [list(p) for p in prompts]
        ids, finish = self.answers.pop(0)
        return [Generation(ids, [-0.5] * len(ids), finish, [0] * len(ids))]
