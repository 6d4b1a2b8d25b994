"""rollout.speculative.depth with a managed SGLang or vLLM server: the MTP speculative flags on the server's
command line, checked against the servers' own sources (SGLang 0.5.23, vLLM 0.32, read as text through
tests/support/server_sources.py; nothing of them is imported or started here), and where a speculating server
takes the synced MTP weights. Real launches: docs/servers.md, "Speculative decoding"."""

from __future__ import annotations

import json
import re

import pytest
import torch
from omegaconf import OmegaConf

from glmlight.config.schema import validate
from glmlight.engines.servers.launch import sglang_launch, speculative_launch_options, vllm_launch
from glmlight.engines.servers.settings import server_settings
from glmlight.engines.servers.worker.vllm_extension import WeightLoaderExtension
from glmlight.errors import ConfigError
from tests.support.server_sources import server_source


def _launch_config(tmp_path, backend: str, depth: int, **server):
    c = OmegaConf.create(OmegaConf.to_container(validate(
        {"rollout": {"backend": backend, "speculative": {"depth": depth},
                     "server": {"launch": True, "model_path": str(tmp_path), **server}},
         "trainer": {"default_root_dir": str(tmp_path), "accelerator": "gpu"}}), resolve=True))
    return c, server_settings(c)


def _after(cmd: list[str], flag: str) -> str:
    assert cmd.count(flag) == 1, cmd
    return cmd[cmd.index(flag) + 1]


