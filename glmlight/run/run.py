"""A built run: the one home of what happens around `Trainer.fit` — the run's config saved beside
it, the resume checkpoint, the export of the trained policy, the run report, what an interrupted run
says (its last checkpoint's RL step, the steps lost, the command that continues it), and closing the
engine and servers however the run ends. `glmlight.run.build.build` returns a `Run`.
"""

from __future__ import annotations

import logging
import os
import shlex
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from omegaconf import DictConfig, OmegaConf

from glmlight.strategies.checkpoint import checkpoint_global_step, verified_resume_path
from glmlight.engines.base import SeedsSampling
from glmlight.errors import ConfigError

if TYPE_CHECKING:
    from glmlight.data.rollout import RolloutDataModule

log = logging.getLogger(__name__)


@dataclass
class Run:
    trainer: pl.Trainer
    module: pl.LightningModule
    datamodule: RolloutDataModule
    cfg: DictConfig
    # the command line that started this run, without trainer.resume (scripts/train.py sets it): an interrupted
    # run says it with trainer.resume=last as the way to continue
    command: str | None = None

    def fit(self, close: bool = True) -> None:
        """Train. However it ends (done, an error, Ctrl-C, SIGTERM), the run report is written and the run
        is closed afterwards — the engine stopped, servers glmlight started terminated — unless
        `close=False` (then call `close()` yourself, or use `with run:`)."""
        threads = torch.get_num_threads()
        try:
            self._pin_threads()
            if self.trainer.is_global_zero:
                save_run_config(self.cfg, self.trainer.default_root_dir)
            ckpt_path = _resume_path(self.cfg)
            engine = self.datamodule.engine
            if ckpt_path and isinstance(engine, SeedsSampling) and not engine.seeded_sampling:
                log.warning("resuming from %s: the rollout engine ignores per-request seeds (an SGLang server without "
                            "--enable-deterministic-inference), so the samples from here on differ from the "
                            "interrupted run's; steps, weights, optimizer and prompt stream resume exactly", ckpt_path)
            try:
                self.trainer.fit(self.module, datamodule=self.datamodule, ckpt_path=ckpt_path, weights_only=True)
            except (KeyboardInterrupt, SystemExit) as e:  # Ctrl-C (Lightning exits with 1) or SIGTERM
                if self.trainer.interrupted and self.trainer.is_global_zero:
                    log.warning(self.interruption_message(e))
                raise
            if self.cfg.export.enabled and not self.trainer.interrupted:
                self.export()
        finally:
            torch.set_num_threads(threads)  # the caller's own setting again
            try:
                if self.cfg.logger.report and self.trainer.is_global_zero:
                    write_run_report(self.trainer.default_root_dir)
            finally:
                if close:
                    self.close()

    def interruption_message(self, e: BaseException) -> str:
        """What an interrupted fit keeps: the RL step it stopped in, its newest checkpoint's RL step, the
        steps lost, and the command that continues it."""
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        what = "SIGTERM" if isinstance(e, SIGTERMException) or getattr(self.trainer, "received_sigterm", False) \
            else "Ctrl-C" if isinstance(e, KeyboardInterrupt) or isinstance(e.__context__, KeyboardInterrupt) \
            else "an interruption"
        per_step = self.module.optimizer_steps_per_rl_step
        during = min(self.trainer.global_step // per_step + 1, self.cfg.trainer.max_steps)
        every = self.cfg.trainer.checkpoint_every_n_steps
        head = f"interrupted ({what}) during RL step {during}"
        if not every:
            return (f"{head}: checkpoints are off (trainer.checkpoint_every_n_steps=0), so nothing of the training "
                    f"is kept; a new run starts at RL step 1")
        newest = newest_checkpoint(os.path.join(self.cfg.trainer.default_root_dir, "checkpoints"))
        if newest is None:
            return (f"{head}: no checkpoint was written yet (one every {every} RL steps: "
                    f"trainer.checkpoint_every_n_steps), so steps 1-{during} are lost; a new run starts at RL step 1")
        path, step = newest
        resume = "last" if os.path.basename(path) == "last.ckpt" else path
        command = (f"{self.command} trainer.resume={shlex.quote(resume)}" if self.command
                   else f"the same command with trainer.resume={resume}")
        if step is None:
            return (f"{head}: the last checkpoint is {path} (its step could not be read); the steps after it are "
                    f"lost and run again. Continue with: {command}")
        kept = step // per_step
        lost = f"steps {kept + 1}-{during} are lost and run again" if during > kept else "no step is lost"
        return f"{head}: the last checkpoint {path} holds RL step {kept}; {lost}. Continue with: {command}"

    def _pin_threads(self) -> None:
        """trainer.num_threads, or with trainer.deterministic=true os.cpu_count(): the training thread's
        intra-op CPU threads for this fit (a float reduction's order follows how many threads split it, so
        a repeatable run cannot take the count from the environment: OMP_NUM_THREADS, an earlier
        torch.set_num_threads). Deterministic mode also gives an embedded engine whose decode thread would
        take torch's setting (rollout.num_threads=null) the same count, and makes an async producer's
        weight updates land between whole batches (RolloutDataModule.weight_update_point)."""
        t = self.cfg.trainer
        n = t.get("num_threads") or ((os.cpu_count() or 1) if t.deterministic else None)
        if n:
            torch.set_num_threads(int(n))
        if t.deterministic:
            self.datamodule.deterministic = True
            engine = self.datamodule.engine
            if n and getattr(engine, "num_threads", 0) is None:
                engine.num_threads = int(n)
            log.info("trainer.deterministic=true: %d intra-op threads in training, %s in the embedded engine's "
                     "decode thread", n, getattr(engine, "num_threads", "n/a"))

    def export(self, out: str | None = None) -> str | None:
        """The policy (LoRA merged) and tokenizer as a Hugging Face checkpoint: export.dir, default
        <trainer.default_root_dir>/hf (`glmlight.models.export`), written by rank 0. Call it on every
        rank: sharded weights (FSDP2, ZeRO-3) are gathered first, a collective. Returns the path on
        rank 0, None elsewhere."""
        from glmlight.models.export import export_hf
        from glmlight.strategies.fsdp import full_weights, is_sharded

        policy = self.module.policy
        state = {n: t.cpu() for n, t in full_weights(policy)} if is_sharded(policy) else None
        if not self.trainer.is_global_zero:
            return None
        out = out or self.cfg.export.dir or os.path.join(self.trainer.default_root_dir, "hf")
        path = export_hf(policy, self.datamodule.tokenizer, out, state_dict=state)
        log.info("exported the policy to %s", path)
        return path

    def close(self) -> None:
        """Stop the rollout producer, close the engine (and the servers it launched) and the module's
        own engines (OPD's teachers: Lightning skips the module's teardown when fit raises); idempotent."""
        try:
            self.datamodule.close()
        finally:
            self.module.teardown("fit")

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def write_run_report(root: str) -> None:
    """report.png and summary.json of the run in `root` (glmlight.run.report); a failure is a warning."""
    from glmlight.run.report import write_report

    try:
        paths = write_report(root)
        log.info("run report: %s", ", ".join(paths.values()))
    except FileNotFoundError:
        pass  # nothing was logged
    except Exception as e:  # noqa: BLE001 - the report must never hide the run's own outcome
        log.warning("run report not written: %s: %s", type(e).__name__, e)


def newest_checkpoint(folder: str) -> tuple[str, int | None] | None:
    """The checkpoint of `folder` written at the latest global step, and that step (last.ckpt first among
    equals: a kill can land between a periodic checkpoint and last.ckpt); when no step can be read,
    last.ckpt (or the newest file) and None; None when there is no checkpoint."""
    names = [n for n in (sorted(os.listdir(folder)) if os.path.isdir(folder) else [])
             if n.endswith(".ckpt") and ".tmp-" not in n]
    found = []
    for name in names:
        step = checkpoint_global_step(os.path.join(folder, name))
        if step is not None:
            found.append((step, name == "last.ckpt", os.path.join(folder, name)))
    if found:
        step, _, path = max(found)
        return path, step
    if not names:
        return None
    paths = [os.path.join(folder, n) for n in names]
    last = os.path.join(folder, "last.ckpt")
    return (last if last in paths else max(paths, key=os.path.getmtime)), None


def save_run_config(cfg: DictConfig, root: str) -> str:
    """The resolved config, stored with the run (it names env variables, never holds their values)."""
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, "config.yaml")
    OmegaConf.save(cfg, path, resolve=True)
    return path


def _resume_path(cfg: DictConfig) -> str | None:
    resume = cfg.trainer.resume
    if resume in (None, ""):
        return None
    if resume == "last":
        path = os.path.join(cfg.trainer.default_root_dir, "checkpoints", "last.ckpt")
        if not os.path.exists(path):
            log.info("trainer.resume=last: no checkpoint at %s, the run starts at RL step 1", path)
            return None
        return verified_resume_path(path)
    if not os.path.exists(resume):
        raise ConfigError(f"config error: trainer.resume={resume!r} does not exist")
    return verified_resume_path(resume)
