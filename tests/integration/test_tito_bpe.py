"""Token in, token out with a byte-level BPE tokenizer and a ChatML template (a tiny Llama read from a
GGUF file, as model=smollm2 reads SmolLM2): through `build()` and a real RL step of the multi-turn
calculator agent, every action turn trained on is exactly a token sequence the engine returned, and
the round trip decode -> encode of those turns, which a re-tokenizing framework would train on, gives
other ids for some of them (`callbacks.RetokenizationCheck`)."""

import pytest
import torch

import glmlight
from glmlight import compose
from glmlight.callbacks import RetokenizationCheck
from tests.support.gguf_files import write_tiny_llama_gguf
from tests.support.tito import TrainedIds, record_generations

pytest.importorskip("gguf")


def test_the_ids_trained_on_are_the_engines_and_the_round_trip_would_change_some(tmp_path):
    gguf = str(tmp_path / "tiny-llama.gguf")
    write_tiny_llama_gguf(gguf, seed=0)
    cfg = compose(["model=hf", f"model.path={gguf}", f"model.gguf.cache_dir={tmp_path}/cache", "model.dtype=float32",
                   "task=calculator_agent", "model.warm_start.steps=0", "task.agent.observation_role=user",
                   "trainer.max_steps=1", "rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4",
                   "task.agent.max_new_tokens=12", "rollout.temperature=1.0", "eval.every_n_steps=0",
                   "logger=none", "export.enabled=false", "~callbacks.sample_table",
                   f"trainer.default_root_dir={tmp_path}", "trainer.enable_progress_bar=false"])
    run = glmlight.build(cfg)
    produced = record_generations(run.datamodule.engine)
    seen, check = TrainedIds(), RetokenizationCheck()
    run.trainer.callbacks += [seen, check]
    run.fit()
    stats = check.last
    assert seen.turns and all(seen.rows)
    assert {tuple(t) for t in seen.turns} <= set(produced)  # every trained turn is an engine answer, as it was
    assert len(seen.turns) > 16  # several turns per episode: observations were spliced between them
    print(f"\nturns {stats.get('tito/turns')}, round trip gives other ids for "
          f"{stats.get('tito/retokenized_differs_frac'):.2f} of them")
    assert stats["tito/turns"] == min(len(seen.turns), check.max_turns)
    assert 0 < stats["tito/retokenized_differs_frac"] <= 1
