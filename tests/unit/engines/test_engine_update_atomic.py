"""A weight update of the embedded engine is all or nothing: a refused update leaves every weight, the
runner's fused copies, the version and the answers as they were; one that fails after weights were
written leaves an engine that refuses to serve the mix until a later update replaces it."""

import copy

import pytest
import torch

from glmlight.engines.base import SamplingParams
from glmlight.engines.local.engine import LocalEngine
from glmlight.errors import EngineError
from tests.conftest import encode

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8)


def _other(tiny_model):
    """Weights that change the greedy answer."""
    other = copy.deepcopy(tiny_model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    return other


def _llama(seed: int):
    import transformers as T

    cfg = T.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                        pad_token_id=0, eos_token_id=1, bos_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return T.LlamaForCausalLM(cfg).float().eval()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8).clone()


def _snapshot(engine: LocalEngine) -> dict[str, torch.Tensor]:
    """Every tensor the engine's model holds (FP8 weights as stored, with their scales), as bytes."""
    return {n: _bits(t) for n, t in engine.model.state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return [n for n in a if not torch.equal(a[n], b[n])]


def _setup(case: str, tokenizer, tiny_model):
    """(engine, the weights to send, a prompt) for a runner / weight format."""
    if case == "dense":
        model, other, prompt = _llama(0), _llama(1), [5, 6, 7, 8]
        engine = LocalEngine(model)
        assert engine.runner_kind == "dense"
    else:
        kw = {"glm": {}, "hf": {"runner": "hf"}, "fp8": {"weight_format": "fp8"},
              "bf16": {"dtype": "bfloat16"}}[case]
        engine, other, prompt = LocalEngine(tiny_model, **kw), _other(tiny_model), encode(tokenizer, "9+9=")
    return engine, list(other.state_dict().items()), prompt


def _bad_third(named: list, kind: str) -> list:
    """`named` with its third tensor made unusable in one way."""
    bad = list(named)
    name, t = bad[2]
    bad[2] = {
        "shape": (name, t[:-1]),
        "name": ("model.layers.0.no_such_weight", t),
        "dtype": (name, torch.zeros(t.shape, dtype=torch.int64)),
        "complex": (name, torch.zeros(t.shape, dtype=torch.complex64)),
        "meta": (name, torch.empty(t.shape, device="meta")),
        "not_a_tensor": (name, t.tolist()),
    }[kind]
    return bad


@pytest.mark.parametrize("case", ["glm", "hf", "dense", "fp8", "bf16"])
def test_a_refused_update_changes_nothing_and_a_good_one_then_works(case, tokenizer, tiny_model):
    engine, named, prompt = _setup(case, tokenizer, tiny_model)
    with engine:
        before = engine.generate([prompt], GREEDY)[0].token_ids
        weights = _snapshot(engine)
        with pytest.raises(EngineError, match="shape"):
            engine.update_weights(_bad_third(named, "shape"), version=1)
        assert engine.version == 0
        assert _same(weights, _snapshot(engine)) == []  # not one weight written
        after = engine.generate([prompt], GREEDY)[0]
        assert after.token_ids == before and after.versions == [0] * len(before)
        engine.update_weights(named, version=1)
        assert engine.version == 1
        new = engine.generate([prompt], GREEDY)[0]
        assert new.token_ids != before and new.versions == [1] * len(new.token_ids)
        assert _same(weights, _snapshot(engine)) != []


@pytest.mark.parametrize("kind", ["name", "dtype", "complex", "meta", "not_a_tensor"])
def test_every_kind_of_bad_tensor_is_refused_before_any_weight_is_written(kind, tokenizer, tiny_model):
    engine, named, prompt = _setup("glm", tokenizer, tiny_model)
    with engine:
        before = engine.generate([prompt], GREEDY)[0].token_ids
        weights = _snapshot(engine)
        with pytest.raises(EngineError):
            engine.update_weights(_bad_third(named, kind), version=1)
        assert engine.version == 0 and _same(weights, _snapshot(engine)) == []
        assert engine.generate([prompt], GREEDY)[0].token_ids == before


def test_a_write_that_fails_half_way_leaves_an_engine_that_serves_nothing_until_a_whole_update(
        tokenizer, tiny_model, monkeypatch):
    """A failure after checks (e.g. out of memory while writing the third tensor): the first two are written
    and cannot be taken back without copies, so no request may run on the mix."""
    engine, named, prompt = _setup("glm", tokenizer, tiny_model)
    with engine:
        engine.generate([prompt], GREEDY)
        write, calls = engine._write, []

        def failing(state, name, tensor):
            calls.append(name)
            if len(calls) == 3:
                raise RuntimeError("out of memory")
            write(state, name, tensor)

        monkeypatch.setattr(engine, "_write", failing)
        with pytest.raises(EngineError, match="failed after weights were written"):
            engine.update_weights(named, version=1)
        monkeypatch.undo()
        assert engine.version == 0
        with pytest.raises(EngineError, match="failed after weights were written"):
            engine.generate([prompt], GREEDY)
        with pytest.raises(EngineError, match="failed after weights were written"):
            engine.score([prompt], [[5, 6]])
        with pytest.raises(EngineError, match="leaves 1 of them out"):  # a partial one cannot mend the mix
            engine.update_weights(named[1:], version=1)
        engine.update_weights(named, version=1)
        got = engine.generate([prompt], GREEDY)[0]
    other = copy.deepcopy(tiny_model)
    other.load_state_dict(dict(named))
    with LocalEngine(other) as fresh:
        assert got.token_ids == fresh.generate([prompt], GREEDY)[0].token_ids and got.versions[0] == 1


def test_a_runner_that_cannot_reread_the_weights_ends_the_running_requests(tokenizer, tiny_model, monkeypatch):
    engine, named, prompt = _setup("dense", tokenizer, tiny_model)
    with engine:
        before = engine.generate([prompt], GREEDY)[0].token_ids
        running = engine.submit(prompt, SamplingParams(temperature=0.0, max_new_tokens=100_000))

        def failing():
            raise MemoryError("cannot pack the weights")

        monkeypatch.setattr(engine._runner, "refresh", failing)
        with pytest.raises(EngineError, match="MemoryError"):
            engine.update_weights(named, version=1)
        monkeypatch.undo()
        gen = running.result(timeout=60)
        assert gen.finish_reason == "abort" and set(gen.versions) <= {0}
        with pytest.raises(EngineError):
            engine.submit(prompt, GREEDY)
        engine.update_weights(named, version=2)
        after = engine.generate([prompt], GREEDY)[0]
        assert after.token_ids != before and after.versions[0] == 2


class _Stream:
    """A stream read once, like a sharded `full_weights`: how many tensors were taken is counted."""

    def __init__(self, named: list, manifest: list):
        self.named, self._manifest, self.taken = named, manifest, 0

    def manifest(self):
        return self._manifest

    def __iter__(self):
        for item in self.named:
            self.taken += 1
            yield item


def test_a_stream_is_checked_from_its_manifest_before_the_first_tensor_is_taken(tokenizer, tiny_model):
    from glmlight.strategies.fsdp import full_weights

    engine, named, prompt = _setup("glm", tokenizer, tiny_model)
    other = copy.deepcopy(tiny_model)
    other.load_state_dict(dict(named))
    stream = full_weights(other)
    assert [(n, s) for n, s, _ in stream.manifest()] == [(n, tuple(t.shape)) for n, t in named]
    with engine:
        bad = _Stream(named, [(n, tuple(t.shape) if i != 2 else (1,), t.dtype) for i, (n, t) in enumerate(named)])
        with pytest.raises(EngineError, match="shape"):
            engine.update_weights(bad, version=1)
        assert bad.taken == 0 and engine.version == 0
        engine.update_weights(stream, version=1)
        got = engine.generate([prompt], GREEDY)[0].token_ids
    with LocalEngine(other) as fresh:
        assert got == fresh.generate([prompt], GREEDY)[0].token_ids
