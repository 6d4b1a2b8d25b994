"""The Lightning Trainer's hardware and loggers from the config: accelerator, devices, strategy
(data parallel unwrapped, FSDP2, DeepSpeed ZeRO, the NPU plugin's) and precision; W&B or CSV."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from omegaconf import DictConfig, OmegaConf

from glmlight.strategies.checkpoint import AtomicCheckpointIO
from glmlight.strategies.distributed import RLDDPStrategy
from glmlight.errors import ConfigError


def build_loggers(cfg: DictConfig) -> list[Any]:
    lg = cfg.logger
    save_dir = lg.save_dir or cfg.trainer.default_root_dir
    if lg.name == "none":
        return []
    if lg.name == "csv":
        from lightning.pytorch.loggers import CSVLogger

        return [CSVLogger(save_dir, name="csv")]
    from lightning.pytorch.loggers import WandbLogger

    extra = {"mode": "disabled"} if lg.mode == "disabled" else {}
    logger = WandbLogger(project=lg.project, name=cfg.run_name, save_dir=save_dir, offline=lg.mode == "offline",
                         config=_public_config(cfg), **extra)
    return [logger]


def _public_config(cfg: DictConfig) -> dict[str, Any]:
    """The resolved config as stored with the run (it holds env-variable names, never their values)."""
    return OmegaConf.to_container(cfg, resolve=True)


def hardware_kwargs(t: DictConfig) -> dict[str, Any]:
    """Accelerator, devices, strategy and precision. Data-parallel strategies leave the module
    unwrapped (glmlight.strategies.distributed); fsdp is FSDP2 (glmlight.strategies.fsdp) on any accelerator; the NPU
    plugin's DDP and DeepSpeed strategies in their RL form (glmlight.strategies.npu)."""
    if t.strategy == "fsdp":
        return fsdp_kwargs(t)
    if t.accelerator == "npu":
        from glmlight.accelerators import make_npu_trainer_kwargs
        from glmlight.strategies.npu import for_rl

        kwargs = make_npu_trainer_kwargs(t.strategy, t.devices, t.precision, zero_stage=t.zero_stage,
                                         num_nodes=t.num_nodes)
        kwargs["strategy"] = for_rl(kwargs["strategy"], zero_stage=t.zero_stage)
    else:
        strategy: Any = t.strategy
        if strategy == "ddp":
            strategy = RLDDPStrategy()
        elif strategy == "deepspeed":
            require("deepspeed", "trainer.strategy=deepspeed", "glmlight[deepspeed]")
            from glmlight.strategies.zero import RLDeepSpeedStrategy, select_cpu_accelerator

            if t.accelerator == "cpu":
                select_cpu_accelerator()
            strategy = RLDeepSpeedStrategy(stage=t.zero_stage)
        kwargs = dict(accelerator=t.accelerator, devices=t.devices, num_nodes=t.num_nodes, strategy=strategy,
                      precision=t.precision)
    return kwargs


def fsdp_kwargs(t: DictConfig) -> dict[str, Any]:
    """trainer.strategy=fsdp: `RLFSDPStrategy` (FSDP2). A mixed trainer.precision becomes FSDP2's
    MixedPrecisionPolicy (bf16-mixed: bfloat16 parameters, float32 reductions), not autocast."""
    from glmlight.strategies.fsdp import RLFSDPStrategy

    f = t.fsdp
    mixed = {"bf16-mixed": ("bfloat16", "float32"), "16-mixed": ("float16", "float32")}.get(str(t.precision))
    if str(t.precision) not in ("32-true", "32", "bf16-mixed", "16-mixed"):
        raise ConfigError(f"config error: trainer.strategy=fsdp takes trainer.precision 32-true, bf16-mixed or "
                          f"16-mixed (as trainer.fsdp.param_dtype / reduce_dtype), got {t.precision!r}")
    param_dtype = f.param_dtype or (mixed[0] if mixed else None)
    reduce_dtype = f.reduce_dtype or (mixed[1] if mixed else None)
    kwargs: dict[str, Any] = dict(num_nodes=t.num_nodes, precision="32-true")
    backend = f.process_group_backend
    if t.accelerator == "npu":
        from glmlight.accelerators import NPUAccelerator

        accelerator = NPUAccelerator()
        kwargs.update(accelerator=accelerator, devices=accelerator.parse_devices(t.devices))
        backend = backend or "hccl"
    else:
        kwargs.update(accelerator=t.accelerator, devices=t.devices)
    kwargs["strategy"] = RLFSDPStrategy(param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                                        reshard_after_forward=f.reshard_after_forward, process_group_backend=backend)
    return kwargs


def make_trainer(**kwargs: Any) -> pl.Trainer:
    """pl.Trainer with atomic checkpoint files; Lightning's complaints about the hardware settings
    become one-line config errors."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    kwargs["plugins"] = list(kwargs.get("plugins") or []) + [AtomicCheckpointIO()]
    try:
        return pl.Trainer(**kwargs)
    except (MisconfigurationException, ValueError) as e:
        first = str(e).strip().splitlines()[0]
        raise ConfigError(f"config error: trainer (accelerator={kwargs.get('accelerator')!s}, "
                          f"strategy={kwargs.get('strategy')!s}): {first}") from None


def require(module: str, what: str, extra: str) -> None:
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise ConfigError(f"config error: {what} needs the {module} package: pip install '{extra}'")
