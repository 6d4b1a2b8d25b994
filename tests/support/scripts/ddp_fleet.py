"""Two-process data-parallel GRPO on CPU (gloo) sharing one fleet of two real servers, run by
tests/integration/distributed/test_shared_fleet.py.

    python -m tests.support.scripts.ddp_fleet OUT_DIR BACKEND PYTHON CHECKPOINT
    torchrun --nnodes=2 --nproc-per-node=1 --node-rank=N --master-addr=127.0.0.1 --master-port=P \
        -m tests.support.scripts.ddp_fleet OUT_DIR BACKEND PYTHON CHECKPOINT URL1,URL2

With URLs (two nodes of one process each, started at once by torchrun): rank 0 launches the servers there
and rank 1 joins them.

Rank 0 launches the fleet when the run is built; Lightning starts rank 1 by re-running this script, and rank 1
joins that fleet as a client. After every RL step each rank writes to OUT_DIR/rank<r>.jsonl: a fingerprint of
its policy, its engine's version, URLs and launched servers, and the questions it trained on.
"""

import json
import os
import sys

import lightning.pytorch as pl
import torch
from omegaconf import OmegaConf

import glmlight
from glmlight import compose
from tests.support.real_servers import FLAGS, ENV_VARS


class Fingerprint(pl.Callback):
    def __init__(self, out_dir: str):
        self.out_dir = out_dir

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        engine = trainer.datamodule.engine
        flat = torch.cat([p.detach().flatten().double() for p in module.policy.parameters()])
        row = {"rl_step": module.rl_step, "sum": float(flat.sum()), "sq": float((flat * flat).sum()),
               "engine_version": engine.version, "urls": list(engine.urls), "owns": engine.owns_fleet,
               "launched": sorted(engine.launchers), "versions": sorted({v for s in batch.samples for v in s.versions}),
               "pgids": [m.pgid for m in engine.launchers.values()],
               "prompts": sorted({s.metadata.get("question", "") for s in batch.samples})}
        with open(os.path.join(self.out_dir, f"rank{trainer.global_rank}.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")


def main(out_dir: str, backend: str, python: str, ckpt: str, urls: str = "") -> None:
    os.makedirs(out_dir, exist_ok=True)
    placement = (["trainer.devices=1", "trainer.num_nodes=2", f"rollout.server.urls=[{urls}]"] if urls else
                 ["trainer.devices=2", "rollout.server.urls=[]"])
    cfg = compose([
        f"rollout={backend}", "model=hf", f"model.path={ckpt}", "model.dtype=float32", "model.warm_start.steps=0",
        "logger=none", f"trainer.default_root_dir={out_dir}", "trainer.max_steps=3", "trainer.enable_progress_bar=false",
        "rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=4",
        "trainer.checkpoint_every_n_steps=0", "task.reward._target_=tests.conftest.digit_fraction_reward",
        "~callbacks.held_out_eval", "~callbacks.sample_table", "trainer.strategy=ddp",
        "algo.lr=0.001", *placement, "rollout.server.launch=true", "rollout.server.num_servers=2",
        "rollout.server.weight_sync=tensor", "rollout.server.api_key_env=null",
    ])
    OmegaConf.set_struct(cfg, False)
    cfg.rollout.server.launch_python = python
    cfg.rollout.server.launch_args = FLAGS[(backend, "cpu")]
    cfg.rollout.server.launch_env = ENV_VARS[(backend, "cpu")]
    cfg.rollout.server.sync_backend = "gloo"
    run = glmlight.build(cfg)
    run.trainer.callbacks.append(Fingerprint(out_dir))
    run.fit()


if __name__ == "__main__":
    main(*sys.argv[1:6])