def test_a_managed_launch_adds_the_backends_mtp_speculative_flags(tmp_path):
    cmd = sglang_launch(*_launch_config(tmp_path, "sglang", 3)).command
    assert (_after(cmd, "--speculative-algorithm"), _after(cmd, "--speculative-num-steps"),
            _after(cmd, "--speculative-eagle-topk"), _after(cmd, "--speculative-num-draft-tokens")) == ("NEXTN", "3", "1", "4")
    for backend in ("vllm", "vllm_ascend"):
        cmd = vllm_launch(*_launch_config(tmp_path, backend, 2)).command
        assert json.loads(_after(cmd, "--speculative-config")) == {"method": "mtp", "num_speculative_tokens": 2}
    # depth 0: nothing; the launch arguments' own choice wins
    assert not [a for a in sglang_launch(*_launch_config(tmp_path, "sglang", 0)).command if "speculative" in a]
    assert not [a for a in vllm_launch(*_launch_config(tmp_path, "vllm", 0)).command if "speculative" in a]
    own = ["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}']
    assert vllm_launch(*_launch_config(tmp_path, "vllm", 2, launch_args=own)).command.count("--speculative-config") == 1
    assert speculative_launch_options("sglang", 2, ["--speculative-algorithm", "EAGLE"]) == []


def test_speculation_with_a_server_needs_a_managed_launch_off_the_cpu():
    """A server of one's own takes its flags from whoever starts it; on CPU neither server's build speculates
    correctly (measured: docs/results/servers.md, "Speculative decoding on the CPU servers")."""
    def check(backend, server, accelerator, match):
        with pytest.raises(ConfigError, match=match) as err:
            validate({"rollout": {"backend": backend, "speculative": {"depth": 2}, "server": server},
                      "trainer": {"accelerator": accelerator}})
        assert "\n" not in str(err.value) and str(err.value).startswith("config error: ")

    for server in ({"urls": ["http://127.0.0.1:9"]}, {"in_process": True, "launch": False}):
        check("vllm", server, "gpu", "rollout.server.launch=true")
    check("sglang", {"launch": True}, "cpu", "copy_all_layer_kv_cache_cpu")
    check("vllm", {"launch": True}, "cpu", "token 0 at log-prob 0.0")
    for backend in ("sglang", "vllm"):
        validate({"rollout": {"backend": backend, "speculative": {"depth": 2}, "server": {"launch": True}},
                  "trainer": {"accelerator": "gpu"}})


def test_the_flags_are_the_servers_own():
    """Each flag is a field of the server's arguments with the meaning glmlight gives it."""
    spec = server_source("sglang", "sglang/srt/arg_groups/fields/spec.py")
    for field in ("speculative_algorithm", "speculative_num_steps", "speculative_eagle_topk",
                  "speculative_num_draft_tokens"):
        assert re.search(rf"^\s+{field}: A\[", spec, re.M), field  # the CLI flag is the field's name with dashes
    assert "Builtins: EAGLE, EAGLE3, NEXTN," in spec[spec.index("speculative_algorithm: A["):][:300]
    registry = server_source("sglang", "sglang/srt/speculative/spec_registry.py")
    assert '_RESERVED_ALIASES = frozenset({"NEXTN"})' in registry  # NEXTN: an alias of EAGLE
    hook = server_source("sglang", "sglang/srt/arg_groups/speculative_hook.py")
    # the GLM architectures draft from the target checkpoint's own MTP layer (no draft path needed)
    start = hook.index("model_arch = model_config_of(server_args)")
    arches = hook[start:hook.index("_handle_iquest_q1_mtp_draft(server_args)\n", start)]
    assert all(f'"{a}"' in arches for a in ("GlmMoeDsaForCausalLM", "Glm4MoeForCausalLM", "Glm4MoeLiteForCausalLM"))
    assert "speculative_draft_model_path=cfg.model_path" in arches

    vspec = server_source("vllm", "vllm/config/speculative.py")
    types = vspec[vspec.index("MTPModelTypes = Literal["):]
    assert '"mtp",' in types[:types.index("]")]
    assert re.search(r"^\s+num_speculative_tokens: ", vspec, re.M) and re.search(r"^\s+method: ", vspec, re.M)
    # "mtp" on a GLM-5 / GLM-4.5 checkpoint: its own MTP layers as the draft
    assert '"glm_moe_dsa",' in vspec and 'hf_config.model_type = "deepseek_mtp"' in vspec
    assert 'hf_config.architectures[0] == "Glm4MoeForCausalLM"' in vspec
    assert '"--speculative-config"' in server_source("vllm", "vllm/engine/arg_utils.py")


def test_a_speculating_server_takes_the_synced_mtp_weights():
    """SGLang: a tensor or distributed update goes to every runner, the draft's too (selector "all" by default;
    glmlight sends none), whose NextN loader keeps model.layers.{num_hidden_layers}.*. vLLM: the draft model is
    the model runner's `drafter.model`, outside the served model, so the worker extension loads the same tensors
    into it; its MTP loaders keep the MTP layer's names, and its embedding and heads are the served model's."""
    io = server_source("sglang", "sglang/srt/managers/io_struct.py")
    for req in ("UpdateWeightsFromTensorReqInput", "UpdateWeightsFromDistributedReqInput"):
        body = io[io.index(f"class {req}"):]
        body = body[:body.index("\nclass ", 1)]
        assert 'selector: Literal["target", "draft", "all"] = "all"' in body, req
    updater = server_source("sglang", "sglang/srt/managers/scheduler_components/weight_updater.py")
    assert 'if "draft" in roles and self.draft_worker is not None:' in updater
    from glmlight.engines.servers.sglang import sync as sglang_tensor_sync, wire as sglang_wire
    import inspect
    assert "selector" not in inspect.getsource(sglang_tensor_sync) + inspect.getsource(sglang_wire)

    runner = server_source("vllm", "vllm/v1/worker/gpu_model_runner.py")
    assert "self.drafter: (" in runner and "| EagleProposer" in runner
    assert "self.model = self._get_model()" in server_source("vllm", "vllm/v1/spec_decode/llm_base_proposer.py")
    for rel in ("glm4_moe_mtp.py", "deepseek_mtp.py"):  # the MTP layer's names; the rest skipped
        loader = server_source("vllm", f"vllm/model_executor/models/{rel}")
        assert "get_spec_layer_idx_from_weight_name(self.config, name)" in loader, rel
    # an MTP draft's embedding and heads (shared_head.head of every layer) are the served model's modules:
    # the served model's update reaches them
    proposer = server_source("vllm", "vllm/v1/spec_decode/llm_base_proposer.py")
    share = proposer[proposer.index("def _maybe_share_lm_head"):]
    assert "# MTP model\n            share_lm_head = True" in share and "sh.head = target_language_model.lm_head" in share
    assert "self.model.model.embed_tokens = target_embed_tokens" in proposer

    # the extension's models: the served one, then the drafter's; a module they share is copied once
    shared = torch.nn.Linear(2, 2)
    served, draft = torch.nn.Sequential(shared, torch.nn.Linear(2, 2)), torch.nn.Sequential(shared, torch.nn.Linear(2, 3))

    class Runner:
        def get_model(self):
            return served

    ext = WeightLoaderExtension()
    ext.model_runner = Runner()
    assert ext._gl_models() == [served]
    ext.model_runner.drafter = type("Drafter", (), {"model": draft})()
    assert ext._gl_models() == [served, draft]
    modules = [m for m, *_ in ext._gl_snapshot()]
    assert len(modules) == len({id(m) for m in modules}) == 5  # two containers, one own layer each, the shared one
