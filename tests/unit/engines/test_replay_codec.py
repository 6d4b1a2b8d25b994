"""The server replay encodings (glmlight/engines/servers/replay_codec.py): payloads built as SGLang 0.5.23 and
vLLM 0.33.0 build them decode to exactly what the embedded engine captures for the same tokens.

How the servers build them (paths inside the wheels):
- SGLang: `pybase64.b64encode(tensor.numpy().tobytes()).decode("utf-8")` of int32 arrays
  (srt/managers/detokenizer_manager.py:431-447); pybase64 is a faster drop-in of the standard
  base64 alphabet, so `base64.b64encode` gives the same string. Routed experts [seqlen - 1, all
  layers, k], dense layers 0 (srt/state_capturer/base.py:38-75); indexer top-k [seqlen - 1, all
  layers, index_topk], unfused values = positions with -1 padding (srt/layers/attention/dsa/
  dsa_topk_backend.py:272-309), layers sharing a selection mirrored (srt/configs/model_config.py:548-563).
- vLLM: `np.save(buffer, array, allow_pickle=False)`, `pybase64.b64encode(buffer.getbuffer())
  .decode("ascii")` (vllm/utils/serial_utils.py:67-71) of uint8 arrays for <= 256 experts
  (vllm/model_executor/layers/fused_moe/routed_experts_capturer.py:66-70), [num_tokens - 1, all layers, k].
"""

import base64
import io

import numpy as np
import pytest
import torch

from glmlight.models.loading import load_causal_lm
from glmlight.engines.base import SamplingParams
from glmlight.engines.local.engine import LocalEngine
from glmlight.engines.servers.replay_codec import (RecordLayout, ReplayDecodeError, decode_sglang_indexer_topk,
                                           decode_sglang_routed_experts, decode_vllm_routed_experts,
                                           routed_experts_from_vllm_array, sglang_indexer_topk_payload,
                                           sglang_routed_experts_payload, vllm_routed_experts_payload)
from tests.conftest import encode


def sglang_b64(array: np.ndarray) -> str:
    return base64.b64encode(torch.from_numpy(np.ascontiguousarray(array, dtype=np.int32)).numpy().tobytes()).decode("utf-8")


def vllm_b64(array: np.ndarray) -> str:
    with io.BytesIO() as buffer:
        np.save(buffer, array, allow_pickle=False)
        return base64.b64encode(buffer.getbuffer()).decode("ascii")


@pytest.fixture(scope="module")
def captured(tokenizer):
    """A 3-layer GLM-5 (layer 0 dense, layer 2 sharing layer 1's DSA selection) and the embedded
    engine's records of two generations."""
    model = load_causal_lm(None, tokenizer, preset="test", seed=0, index_topk=4, num_hidden_layers=3,
                           indexer_types=["full", "full", "shared"]).eval()
    with LocalEngine(model) as engine:
        engine.capture_replay(routing=True, index=True)
        prompts = [encode(tokenizer, "12+34="), encode(tokenizer, "5")]
        gens = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=7, seed=3))
    return model, prompts, gens


def _server_arrays(layout: RecordLayout, gen, n: int, order: np.random.Generator):
    """What the servers hold for a request whose engine made `gen`'s choices: every layer, server order."""
    experts = np.zeros((n, layout.num_hidden_layers, layout.experts_per_tok), dtype=np.int32)
    re = gen.routed_experts.numpy().astype(np.int32)
    for j, layer in enumerate(layout.moe_layers):
        experts[:, layer] = order.permuted(re[:, j], axis=-1)  # the router's order is not ascending
    k = layout.index_topk
    index = np.full((n, layout.num_hidden_layers, k), -1, dtype=np.int32)
    for p in range(min(n, k)):  # queries with at most k keys select them all, then -1
        index[p, :, : p + 1] = np.arange(p + 1)
    full = gen.indexer_topk.numpy().astype(np.int32)
    last = None
    for layer in range(layout.num_hidden_layers):
        if layer in layout.indexer_layers:
            last = layout.indexer_layers.index(layer)
        if last is not None and n > k:
            index[k:, layer] = order.permuted(full[:, last], axis=-1)
    return experts, index


