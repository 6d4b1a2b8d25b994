"""What token in, token out is checked with: every action turn an RL step trains on (`TrainedIds`) and
every token sequence the engine returned (`record_generations`)."""

from __future__ import annotations

from glmlight.callbacks.retokenization import action_turns
from glmlight.hooks import RLCallback


class TrainedIds(RLCallback):
    """Per sample of every step: its action turns, and whether the collated row the loss sees holds exactly
    the sample's prompt and response ids."""

    reads_old_logprobs = False

    def __init__(self):
        self.turns, self.rows = [], []

    def on_experience(self, trainer, module, batch):
        for i, s in enumerate(batch.samples):
            self.turns += action_turns(s)
            start = len(s.prompt_ids)
            row = batch.input_ids[i][batch.attention_mask[i].bool()].tolist()
            self.rows.append(row[start:start + len(s.response_ids)] == s.response_ids and row[:start] == s.prompt_ids)


def record_generations(engine) -> list[tuple[int, ...]]:
    """Wrap `engine.generate` so that every answer's token ids are appended to the returned list."""
    produced: list[tuple[int, ...]] = []
    generate = engine.generate

    def recording(prompts, params):
        gens = generate(prompts, params)
        produced.extend(tuple(g.token_ids) for g in gens)
        return gens

    engine.generate = recording
    return produced
