"""The RL strategies (glmlight/strategies/): each declares, on its class, what an RL module reads of it
(`RLStrategy`, glmlight/strategies/base.py), and the strategies built from the config are configured by
their classes, never patched as live objects. (DeepSpeed is not installed here: its forms are checked
as classes; tests/system/test_fsdp.py runs them where it is.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from lightning.pytorch.strategies import DeepSpeedStrategy
from omegaconf import OmegaConf

from glmlight.strategies.base import RLStrategy, rl_strategy
from glmlight.strategies.distributed import RLDDPStrategy
from glmlight.strategies.fsdp import RLFSDPStrategy
from glmlight.strategies.trainer_setup import hardware_kwargs
from glmlight.strategies.zero import RLDeepSpeedStrategy, ZeroForRL

FLAGS = ("rl_gradient_sync", "rl_sharded", "rl_engine_steps")


@pytest.mark.parametrize("cls, flags", [(RLDDPStrategy, (True, False, False)), (RLFSDPStrategy, (False, True, False)),
                                        (ZeroForRL, (False, True, True)), (RLDeepSpeedStrategy, (False, True, True))])
def test_every_rl_strategy_declares_the_protocol_on_its_class(cls, flags):
    assert tuple(getattr(cls, f) for f in FLAGS) == flags
    assert callable(cls.configure_for) and callable(cls.shard)


def test_strategies_from_the_config_are_rl_strategies_of_their_own_class():
    cfg = OmegaConf.create({"accelerator": "cpu", "strategy": "ddp", "devices": 2, "num_nodes": 1,
                            "precision": "32-true", "zero_stage": 2})
    ddp = hardware_kwargs(cfg)["strategy"]
    assert type(ddp) is RLDDPStrategy and isinstance(ddp, RLStrategy)
    assert not {"configure_ddp", "configure_for", *FLAGS} & set(vars(ddp))  # nothing set on the live object
    assert rl_strategy(SimpleNamespace(strategy=ddp)) is ddp
    assert rl_strategy(SimpleNamespace(strategy=SimpleNamespace())) is None and rl_strategy(None) is None
    fsdp = hardware_kwargs(OmegaConf.merge(cfg, {"strategy": "fsdp", "fsdp": {
        "param_dtype": None, "reduce_dtype": None, "reshard_after_forward": True, "process_group_backend": None}}))
    assert isinstance(fsdp["strategy"], RLFSDPStrategy) and isinstance(fsdp["strategy"], RLStrategy)


def test_the_npu_plugins_strategies_in_their_rl_form():
    from glmlight.accelerators.strategies import NPUDDPStrategy, NPUDeepSpeedStrategy
    from glmlight.strategies.npu import RLNPUDDPStrategy, RLNPUDeepSpeedStrategy, for_rl

    ddp = for_rl(NPUDDPStrategy(), zero_stage=2)
    assert type(ddp) is RLNPUDDPStrategy and isinstance(ddp, NPUDDPStrategy) and isinstance(ddp, RLStrategy)
    assert ddp.process_group_backend == "hccl" and ddp.rl_gradient_sync and not ddp.rl_sharded
    assert type(ddp).configure_ddp is RLDDPStrategy.configure_ddp  # the module stays unwrapped
    other = SimpleNamespace()
    assert for_rl(other, zero_stage=2) is other  # one NPU: as it is
    # ZeRO on NPUs: the plugin's environment and Lightning's DeepSpeed set-up, with ZeroForRL's RL parts
    assert issubclass(RLNPUDeepSpeedStrategy, NPUDeepSpeedStrategy) and issubclass(RLNPUDeepSpeedStrategy, ZeroForRL)
    assert RLNPUDeepSpeedStrategy.setup_environment is NPUDeepSpeedStrategy.setup_environment
    assert RLNPUDeepSpeedStrategy._setup_model_and_optimizer is DeepSpeedStrategy._setup_model_and_optimizer
    assert RLNPUDeepSpeedStrategy.configure_for is ZeroForRL.configure_for
    assert tuple(getattr(RLNPUDeepSpeedStrategy, f) for f in FLAGS) == (False, True, True)


def test_configure_model_hands_the_module_and_its_models_to_the_strategy():
    from glmlight.algorithms.grpo import GRPO, GRPOConfig
    from glmlight.models.loading import load_causal_lm
    from glmlight.models.tokenizer import build_char_tokenizer

    class Recording:  # an RLStrategy that records what the module hands it
        rl_gradient_sync, rl_engine_steps = False, False

        def __init__(self, sharded):
            self.rl_sharded, self.calls = sharded, []

        def configure_for(self, module):
            self.calls.append(("configure_for", module))

        def shard(self, model):
            self.calls.append(("shard", model))
            return model

    module = GRPO(GRPOConfig(kl_coef=0.1), load_causal_lm(None, build_char_tokenizer(), preset="test", seed=0))
    for sharded in (True, False):
        strategy = Recording(sharded)
        module.trainer = SimpleNamespace(strategy=strategy, world_size=2)
        module.configure_model()
        shards = [("shard", m) for m in (module.policy, *module.scoring.reference)] if sharded else []
        assert strategy.calls == [("configure_for", module), *shards]
        assert module.parallel.sharded is sharded and module.parallel.ranks_may_skip_rows() is False
