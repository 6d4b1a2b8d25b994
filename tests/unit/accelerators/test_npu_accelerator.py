"""The Ascend NPU plugin (glmlight.accelerators) against the torch_npu stand-in in tests/support/npu_standin.

Real here: Lightning's Trainer, connector, strategies, launcher and loops, gloo, and
every line of the plugin. Stood in: torch_npu itself (``torch.npu`` on CPU, calls
recorded) and, through the plugin's one device indirection, the device type
(``npu:i`` runs as ``cpu:i``). The stand-in is installed per test by the
``standin`` fixture and removed afterwards, so it does not leak into other files.

This file is also the script that the two-process DDP test runs (see ``__main__``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.accelerators import AcceleratorRegistry
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from torch.utils.data import DataLoader, TensorDataset

import glmlight.accelerators.npu as npu_module
from glmlight import accelerators
from glmlight.accelerators import (
    NPUAccelerator,
    NPUDDPStrategy,
    NPUFSDPPrecision,
    NPUFSDPStrategy,
    NPUMixedPrecision,
    SingleNPUStrategy,
    make_npu_trainer_kwargs,
    require_npu,
)
from glmlight.errors import AcceleratorUnavailable, ConfigError

TORCH_NPU_LOADED_BY_IMPORT = "torch_npu" in sys.modules
STANDIN_DIR = Path(__file__).resolve().parents[2] / "support" / "npu_standin"
REAL_TORCH_NPU = importlib.util.find_spec("torch_npu") is not None
QUIET = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False}

# Third-party availability checks that cache "is torch_npu importable?" for the whole process.
_NPU_PROBE_CACHES = (
    ("transformers.utils.import_utils", "is_torch_npu_available"),
    ("accelerate.utils.imports", "is_npu_available"),
)


def _clear_npu_probe_caches() -> None:
    for module_name, attr in _NPU_PROBE_CACHES:
        probe = getattr(sys.modules.get(module_name), attr, None)
        if hasattr(probe, "cache_clear"):
            probe.cache_clear()


def _drop_standin_modules() -> None:
    for name in [n for n in sys.modules if n == "torch_npu" or n.startswith("torch_npu.")]:
        del sys.modules[name]


@pytest.fixture
def standin(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Make ``import torch_npu`` find the stand-in and point the plugin's device type at CPU."""
    if REAL_TORCH_NPU:
        pytest.skip("a real torch_npu is installed; the stand-in would shadow it")
    for var in ("ASCEND_RT_VISIBLE_DEVICES", "NPU_STANDIN_DEVICES", "DS_ACCELERATOR"):
        monkeypatch.delenv(var, raising=False)
    _clear_npu_probe_caches()
    monkeypatch.syspath_prepend(str(STANDIN_DIR))
    import torch_npu

    torch_npu.calls.clear()
    monkeypatch.setattr(npu_module, "device_type", torch_npu.cpu_device_type)
    yield torch_npu
    torch_npu.uninstall()
    _drop_standin_modules()
    _clear_npu_probe_caches()
    assert not hasattr(torch, "npu") and "hccl" not in torch.distributed.Backend.backend_list


