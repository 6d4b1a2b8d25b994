"""glmlight.models.mtp (the MTP layers: built, loaded, named) and the two MTP training forwards
(glmlight.models.glm5.forward.forward_logits_mtp, glmlight.models.mtp_forward.hf_forward_logits_mtp).

The forwards are compared with each other within the float32 limits of tests/support/tolerances.py, and with
a computation by hand that runs each MTP depth on growing prefixes (no attention mask to get wrong) and reads
the positions off the definition: depth d at position t takes h^{d-1}_t and the embedding of token t + d and
predicts token t + d + 1. The export's names are checked against the names SGLang 0.5.23's and vLLM 0.32's
MTP loaders read, parsed from their sources as text (nothing of them is imported).
"""

from __future__ import annotations

import ast
import json
import logging
import os
import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from glmlight.errors import ConfigError
from glmlight.models.export import export_hf
from glmlight.models.glm5.forward import forward_logits, forward_logits_mtp
from glmlight.models.loading import load_causal_lm, load_tokenizer
from glmlight.models.mtp import attach_mtp, checkpoint_tensors, mtp_of, to_checkpoint_names
from glmlight.models.mtp_forward import hf_forward_logits_mtp
from glmlight.ops.mtp import mtp_input
from tests.support.server_sources import server_source
from tests.support.tolerances import dims, gradient_tolerances, model_logit_tolerance, within


def _model(tokenizer, layers: int = 2, seed: int = 3, **overrides) -> torch.nn.Module:
    model = load_causal_lm(None, tokenizer, preset="test", seed=0, **overrides)
    attach_mtp(model, layers, seed=seed)
    return model


