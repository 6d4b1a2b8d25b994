"""IndexAgreement (the sparse contract): do the engine and the trainer attend to the same DSA top-k
keys for the same tokens? The mean overlap |A ∩ B| / k of the selections per layer with its own
indexer (`index_agreement/layer_<i>`, `.../mean`; 1.0 = identical), over the queries that select
(more than k keys); 1.0 with `algo.replay=index|both` by construction. How it is measured:
callbacks/agreement.py.
"""

from __future__ import annotations

import torch

from .agreement import ChoiceAgreement
from glmlight.ops.mismatch import topk_agreement


class IndexAgreement(ChoiceAgreement):
    """Logs, every `every_n_steps`, the per-layer DSA top-k agreement of the engine and the trainer on
    a few of the step's sequences (`index_agreement/layer_<i>`, `index_agreement/mean`).

    Args:
        every_n_steps: the period in RL steps (0: off).
        num_sequences: how many of the step's sequences are compared.
    """

    name = "index_agreement"
    kind = "index"
    record = "indexer_topk"

    def score(self, engine: torch.Tensor, trainer: torch.Tensor) -> float:
        return float(topk_agreement(engine, trainer))
