"""RetokenizationCheck: how often decoding the engine's tokens and encoding the text again gives other ids.

A framework that keeps text and re-tokenizes it trains on those other ids: actions the policy never
took, scored with log-probs of tokens it never sampled. glmlight trains on the engine's ids (token
in, token out), so this is a measurement of what that avoids, never a correction. Per RL step it logs,
over the batch's action turns (each maximal run of tokens the engine produced; observations between
them are the environment's):

- `tito/retokenized_differs_frac`: the fraction of turns whose round trip
  `encode(decode(ids)) != ids` (special tokens kept on both sides);
- `tito/retokenized_token_diff_frac`: over all turns, the fraction of positions whose id differs, or
  that one side lacks;
- `tito/turns`: how many turns were checked.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from glmlight.hooks import RLCallback
from glmlight.sample import Experience, Sample


def action_turns(sample: Sample) -> list[list[int]]:
    """The sample's action turns: maximal runs of response tokens the engine produced (version >= 0)."""
    turns, run = [], []
    for tok, version in zip(sample.response_ids, sample.versions):
        if version >= 0:
            run.append(tok)
        elif run:
            turns.append(run)
            run = []
    return turns + [run] if run else turns


def round_trip(tokenizer: Any, ids: list[int]) -> list[int]:
    """The ids of the text of `ids`, encoded again (no special tokens added, none skipped)."""
    return list(tokenizer(tokenizer.decode(ids, skip_special_tokens=False), add_special_tokens=False)["input_ids"])


class RetokenizationCheck(RLCallback):
    """Logs `tito/*` (module docstring) from every step's batch.

    Args:
        max_turns: at most this many turns per step are checked (the first ones), to bound the cost.
    """

    reads_old_logprobs = False

    def __init__(self, max_turns: int = 256):
        self.max_turns = max_turns
        self.last: dict[str, float] = {}  # the last step's figures

    def on_experience(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Experience) -> None:
        tokenizer = trainer.datamodule.tokenizer
        turns = [t for s in batch.samples for t in action_turns(s)][: self.max_turns]
        if not turns:
            return
        differs, diff_tokens, tokens = 0, 0, 0
        for ids in turns:
            again = round_trip(tokenizer, ids)
            differs += again != ids
            diff_tokens += sum(a != b for a, b in zip(ids, again)) + abs(len(ids) - len(again))
            tokens += max(len(ids), len(again))
        self.last = {"tito/retokenized_differs_frac": differs / len(turns),
                     "tito/retokenized_token_diff_frac": diff_tokens / max(tokens, 1), "tito/turns": float(len(turns))}
        batch.stats.update(self.last)