def _batch(vocab: int, B: int = 3, S: int = 24, seed: int = 0):
    """A left-padded prompt and right-padded response per row (row 0: 3 | 4 padding), as the trainer's."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, S, dtype=torch.long)
    mask[0, 3:S - 4] = 1
    for b in range(1, B):
        mask[b, int(torch.randint(0, 6, (1,), generator=g)):S - int(torch.randint(0, 8, (1,), generator=g))] = 1
    ids = torch.randint(6, vocab, (B, S), generator=g) * mask
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def _window(mask: torch.Tensor, start: int, d: int) -> torch.Tensor:
    """[B, S - start]: the entries of depth d's logits that have an input (position start - d + i is real and
    has a real token d ahead)."""
    B, S = mask.shape
    real = mask.bool()
    ok = torch.zeros_like(real)
    ok[:, : S - d] = real[:, : S - d] & real[:, d:]
    pos = torch.arange(S - start) + start - d
    return torch.where(pos >= 0, ok[:, pos.clamp(min=0)], torch.zeros_like(ok[:, : S - start]))


def test_fresh_mtp_layers_are_decoder_blocks_with_their_own_norms_and_projection(tokenizer):
    model = load_causal_lm(None, tokenizer, preset="test", seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    assert attach_mtp(model, 2, seed=5) == 2
    assert torch.equal(torch.get_rng_state(), rng)  # the global RNG is left as it was
    assert model.config.num_nextn_predict_layers == 2 and mtp_of(model).first_layer == 2
    H = model.config.hidden_size
    layer = model.mtp.layers[1]
    assert layer.eh_proj.weight.shape == (H, 2 * H) and layer.eh_proj.bias is None
    assert type(layer.mlp).__name__ == "GlmMoeDsaMoE" and layer.self_attn.indexer is not None  # as both servers build it
    for name in ("enorm", "hnorm"):
        assert torch.equal(getattr(layer, name).weight, torch.ones(H))
    assert torch.equal(layer.shared_head.norm.weight, torch.ones(H))
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in before.items())  # the main model is untouched
    again = load_causal_lm(None, tokenizer, preset="test", seed=0)
    attach_mtp(again, 2, seed=5)
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in state.items())  # from the seed
    other = load_causal_lm(None, tokenizer, preset="test", seed=0)
    attach_mtp(other, 2, seed=6)
    assert not torch.equal(other.mtp.layers[0].eh_proj.weight, model.mtp.layers[0].eh_proj.weight)
    assert attach_mtp(load_causal_lm(None, tokenizer, preset="test", seed=0), None) == 0  # the tiny GLM-5: none


@pytest.mark.parametrize("index_topk", [None, 4], ids=["dense", "dsa_top4"])
def test_glm_forward_with_mtp_equals_the_model_modules_forward(tokenizer, index_topk):
    model = _model(tokenizer, index_topk=index_topk)
    ids, mask, pos = _batch(len(tokenizer))
    start = 9
    tol = model_logit_tolerance(model, [r[m.bool()].tolist() for r, m in zip(ids, mask)])
    plain = forward_logits(model, ids, mask, pos, start)
    fast, fast_mtp = forward_logits_mtp(model, ids, mask, pos, start)
    ref, ref_mtp = hf_forward_logits_mtp(model, ids, mask, pos, start)
    real = mask[:, start:].bool()
    assert (fast - plain)[real].abs().max() <= tol  # the main logits: the last layer ran every position
    assert (fast - ref)[real].abs().max() <= tol
    assert len(fast_mtp) == len(ref_mtp) == 2
    for d, (a, b) in enumerate(zip(fast_mtp, ref_mtp), start=1):
        ok = _window(mask, start, d)
        assert ok.any() and (~ok).any()
        assert (a - b)[ok].abs().max() <= tol, d
        assert (a[~ok] == 0).all() and (b[~ok] == 0).all()  # no input: 0, as the main logits at padding

    # gradients: the MTP loss reaches the MTP layers only, through either forward alike
    def grads(fn):
        model.zero_grad(set_to_none=True)
        _, mtp = fn(model, ids, mask, pos, start)
        sum((z[_window(mask, start, d)].log_softmax(-1)[:, 7]).sum() for d, z in enumerate(mtp, 1)).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    g_fast, g_ref = grads(forward_logits_mtp), grads(hf_forward_logits_mtp)
    assert g_fast.keys() == g_ref.keys()
    assert g_fast and all(n.startswith("mtp.") for n in g_fast)
    assert not any(".indexer." in n for n in g_fast)  # the DSA indexer has no gradient, as in the main model
    tokens = int(mask.sum())
    bound = gradient_tolerances(g_ref, **dims(model.config), context=ids.shape[1], tokens=tokens)
    assert within(g_fast, g_ref, bound) == []


def test_each_depth_predicts_the_token_after_next_from_its_position_computed_by_hand(tokenizer):
    """One unpadded row: depth d's logits at entry i are position t = start - d + i's prediction of token t + d + 1,
    each depth run by hand on growing prefixes."""
    from transformers.masking_utils import create_causal_mask

    model = _model(tokenizer).eval()
    S, start = 10, 4
    ids = torch.randint(6, len(tokenizer), (1, S), generator=torch.Generator().manual_seed(2))
    mask, pos = torch.ones(1, S, dtype=torch.long), torch.arange(S)[None]
    with torch.no_grad():
        _, fast = forward_logits_mtp(model, ids, mask, pos, start)
        base = model.model
        h = base(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state[0]  # after the final norm
        emb = base.embed_tokens.weight
        for d, layer in enumerate(model.mtp.layers, start=1):
            nxt = torch.zeros_like(h)
            for t in range(S - d):  # position t has the token t + d
                x = torch.stack([mtp_input(emb[ids[0, s + d]], h[s], layer.enorm.weight, layer.hnorm.weight,
                                           layer.eh_proj.weight, layer.enorm.variance_epsilon) for s in range(t + 1)])[None]
                p = pos[:, : t + 1]
                causal = create_causal_mask(config=model.config, inputs_embeds=x, attention_mask=mask[:, : t + 1],
                                            cache=None, position_ids=p, allow_is_causal_skip=False)
                y = layer.block_forward(x, attention_mask=causal, position_ids=p,
                                        position_embeddings=base.rotary_emb(x, p))[0, -1]
                nxt[t] = layer.shared_head.norm(y)
                i = t - (start - d)
                if 0 <= i < S - start:  # what the depth predicts: token t + d + 1 (if the sequence has it)
                    torch.testing.assert_close(fast[d - 1][0, i], model.lm_head(nxt[t]), atol=2e-5, rtol=0)
            h = nxt  # the next depth reads this depth's normed output


def test_an_export_carries_the_mtp_layers_and_loads_back_exactly(tokenizer, tmp_path, caplog):
    model = _model(tokenizer)
    out = export_hf(model, tokenizer, str(tmp_path / "hf"))
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["num_nextn_predict_layers"] == 2 and config["num_hidden_layers"] == 2
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert torch.equal(f.get_tensor("model.layers.3.shared_head.head.weight"), model.lm_head.weight.detach())
        assert torch.equal(f.get_tensor("model.layers.2.embed_tokens.weight"), model.model.embed_tokens.weight.detach())
    assert not any(k.startswith("mtp.") for k in keys)
    # the experts one per expert, as every layer's (transformers' save conversion)
    assert "model.layers.3.mlp.experts.3.up_proj.weight" in keys and "model.layers.3.mlp.experts.gate_up_proj" not in keys
    # transformers loads the main model; glmlight reads the MTP layers from the files
    back = load_causal_lm(out, load_tokenizer(out))
    assert attach_mtp(back, None, path=out) == 2
    a, b = model.state_dict(), back.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # fewer: the first ones; more: the rest fresh; 0: none, said once
    fewer = load_causal_lm(out, load_tokenizer(out))
    attach_mtp(fewer, 1, path=out)
    assert torch.equal(fewer.mtp.layers[0].eh_proj.weight, model.mtp.layers[0].eh_proj.weight)
    more = load_causal_lm(out, load_tokenizer(out))
    attach_mtp(more, 3, path=out, seed=9)
    assert torch.equal(more.mtp.layers[1].mlp.experts.gate_up_proj, model.mtp.layers[1].mlp.experts.gate_up_proj)
    none = load_causal_lm(out, load_tokenizer(out))
    with caplog.at_level(logging.INFO, logger="glmlight.models.mtp"):
        assert attach_mtp(none, 0, path=out) == 0
    assert mtp_of(none) is None and none.config.num_nextn_predict_layers == 0
    assert "2 MTP layer(s) are not kept" in caplog.text


def test_a_checkpoint_that_lacks_an_mtp_tensor_stops_with_one_line(tokenizer, tmp_path):
    out = export_hf(_model(tokenizer, layers=1), tokenizer, str(tmp_path / "hf"))
    path = os.path.join(out, "model.safetensors")
    tensors = load_file(path)
    del tensors["model.layers.2.eh_proj.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    model = load_causal_lm(out, load_tokenizer(out))
    with pytest.raises(ConfigError, match=r"declares 1 MTP layer\(s\).*lack .*e\.g\. model\.layers\.2\.eh_proj\.weight"):
        attach_mtp(model, None, path=out)
    # layers beyond the MTP layers are still refused at load
    tensors["model.layers.3.enorm.weight"] = torch.ones(64)
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"beyond num_hidden_layers=2 \+ num_nextn_predict_layers=1, e\.g\. "
                                          r"model\.layers\.3\.enorm"):
        load_causal_lm(out, load_tokenizer(out))


def test_fp8_export_quantises_the_mtp_block_but_not_its_projection_or_the_shared_copies(tokenizer, tmp_path):
    out = export_hf(_model(tokenizer, layers=1), tokenizer, str(tmp_path / "fp8"), fp8=True)
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        dtype = {k: f.get_tensor(k).dtype for k in f.keys() if k.startswith("model.layers.2.")}
    fp8 = torch.float8_e4m3fn
    assert dtype["model.layers.2.self_attn.q_a_proj.weight"] == fp8
    assert dtype["model.layers.2.mlp.experts.0.gate_proj.weight"] == fp8
    assert "model.layers.2.self_attn.q_a_proj.weight_scale_inv" in dtype
    for name in ("eh_proj", "embed_tokens", "shared_head.head", "enorm", "hnorm", "shared_head.norm"):
        assert dtype[f"model.layers.2.{name}.weight"] == torch.float32, name


def test_weight_sync_names_the_mtp_layers_as_the_checkpoint_does(tokenizer):
    model = _model(tokenizer, layers=2)
    named = list(to_checkpoint_names(model.state_dict().items()))  # what a server client sends (first layer inferred)
    names = [n for n, _ in named]
    assert "model.layers.3.eh_proj.weight" in names and not any(n.startswith("mtp.") for n in names)
    assert len(names) == len(set(names)) == len(model.state_dict())
    exported = {n for n, _ in checkpoint_tensors(model.state_dict().items(), 2)}
    assert exported - set(names) == {f"model.layers.{i}.{x}" for i in (2, 3)
                                     for x in ("embed_tokens.weight", "shared_head.head.weight")}


# ------------------------------------------------------------------ the servers' MTP loaders, read as text
def _source(backend: str, rel: str) -> str:
    return server_source(backend, rel)


def _string_list(source: str, name: str) -> list[str]:
    """The string list or tuple assigned to `name` (a variable or keyword argument) in `source`."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            value = node.value
        elif isinstance(node, ast.keyword) and node.arg == name:
            value = node.value
        else:
            continue
        if isinstance(value, (ast.List, ast.Tuple)):
            return [ast.literal_eval(e) for e in value.elts]
    raise AssertionError(f"no list {name} in the source")


