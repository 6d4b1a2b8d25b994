"""A sharded run of the real pipeline (engine rollouts, rewards, weight sync, checkpoints) on two CPU
processes over gloo, run by tests/system/test_fsdp.py:

    python -m tests.support.scripts.fsdp_run OUT_DIR ALGO [--kill-at K] [--resume] [--strategy S] [override ...]

After every RL step rank 0 stores the gathered parameters and every rank's samples (OUT_DIR/record.pt),
and each rank checks that its own engine serves exactly the trained weights. `--kill-at K` ends both
processes at the start of RL step K (after the checkpoint of step K - 1 is written); `--resume`
continues from the last checkpoint (trainer.resume=last). Metrics go to OUT_DIR/csv.
`replay_single_process` trains one process on the union of the recorded samples, step by step.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import lightning.pytorch as pl
import torch

import glmlight
from glmlight import compose
from glmlight.sample import Sample
from tests.support.scripts.fixed_batches import Recorder, ReplayData, full

ALGOS = {
    "grpo": ["rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=4"],
    "sao": ["algo=sao", "rollout.mode=sync", "rollout.rollout_batch_size=4", "algo.critic_warmup_steps=1",
            "algo.critic_updates=1", "algo.value_normalization=true", "algo.critic_lr=1e-4"],
    "opd": ["algo=opd", "rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=2",
            "algo.teachers.tiny150.preset=test", "algo.teachers.tiny150.warm_start.steps=0",
            "algo.teachers.tiny150.seed=1"],
    "compaction": ["algo=compaction", "rollout.mode=sync", "rollout.rollout_batch_size=2", "algo.critic_warmup_steps=0",
                   "algo.critic_updates=1", "rollout.max_new_tokens=4",
                   "task.agent.env._target_=tests.conftest.DigitRunningSumEnv"],
}


def overrides(out_dir: str, algo: str, devices: int, strategy: str, extra: list[str]) -> list[str]:
    return ["model.preset=test", "model.warm_start.steps=0", "logger=csv", f"trainer.default_root_dir={out_dir}",
            "trainer.max_steps=4", "trainer.enable_progress_bar=false", "rollout.max_new_tokens=6",
            "trainer.checkpoint_every_n_steps=2", "task.reward._target_=tests.conftest.digit_fraction_reward",
            "~callbacks.held_out_eval", "~callbacks.sample_table", "algo.lr=1e-4", "algo.micro_batch_size=3",
            f"trainer.devices={devices}", f"trainer.strategy={strategy}", *ALGOS[algo], *extra]


class SampleRecorder(Recorder):
    """Recorder plus the samples every rank trained on, step by step (gathered on rank 0)."""

    def __init__(self, path: str):
        super().__init__(path)
        self.samples: list[list[list[dict[str, Any]]]] = []  # [step][rank] -> sample dicts

    def on_before_optimizer_step(self, *args: Any) -> None:
        pass  # parameters only

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_end(trainer, module, outputs, batch, batch_idx)
        mine = [s.to_dict() for s in batch.samples]
        everyone = [None] * trainer.world_size
        if trainer.world_size > 1:
            torch.distributed.all_gather_object(everyone, mine)
        else:
            everyone = [mine]
        self.samples.append(everyone)

    def on_train_end(self, trainer: pl.Trainer, module: Any) -> None:
        super().on_train_end(trainer, module)
        if trainer.global_rank == 0:
            record = torch.load(self.path)
            record["samples"] = self.samples
            record["steps"] = [module.rl_step - len(self.params) + i + 1 for i in range(len(self.params))]
            torch.save(record, self.path)


class KillAt(pl.Callback):
    """Ends the process (every rank) when RL step `step` is about to start: a crash after a checkpoint."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer: pl.Trainer, module: Any, batch: Any, batch_idx: int) -> None:
        if module.rl_step + 1 == self.step:
            sys.stdout.flush()
            os._exit(3)


def main(argv: list[str]) -> None:
    out, algo, rest = argv[0], argv[1], argv[2:]
    kill = int(rest[rest.index("--kill-at") + 1]) if "--kill-at" in rest else None
    strategy = rest[rest.index("--strategy") + 1] if "--strategy" in rest else "fsdp"
    resume = "--resume" in rest
    extra = [a for i, a in enumerate(rest)
             if not a.startswith("--") and (i == 0 or rest[i - 1] not in ("--kill-at", "--strategy"))]
    if resume:
        extra.append("trainer.resume=last")
    run = glmlight.build(compose(overrides(out, algo, 2, strategy, extra)))
    run.trainer.callbacks.append(SampleRecorder(os.path.join(out, "record-resumed.pt" if resume else "record.pt")))
    if kill is not None:
        run.trainer.callbacks.append(KillAt(kill))
    run.fit()


def replay_single_process(out_dir: str, algo: str, record: dict[str, Any], extra: list[str]) -> dict[str, list]:
    """One process trains on the union of the ranks' recorded samples, step by step (group and rollout ids
    made distinct per rank: each rank numbers its own). Returns its parameters after every RL step
    ("params"), the gradients of every optimizer step of the first RL step ("grads": what AdamW stepped on,
    after clipping), the first step's samples ("samples") and the largest learning rate of its optimizers
    ("lr": the policy's, a critic's)."""
    steps = []
    for per_rank in record["samples"]:
        union = []
        for r, samples in enumerate(per_rank):
            for d in samples:
                union.append(Sample.from_dict({**d, "group_id": d["group_id"] + r * 10**6,
                                               "rollout_id": d["rollout_id"] + r * 10**6}))
        steps.append(union)
    run = glmlight.build(compose(overrides(out_dir, algo, 1, "auto", ["trainer.checkpoint_every_n_steps=0", *extra])))
    run.datamodule = ReplayData(run.datamodule, [steps])
    params: list[dict[str, torch.Tensor]] = []
    grads: list[dict[str, torch.Tensor]] = []

    class Params(pl.Callback):
        def on_before_optimizer_step(self, trainer, module, optimizer):
            if not params:  # the first RL step
                grads.append({n: full(p.grad) if p.grad is not None else torch.zeros(p.shape, dtype=torch.float64)
                              for n, p in module.named_parameters() if p.requires_grad})

        def on_train_batch_end(self, trainer, module, *args):
            params.append({n: full(p) for n, p in module.named_parameters()})

    run.trainer.callbacks.append(Params())
    lr = max(run.module.cfg.lr, getattr(run.module.cfg, "critic_lr", 0.0))
    run.fit()
    return {"params": params, "grads": grads, "samples": steps[0], "lr": lr}


if __name__ == "__main__":
    main(sys.argv[1:])