class TinyRegression(L.LightningModule):
    """y = sum(x): a Linear layer learns it; records device, autocast dtype and process-group backend."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.seen: list[dict[str, Any]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self.layer(x)
        backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else None
        self.seen.append({"device": str(x.device), "dtype": str(out.dtype), "backend": backend})
        return F.mse_loss(out.float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader:
        x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=8)


class DeviceStatsProbe(L.Callback):
    """What Lightning's DeviceStatsMonitor does per batch: ask the accelerator for the root device's
    stats. (DeviceStatsMonitor itself special-cases a CPU root device, which the stand-in's are.)"""

    def __init__(self) -> None:
        self.stats: list[dict[str, Any]] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.stats.append(trainer.accelerator.get_device_stats(trainer.strategy.root_device))


def _one_line(err: BaseException) -> str:
    text = str(err)
    assert "\n" not in text, text
    return text


# --------------------------------------------------------------------------- registration


def test_import_registers_npu_without_importing_torch_npu() -> None:
    assert not TORCH_NPU_LOADED_BY_IMPORT
    assert AcceleratorRegistry["npu"]["accelerator"] is NPUAccelerator
    assert NPUAccelerator.name() == "npu"
    assert {"ddp_npu", "ddp_spawn_npu", "deepspeed_npu", "fsdp_npu"} <= set(StrategyRegistry)


def test_registering_twice_is_harmless() -> None:
    accelerators.register()
    NPUAccelerator.register_accelerators(AcceleratorRegistry)
    accelerators.register()
    assert AcceleratorRegistry["npu"]["accelerator"] is NPUAccelerator


# --------------------------------------------------------------------------- missing runtime


@pytest.mark.skipif(REAL_TORCH_NPU, reason="torch_npu is installed here")
def test_require_npu_without_torch_npu_is_one_clear_line() -> None:
    with pytest.raises(AcceleratorUnavailable) as err:
        require_npu()
    line = _one_line(err.value)
    assert "torch_npu is not importable" in line
    assert "pip install 'glmlight[npu]'" in line and "CANN toolkit" in line
    assert NPUAccelerator.is_available() is False
    with pytest.raises(AcceleratorUnavailable, match="torch_npu is not importable"):
        L.Trainer(accelerator="npu", **QUIET)


def test_require_npu_without_a_device_names_visibility(standin: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NPU_STANDIN_DEVICES", "0")
    with pytest.raises(AcceleratorUnavailable) as err:
        require_npu()
    line = _one_line(err.value)
    assert "imports but sees no NPU device" in line
    assert "ASCEND_RT_VISIBLE_DEVICES" in line and "npu-smi info" in line
    assert NPUAccelerator.is_available() is False


def test_visible_devices_are_counted_by_torch_npu(standin: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NPU_STANDIN_DEVICES", "8")
    assert NPUAccelerator.auto_device_count() == 8
    assert NPUAccelerator.parse_devices(-1) == list(range(8))
    assert NPUAccelerator.parse_devices("0,3") == [0, 3]
    assert NPUAccelerator.parse_devices("2") == [0, 1]
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "6,7")
    assert NPUAccelerator.auto_device_count() == 2
    with pytest.raises(AcceleratorUnavailable, match="ASCEND_RT_VISIBLE_DEVICES='6,7'") as err:
        NPUAccelerator.parse_devices([2])
    _one_line(err.value)
    with pytest.raises(ConfigError):
        NPUAccelerator.parse_devices("0,0")
    # indexes are relative to the visible list: the second visible NPU is index 1
    trainer = L.Trainer(accelerator="npu", devices=[1], **QUIET)
    assert trainer.strategy.root_device == torch.device("cpu", 1)
    assert "device_count" in standin.names()


# --------------------------------------------------------------------------- resolution


def test_trainer_resolves_npu_accelerator_and_strategies(standin: Any) -> None:
    trainer = L.Trainer(accelerator="npu", **QUIET)  # the stand-in has 2 NPUs by default
    assert isinstance(trainer.accelerator, NPUAccelerator)
    assert isinstance(trainer.strategy, NPUDDPStrategy)
    assert trainer.strategy.root_device == torch.device("cpu", 0)  # npu:0, redirected
    assert ("device_type", "npu->cpu") in standin.calls
    assert trainer.strategy.process_group_backend == "hccl"
    assert isinstance(trainer.strategy.launcher, _SubprocessScriptLauncher)  # fresh processes, never fork

    single = L.Trainer(accelerator="npu", devices=1, **QUIET)
    assert isinstance(single.strategy, SingleNPUStrategy)  # not Lightning's CPU SingleDeviceStrategy
    assert single.strategy.root_device == torch.device("cpu", 0)


def test_precision_plugin_autocasts_on_npu(standin: Any) -> None:
    trainer = L.Trainer(accelerator="npu", devices=1, precision="bf16-mixed", **QUIET)
    plugin = trainer.precision_plugin
    assert isinstance(plugin, NPUMixedPrecision) and plugin.device == "npu"
    standin.calls.clear()
    with plugin.forward_context():
        out = torch.nn.Linear(2, 2)(torch.ones(1, 2))
    assert out.dtype == torch.bfloat16
    assert standin.names() == ["device_type"]  # autocast("npu") is the one redirected call

    fp16 = L.Trainer(accelerator="npu", devices=1, precision="16-mixed", **QUIET).precision_plugin
    assert isinstance(fp16, NPUMixedPrecision) and fp16.scaler is not None


def test_ddp_strategy_uses_hccl_and_refuses_fork() -> None:
    strategy = NPUDDPStrategy()
    assert strategy.process_group_backend == "hccl"
    assert strategy._get_process_group_backend() == "hccl"
    assert StrategyRegistry.get("ddp_spawn_npu")._start_method == "spawn"
    with pytest.raises(ConfigError, match="forked child"):
        NPUDDPStrategy(start_method="fork")  # type: ignore[arg-type]


def test_get_device_stats_reads_memory_stats(standin: Any) -> None:
    stats = NPUAccelerator().get_device_stats(npu_module.npu_device(1))
    assert stats["allocated_bytes.all.current"] == 0 and "num_ooms" in stats
    assert ("memory_stats", 1) in standin.calls


def test_setup_device_refuses_a_non_npu_device(standin: Any) -> None:
    with pytest.raises(ConfigError, match="not an NPU strategy"):
        NPUAccelerator().setup_device(torch.device("meta"))


# --------------------------------------------------------------------------- make_npu_trainer_kwargs


def test_make_npu_trainer_kwargs(standin: Any) -> None:
    auto = make_npu_trainer_kwargs()
    assert isinstance(auto["accelerator"], NPUAccelerator) and auto["devices"] == [0, 1]
    assert isinstance(auto["strategy"], NPUDDPStrategy)
    assert [type(p) for p in auto["plugins"]] == [NPUMixedPrecision] and "precision" not in auto

    single = make_npu_trainer_kwargs(devices=[1], precision="32")
    assert isinstance(single["strategy"], SingleNPUStrategy) and single["precision"] == "32-true"
    assert single["strategy"].root_device == torch.device("cpu", 1)

    fsdp = make_npu_trainer_kwargs("fsdp", devices=2, precision="bf16-mixed")
    assert isinstance(fsdp["strategy"], NPUFSDPStrategy) and fsdp["strategy"].process_group_backend == "hccl"
    assert [type(p) for p in fsdp["plugins"]] == [NPUFSDPPrecision]
    assert make_npu_trainer_kwargs("fsdp", devices=2, precision="16-mixed")["plugins"][0].scaler is not None

    for kwargs in (auto, single, fsdp):
        trainer = L.Trainer(**kwargs, **QUIET)
        assert trainer.strategy is kwargs["strategy"] and isinstance(trainer.accelerator, NPUAccelerator)

    with pytest.raises(ConfigError, match="must be one of"):
        make_npu_trainer_kwargs("horovod")
    with pytest.raises(ConfigError, match="one NPU"):
        make_npu_trainer_kwargs("single", devices=2)


def test_deepspeed_strategy_sets_ds_accelerator_before_import(standin: Any) -> None:
    if importlib.util.find_spec("deepspeed") is not None:
        pytest.skip("deepspeed is installed: see test_deepspeed_strategy_constructs")
    with pytest.raises(AcceleratorUnavailable, match=r"pip install 'glmlight\[deepspeed\]'") as err:
        make_npu_trainer_kwargs("deepspeed", devices=2, zero_stage=3)
    _one_line(err.value)
    assert os.environ["DS_ACCELERATOR"] == "npu"  # set before deepspeed could be imported


# DeepSpeed fixes its accelerator for the whole process when first imported, so construction
# runs in a child process: importing it here would leave an NPU-flavoured deepspeed behind.
_DEEPSPEED_CHILD = """
import json, sys
import glmlight.accelerators.npu as npu_module
sys.path.insert(0, sys.argv[1])
import torch_npu
npu_module.device_type = torch_npu.cpu_device_type
import os
from glmlight.accelerators import NPUDeepSpeedStrategy, make_npu_trainer_kwargs
kwargs = make_npu_trainer_kwargs("deepspeed", devices=2, zero_stage=3)
from deepspeed.accelerator import get_accelerator
strategy = kwargs["strategy"]
print(json.dumps({
    "ds_accelerator_env": os.environ["DS_ACCELERATOR"],
    "ds_device": get_accelerator().device_name(),
    "is_npu_strategy": isinstance(strategy, NPUDeepSpeedStrategy),
    "stage": strategy.config["zero_optimization"]["stage"],
    "backend": strategy.process_group_backend,
    "precision": kwargs["precision"],
}))
"""


def test_deepspeed_strategy_constructs() -> None:
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (pip install 'glmlight[deepspeed]')")
    if REAL_TORCH_NPU:
        pytest.skip("a real torch_npu is installed; the stand-in would shadow it")
    env = {k: v for k, v in os.environ.items() if k not in ("DS_ACCELERATOR", "ASCEND_RT_VISIBLE_DEVICES")}
    done = subprocess.run(
        [sys.executable, "-c", _DEEPSPEED_CHILD, str(STANDIN_DIR)],
        check=False,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report == {
        "ds_accelerator_env": "npu",
        "ds_device": "npu",
        "is_npu_strategy": True,
        "stage": 3,
        "backend": "hccl",
        "precision": "bf16-mixed",
    }


# --------------------------------------------------------------------------- training


def test_two_step_fit_goes_through_the_plugin(standin: Any) -> None:
    model, probe = TinyRegression(), DeviceStatsProbe()
    before = model.layer.weight.detach().clone()
    trainer = L.Trainer(
        accelerator="npu", devices=1, precision="bf16-mixed", max_steps=2, callbacks=[probe], **QUIET
    )
    trainer.fit(model)

    assert trainer.global_step == 2
    assert len(probe.stats) == 2 and "allocated_bytes.all.peak" in probe.stats[0]
    assert not torch.equal(before, model.layer.weight.detach())
    assert [s["dtype"] for s in model.seen] == ["torch.bfloat16", "torch.bfloat16"]  # autocast on "npu"
    names = standin.names()
    assert ("set_device", "cpu:0", 0) in standin.calls  # NPUAccelerator.setup_device
    assert names.index("set_device") < names.index("memory_stats")  # device stats after setup
    assert "empty_cache" in names  # NPUAccelerator.teardown
    assert ("device_type", "npu->cpu") in standin.calls


def test_fit_refuses_a_cuda_autocast_plugin(standin: Any) -> None:
    trainer = L.Trainer(
        accelerator="npu", devices=1, max_steps=1, plugins=[MixedPrecision("bf16-mixed", "cuda")], **QUIET
    )
    with pytest.raises(ConfigError, match="autocasts on 'cuda'"):
        trainer.fit(TinyRegression())


@pytest.mark.slow
def test_two_process_ddp_over_hccl(tmp_path: Path) -> None:
    """Two real processes (Lightning's popen launcher), process group "hccl" served by gloo."""
    if REAL_TORCH_NPU:
        pytest.skip("a real torch_npu is installed; the stand-in would shadow it")
    env = {k: v for k, v in os.environ.items() if k not in ("ASCEND_RT_VISIBLE_DEVICES", "LOCAL_RANK")}
    env.update(NPU_STANDIN_DDP_OUT=str(tmp_path), NPU_STANDIN_DEVICES="2", PYTHONUNBUFFERED="1")
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve())],
        check=False,
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank, report in enumerate(reports):
        assert report["global_step"] == 2
        assert {s["backend"] for s in report["seen"]} == {"hccl"}
        assert {s["device"] for s in report["seen"]} == {"cpu"}  # a tensor on cpu:i reports plain "cpu"
        assert ["set_device", f"cpu:{rank}", rank] in report["calls"]
        assert ["hccl_process_group", rank, 2] in report["calls"]
    assert reports[0]["weight"] == reports[1]["weight"]  # gradients were all-reduced
    print(f"two-process DDP took {time.monotonic() - start:.1f}s")


def _ddp_main(out_dir: Path) -> None:
    """One DDP rank: Lightning re-runs this file for local rank 1 (popen launcher)."""
    sys.path.insert(0, str(STANDIN_DIR))
    import torch_npu

    npu_module.device_type = torch_npu.cpu_device_type
    trainer = L.Trainer(accelerator="npu", devices=2, max_steps=2, **QUIET)
    model = TinyRegression()
    trainer.fit(model)
    report = {
        "global_step": trainer.global_step,
        "seen": model.seen,
        "calls": torch_npu.calls,
        "weight": model.layer.weight.detach().flatten().tolist(),
    }
    (out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(report, default=str))


if __name__ == "__main__":
    _ddp_main(Path(os.environ["NPU_STANDIN_DDP_OUT"]))


def test_sao_on_npu_config_trains_through_the_plugin(standin: Any, tmp_path: Path) -> None:
    """`algo=sao accelerator=npu`: the real SAO module, embedded engine and Trainer on the plugin."""
    import glmlight
    from tests.conftest import overrides_for_tests
    from glmlight import compose

    run = glmlight.build(compose(overrides_for_tests(
        tmp_path, "algo=sao", "accelerator=npu", "trainer.devices=1", "trainer.max_steps=2",
        "rollout.mode=sync", "rollout.rollout_batch_size=4", "~callbacks.held_out_eval", "~callbacks.sample_table")))
    assert isinstance(run.trainer.accelerator, NPUAccelerator)
    assert isinstance(run.trainer.strategy, SingleNPUStrategy)
    assert run.trainer.precision_plugin.device == "npu"
    run.fit()
    assert run.module.policy_version == 2
    assert ("set_device", "cpu:0", 0) in standin.calls
    assert ("device_type", "npu->cpu") in standin.calls


def test_fsdp2_on_npu_config_trains_through_the_plugin(standin: Any, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """`accelerator=npu trainer.strategy=fsdp`: FSDP2 over hccl with the NPU accelerator, one process."""
    from lightning.fabric.plugins.environments.lightning import find_free_network_port

    import glmlight
    from glmlight import compose
    from glmlight.strategies.fsdp import RLFSDPStrategy
    from tests.conftest import overrides_for_tests

    run = glmlight.build(compose(overrides_for_tests(
        tmp_path, "accelerator=npu", "trainer.strategy=fsdp", "trainer.devices=1", "trainer.max_steps=1",
        "~callbacks.held_out_eval", "~callbacks.sample_table")))
    assert isinstance(run.trainer.accelerator, NPUAccelerator)
    strategy = run.trainer.strategy
    assert isinstance(strategy, RLFSDPStrategy) and strategy.process_group_backend == "hccl"
    assert (strategy.param_dtype, strategy.reduce_dtype) == (torch.bfloat16, torch.float32)  # npu.yaml: bf16-mixed
    # the rendezvous of this one-process group, and the LOCAL_RANK / NODE_RANK Lightning sets for it, must
    # not leak into later tests' processes (a child that sees LOCAL_RANK thinks its ranks are launched)
    saved = dict(os.environ)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(find_free_network_port()))
    try:
        run.fit()
        assert run.module.policy_version == 1 and torch.distributed.get_backend() == "hccl"
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved)
    assert ("set_device", "cpu:0", 0) in standin.calls