def _self_modules(source: str, class_name: str) -> set[str]:
    """The `self.X = ...` (and `self.shared_head.X = ...`) attributes assigned in a class's methods."""
    tree = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and n.name == class_name)
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    out.add(t.attr)
                elif isinstance(t, ast.Attribute) and isinstance(t.value, ast.Attribute) and \
                        getattr(t.value.value, "id", None) == "self":
                    out.add(f"{t.value.attr}.{t.attr}")
    return out


@pytest.mark.parametrize("arch", ["glm5", "glm4_moe"])
def test_the_export_names_its_mtp_layers_as_sglang_and_vllm_load_them(tokenizer, tmp_path, arch):
    sg = {rel: _source("sglang", f"sglang/srt/models/{rel}") for rel in
          ("deepseek_common/deepseek_weight_loader.py", "deepseek_nextn.py", "glm4_moe.py", "glm4_moe_nextn.py")}
    vl = {rel: _source("vllm", f"vllm/model_executor/models/{rel}") for rel in
          ("deepseek_mtp.py", "glm4_moe_mtp.py", "utils.py")}
    if arch == "glm5":
        model = _model(tokenizer, layers=1)
    else:  # GLM-4.5's structure (Glm4Moe)
        from tests.support.hf_models import tiny_hf_model

        model = tiny_hf_model("glm4_moe")
        attach_mtp(model, 1)
    out = export_hf(model, tokenizer, str(tmp_path / "hf"))
    config = json.load(open(os.path.join(out, "config.json")))
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    L = config["num_hidden_layers"]

    # where: both read num_nextn_predict_layers; the MTP layer is model.layers.{num_hidden_layers}
    loader = sg["deepseek_common/deepseek_weight_loader.py"]
    assert "self.config.num_nextn_predict_layers" in loader and 'f"model.layers.{nextn_layer_id}"' in loader
    assert re.search(r"nextn_layer_id = \(\s*0 if self\.config\.num_hidden_layers == 1 else "
                     r"self\.config\.num_hidden_layers\s*\)", loader)
    assert re.search(r'n := getattr\(config, "num_nextn_predict_layers", 0\)', vl["utils.py"])
    assert 'f"model.layers.{base + i}."' in vl["utils.py"] and "base = config.num_hidden_layers" in vl["utils.py"]
    assert config["num_nextn_predict_layers"] == 1
    mtp_keys = {k[len(f"model.layers.{L}."):] for k in keys if k.startswith(f"model.layers.{L}.")}
    assert mtp_keys and not any(k.startswith(f"model.layers.{L + 1}.") for k in keys)

    # the MTP layer's own tensors: SGLang's spec names (to the NextN model) and the shared ones it skips,
    # vLLM's spec names (the rest goes under mtp_block)
    sg_spec = set(_string_list(loader, "nextn_spec_weight_names"))
    assert sg_spec == set(_string_list(sg["glm4_moe.py"], "_NEXTN_SPEC_WEIGHT_NAMES")) \
        == set(_string_list(sg["glm4_moe.py"], "nextn_spec_weight_names"))
    assert '"shared_head.head" in name or "embed_tokens" in name' in loader  # taken from the target model
    vl_spec = set(_string_list(vl["deepseek_mtp.py"], "spec_layer_weight_names"))
    assert vl_spec == set(_string_list(vl["glm4_moe_mtp.py"], "spec_layer_weight_names"))
    own = {k for k in mtp_keys if any(k.startswith(s + ".") for s in vl_spec | sg_spec)}
    # the modules the servers' MTP layers define, with SharedHead's norm and head
    sg_modules = _self_modules(sg["deepseek_nextn.py"], "DeepseekModelNextN") & \
        _self_modules(sg["glm4_moe_nextn.py"], "Glm4MoeModelNextN")
    vl_modules = _self_modules(vl["deepseek_mtp.py"], "DeepSeekMultiTokenPredictorLayer")
    head = {f"shared_head.{m}" for m in _self_modules(vl["deepseek_mtp.py"], "SharedHead") if m in ("norm", "head")}
    assert head == {"shared_head.norm", "shared_head.head"}
    assert {"enorm", "hnorm", "eh_proj", "shared_head.norm", "embed_tokens"} <= sg_modules
    assert {"enorm", "hnorm", "eh_proj", "shared_head"} <= vl_modules
    assert own == {f"{m}.weight" for m in ({"enorm", "hnorm", "eh_proj", "embed_tokens"} | head)}
    assert {f"{s}.weight" for s in sg_spec} <= own and {k.split(".")[0] for k in own} <= vl_spec | {"shared_head"}

    # the block: SGLang loads the rest as model.decoder.*, vLLM as mtp_block.*, both a decoder layer of the main
    # model's class built as an MoE layer, so its names are a main MoE layer's
    assert 'name.replace(layer_prefix, "model.decoder")' in loader
    assert 'f"model.layers.{spec_layer}.mtp_block."' in vl["deepseek_mtp.py"]
    assert "is_nextn or (" in sg["glm4_moe.py"]  # a NextN layer is always sparse (MoE)
    block = mtp_keys - own
    main = {k[len(f"model.layers.{L - 1}."):] for k in keys if k.startswith(f"model.layers.{L - 1}.")}
    assert any(".experts." in k for k in main)  # the last main layer is an MoE layer
    assert block == main