def test_payloads_decode_to_the_engine_capture(captured):
    model, prompts, gens = captured
    layout = RecordLayout.from_model(model)
    assert layout.moe_layers == (1, 2) and layout.indexer_layers == (0, 1)
    assert layout == RecordLayout.from_glm5_config(model.config)
    order = np.random.default_rng(0)
    for prompt, gen in zip(prompts, gens):
        num_tokens = len(prompt) + len(gen.token_ids)
        experts, index = _server_arrays(layout, gen, num_tokens - 1, order)
        got = decode_sglang_routed_experts(sglang_b64(experts), num_tokens, layout)
        assert got.dtype == gen.routed_experts.dtype == torch.uint8 and torch.equal(got, gen.routed_experts)
        got = decode_vllm_routed_experts(vllm_b64(experts.astype(np.uint8)), num_tokens, layout)
        assert got.dtype == torch.uint8 and torch.equal(got, gen.routed_experts)
        assert torch.equal(routed_experts_from_vllm_array(experts.astype(np.uint8), num_tokens, layout),
                           gen.routed_experts)
        got = decode_sglang_indexer_topk(sglang_b64(index), num_tokens, layout)
        assert got.dtype == gen.indexer_topk.dtype == torch.int16 and torch.equal(got, gen.indexer_topk)
        # the stand-ins' payloads (glmlight's encoders) are the servers' up to the router's order
        for payload, decode in ((sglang_routed_experts_payload(gen.routed_experts, layout), decode_sglang_routed_experts),
                                (vllm_routed_experts_payload(gen.routed_experts, layout), decode_vllm_routed_experts)):
            assert torch.equal(decode(payload, num_tokens, layout), gen.routed_experts)
        ours = np.frombuffer(base64.b64decode(sglang_indexer_topk_payload(gen.indexer_topk, num_tokens, layout)),
                             np.int32).reshape(index.shape)
        assert np.array_equal(np.sort(ours, axis=-1), np.sort(index, axis=-1))
    assert len(gens[1].indexer_topk) > 0  # the short prompt still has queries past k


def test_vllm_uint16_and_int32_payloads():
    layout = RecordLayout(num_hidden_layers=2, moe_layers=(1,), experts_per_tok=2, num_experts=300)
    arr = np.array([[[0, 0], [299, 7]], [[0, 0], [3, 1]]])
    for dtype in (np.uint16, np.int32):
        got = decode_vllm_routed_experts(vllm_b64(arr.astype(dtype)), 3, layout)
        assert got.dtype == torch.int16 and got.tolist() == [[[7, 299]], [[1, 3]]]


def test_bad_payloads_are_one_line_errors():
    layout = RecordLayout(num_hidden_layers=2, moe_layers=(1,), experts_per_tok=2, num_experts=4,
                          indexer_layers=(0, 1), index_topk=2)
    good = np.zeros((3, 2, 2), dtype=np.int32)
    with pytest.raises(ReplayDecodeError, match="expected 4 x 2 x 2"):
        decode_sglang_routed_experts(sglang_b64(good), 5, layout)  # one token too many
    with pytest.raises(ReplayDecodeError, match="routed_experts_start_len=0"):
        decode_sglang_routed_experts(sglang_b64(good[1:]), 4, layout, start_len=1)
    with pytest.raises(ReplayDecodeError, match="outside"):
        decode_sglang_routed_experts(sglang_b64(good + 4), 4, layout)
    with pytest.raises(ReplayDecodeError, match="base64"):
        decode_sglang_routed_experts("not base64!", 4, layout)
    with pytest.raises(ReplayDecodeError, match="shape"):
        decode_vllm_routed_experts(vllm_b64(good.astype(np.uint8)[:2]), 4, layout)
    with pytest.raises(ReplayDecodeError, match="npy"):
        decode_vllm_routed_experts(sglang_b64(good), 4, layout)
    with pytest.raises(ReplayDecodeError, match="dtype"):
        decode_vllm_routed_experts(vllm_b64(good.astype(np.float32)), 4, layout)
    index = np.array([[[0, -1]] * 2, [[0, 1]] * 2, [[1, 2]] * 2, [[0, 3]] * 2], dtype=np.int32)
    assert decode_sglang_indexer_topk(sglang_b64(index), 5, layout).tolist() == [[[1, 2]] * 2, [[0, 3]] * 2]
    slots = index.copy()
    slots[3, 0] = [7, 1200]  # KV-cache slot ids (the fused top-k transform), not positions
    with pytest.raises(ReplayDecodeError, match="SGLANG_DSA_FUSE_TOPK=0"):
        decode_sglang_indexer_topk(sglang_b64(slots), 5, layout)
    padded = index.copy()
    padded[3, 1] = [0, -1]
    with pytest.raises(ReplayDecodeError, match="-1"):
        decode_sglang_indexer_topk(sglang_b64(padded), 5, layout)
