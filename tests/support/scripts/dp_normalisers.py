"""Data-parallel loss normalisers: two ranks with different token counts train like one process on
the union of their batches. Run by tests/integration/distributed/test_dp_normalisers.py:

    python -m tests.support.scripts.dp_normalisers OUT_DIR STRATEGY      # two processes (gloo)

writes OUT_DIR/<case>.pt (gradients of every optimizer step and parameters after every RL step);
`run_case(..., devices=1)` is the one-process reference on the union of the ranks' samples.
"""

from __future__ import annotations

import math
import os
import sys

import torch

import glmlight
from glmlight import compose
from glmlight.models.tokenizer import build_char_tokenizer, encode_chat
from glmlight.sample import Sample
from tests.support.scripts.fixed_batches import Recorder, ReplayData

# name -> overrides. Rank 0 holds few tokens (and a fully masked row) in 2 micro-batches, rank 1 many in 3.
CASES = {
    "grpo_token_mean": ["algo.loss_agg=token_mean"],
    "grpo_seq_mean_token_mean": ["algo.loss_agg=seq_mean_token_mean"],
    "sao_whiten_value_norm": ["algo=sao", "rollout.mode=sync", "algo.critic_warmup_steps=0", "algo.critic_updates=1",
                              "algo.value_normalization=true", "algo.whiten_advantages=true",
                              "algo.critic_freeze_attention=false"],
}
RANK_LENGTHS = [[1, 3, 2, 0], [9, 8, 10, 7, 6, 9]]  # response lengths; 0 = every token masked


def rank_samples(rank: int) -> list[Sample]:
    """The fixed batch of one rank: groups of two, response ids drawn from a seeded generator."""
    tok = build_char_tokenizer()
    g = torch.Generator().manual_seed(100 + rank)
    out = []
    for i, n in enumerate(RANK_LENGTHS[rank]):
        prompt = encode_chat(tok, [{"role": "user", "content": f"{rank}+{i}="}], add_generation_prompt=True)
        length = n or 3
        ids = torch.randint(5, 60, (length,), generator=g).tolist()
        mask = [1] * length if n else [0] * length
        out.append(Sample(prompt_ids=prompt, response_ids=ids, loss_mask=mask,
                          rollout_logprobs=[-math.log(len(tok)) * m for m in mask], versions=[0] * length,
                          reward=float((i * 7 + rank * 3) % 5) / 4, group_id=rank * 100 + i // 2,
                          rollout_id=rank * 100 + i, metadata={"prompt_index": rank * 100 + i}))
    return out


def overrides(out_dir: str, case: str, devices: int, strategy: str) -> list[str]:
    return ["model.preset=test", "model.warm_start.steps=0", "logger=none", f"trainer.default_root_dir={out_dir}",
            "trainer.max_steps=1", "trainer.enable_progress_bar=false", "rollout.n_samples_per_prompt=2",
            "rollout.rollout_batch_size=2", "rollout.max_new_tokens=10", "trainer.checkpoint_every_n_steps=0",
            "~callbacks.held_out_eval", "~callbacks.sample_table", "~callbacks.version_gate", "algo.lr=1e-5",
            "algo.grad_clip=0", "algo.micro_batch_size=2", f"trainer.devices={devices}",
            f"trainer.strategy={strategy}", *CASES[case]]


def run_case(out_dir: str, case: str, devices: int, strategy: str) -> str:
    """One RL step of `case`; devices=1 trains on the union of both ranks' samples."""
    run = glmlight.build(compose(overrides(os.path.join(out_dir, case), case, devices, strategy)))
    batches = [[rank_samples(0) + rank_samples(1)]] if devices == 1 else [[rank_samples(r)] for r in range(devices)]
    run.datamodule = ReplayData(run.datamodule, batches)
    path = os.path.join(out_dir, f"{case}-{devices}.pt")
    run.trainer.callbacks.append(Recorder(path))
    run.fit()
    return path


if __name__ == "__main__":
    out, strategy = sys.argv[1], sys.argv[2]
    for name in (sys.argv[3].split(",") if len(sys.argv) > 3 else CASES):
        run_case(out, name, 2, strategy)
