"""Two-process data-parallel GRPO on CPU (gloo), run by tests/integration/distributed/test_scale_out.py.

Lightning's launcher starts the second rank by re-running this script. Each rank
writes, after every RL step, a fingerprint of its policy parameters, the engine's
version and the prompts it trained on, to OUT_DIR/rank<r>.jsonl.
"""

import json
import os
import sys

import lightning.pytorch as pl
import torch

import glmlight
from glmlight import compose


class Fingerprint(pl.Callback):
    def __init__(self, out_dir: str):
        self.out_dir = out_dir

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        flat = torch.cat([p.detach().flatten().double() for p in module.policy.parameters()])
        engine_flat = torch.cat([p.detach().flatten().double() for p in trainer.datamodule.engine.model.parameters()])
        row = {"rl_step": module.rl_step, "sum": float(flat.sum()), "sq": float((flat * flat).sum()),
               "engine_sum": float(engine_flat.sum()), "engine_version": trainer.datamodule.engine.version,
               "prompts": sorted({tuple(s.prompt_ids) and s.metadata.get("question", "") for s in batch.samples})}
        with open(os.path.join(self.out_dir, f"rank{trainer.global_rank}.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")


def main(out_dir: str, strategy: str = "ddp") -> None:
    os.makedirs(out_dir, exist_ok=True)
    run = glmlight.build(compose([
        "model.preset=test", "model.warm_start.steps=0", "logger=none", f"trainer.default_root_dir={out_dir}",
        "trainer.max_steps=3", "trainer.enable_progress_bar=false", "rollout.rollout_batch_size=2",
        "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=4", "trainer.checkpoint_every_n_steps=0",
        "task.reward._target_=tests.conftest.digit_fraction_reward", "~callbacks.held_out_eval",
        "~callbacks.sample_table", "trainer.devices=2", f"trainer.strategy={strategy}", "algo.lr=0.01",
    ]))
    run.trainer.callbacks.append(Fingerprint(out_dir))
    run.fit()


if __name__ == "__main__":
    main(sys.argv[1], *(sys.argv[2:3]))
