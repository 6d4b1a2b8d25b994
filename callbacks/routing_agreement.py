"""RoutingAgreement (the model contract): do the engine and the trainer route every token to the same
experts? The fraction of (token, MoE layer) pairs whose expert sets are equal, per layer
(`routing_agreement/layer_<i>`, `.../mean`); 1.0 with `algo.replay=routing|both` by construction.
How it is measured: callbacks/agreement.py.
"""

from __future__ import annotations

import torch

from .agreement import ChoiceAgreement
from glmlight.ops.mismatch import set_agreement


class RoutingAgreement(ChoiceAgreement):
    """Logs, every `every_n_steps`, the per-layer fraction of tokens the engine and the trainer route
    to the same set of experts, on a few of the step's sequences (`routing_agreement/layer_<i>`,
    `routing_agreement/mean`).

    Args:
        every_n_steps: the period in RL steps (0: off).
        num_sequences: how many of the step's sequences are compared.
    """

    name = "routing_agreement"
    kind = "experts"
    record = "routed_experts"

    def score(self, engine: torch.Tensor, trainer: torch.Tensor) -> float:
        return float(set_agreement(engine, trainer))
