"""Smoke test of scripts/bench.py with minimal sizes: the functions run and report
well-formed figures. Timings are never asserted."""

import json
import math

import pytest
import torch

from tests.conftest import load_script

bench = load_script("bench")

TINY = bench.Sizes(preset="test", batch=2, prompt=4, new_tokens=3, reps=1, group=2, prompts=1, completion=3,
                   steps=1, flops_preset="test", flops_batch=2, flops_seq=16, flops_steps=1, matmul_n=64,
                   sync_preset="test", sync_reps=1)


def _check(rows, n):
    assert len(rows) == n
    for r in rows:
        assert r["glmlight"] > 0 and r["baseline"] > 0 and math.isfinite(r["ratio"])


def test_engine_and_flops_figures(capsys):
    rows = bench.bench_engine(TINY, "cpu") + bench.bench_flops(TINY, "cpu")
    _check(rows, 3)
    assert [r["figure"] for r in rows[:2]] == ["engine decode, eager", "engine decode, compile=True"]
    assert rows[0]["unit"] == "tokens/s" and rows[2]["target"] == 0.80 and "the compile" in rows[1]["note"]
    bench.print_table(bench.machine("cpu"), rows)
    out = capsys.readouterr().out
    assert "engine decode" in out and "train step FLOP/s" in out and "machine:" in out


def test_flop_count_by_hand(tokenizer):
    from glmlight.models.loading import load_causal_lm

    model = load_causal_lm(None, tokenizer, preset="test")
    cfg = model.config
    flops, parts = bench.train_step_flops(model, batch=1, seq=1)  # one token: one key everywhere
    h, V, E = cfg.hidden_size, cfg.vocab_size, cfg.n_routed_experts
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert parts["matmul_params"] % 6 == 0 and parts["indexer_params"] % 2 == 0
    lm_head = h * V
    assert parts["matmul_params"] >= 6 * (lm_head + experts * cfg.num_experts_per_tok / E)
    dk, dv = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    assert parts["attention"] == 3 * 2 * cfg.num_attention_heads * (dk + dv) * cfg.num_hidden_layers
    assert flops == sum(parts[k] for k in ("matmul_params", "indexer_params", "attention", "indexer_scores"))


def test_grpo_figures_against_trl(capsys):
    pytest.importorskip("trl")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = bench.bench_grpo(TINY, "cpu", rounds=1, trl_threads=())
    finally:
        torch.set_num_threads(threads)
    two = bench.machine("cpu")["cores"] >= 2  # then also sync on two threads, without a target
    _check(rows, (6 if two else 4) + 5)
    assert [r["figure"].split(":")[0] for r in rows] == (["GRPO step, sync"] * 2 + ["GRPO step, async"] * 2
                                                         + ["GRPO step, sync, 2 threads"] * 2 * two
                                                         + ["GRPO run, sync", "GRPO run, async"]
                                                         + ["GRPO step, sync"] + ["GRPO step, async"] * 2)
    speed, memory, bounds = rows[:-5], rows[-5:-3], rows[-3:]
    assert "alone" in bounds[-1]["figure"] and "update alone" in bounds[-1]["note"]
    assert {r["unit"] for r in speed} == {"completions/s", "tokens/s"} and "TRL completions/s" in rows[0]["note"]
    assert [r["target"] for r in speed] == [3.0, 3.0, 4.0, 4.0] + [None, None] * two
    assert all(r["unit"] == "MB" and r["target"] is None and r["glmlight"] > 100 for r in memory)  # peak RSS
    assert all(r["unit"] == "s" and r["target"] == round(1 / 1.10, 3) for r in bounds)
    out = capsys.readouterr().out  # the per-step breakdown of every run
    for part in ("sync ", "async ", "trl@", "rollout", "update", "weight sync", "logging+loop"):
        assert part in out


def test_smollm2_grpo_runs_decode_eagerly_at_the_recipes_length():
    from dataclasses import replace

    from glmlight.bench.grpo import GLMLIGHT_VARIANTS, variant_overrides

    smol = replace(bench.Sizes(), grpo_model="smollm2", **bench.SMOLLM2_GRPO)
    assert smol.completion == 32 and smol.steps == 2  # experiment=smollm2_grpo's rollout.max_new_tokens
    for v in GLMLIGHT_VARIANTS:
        assert "rollout.compile=true" in variant_overrides(v, bench.Sizes())
        assert "rollout.compile=true" not in variant_overrides(v, smol)
    assert variant_overrides("async", smol) == ["rollout.mode=async"]


def test_weight_sync_figure():
    rows = bench.bench_sync(TINY, "cpu")
    _check(rows, 1)
    assert rows[0]["unit"] == "GB/s" and "memcpy" in rows[0]["note"]


def test_sweep_points_vary_one_axis_at_a_time():
    from glmlight.bench.sweep import sweep_points

    points = sweep_points(TINY, {"completion": (3, 5), "group": (4,)})
    assert [label for label, _ in points] == ["default", "completion=5", "group=4"]
    assert points[1][1].completion == 5 and points[1][1].group == TINY.group and points[2][1].group == 4


def test_main_writes_json(tmp_path, monkeypatch):
    out = tmp_path / "bench.json"
    monkeypatch.setattr(bench, "QUICK", TINY)
    threads = torch.get_num_threads()
    try:
        assert bench.main(["--quick", "--only", "engine", "--json", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)  # main() pins the process to one thread on CPU
    data = json.loads(out.read_text())
    assert data["machine"]["cores"] >= 1 and data["rows"][0]["figure"] == "engine decode, eager"


def test_flop_count_skips_what_no_returned_logit_needs(tokenizer):
    # with logits needed at position 1 only, the position-0 query of the last layer (its query side:
    # q, o, indexer query and weights, the MLP/MoE) and the LM head at position 0 do no useful work
    from glmlight.models.loading import load_causal_lm

    model = load_causal_lm(None, tokenizer, preset="test")
    cfg = model.config
    last = model.model.layers[-1]
    a, ix, mlp = last.self_attn, last.self_attn.indexer, last.mlp
    q_side = sum(m.weight.numel() for m in (a.q_a_proj, a.q_b_proj, a.o_proj, ix.wq_b, ix.weights_proj))
    if hasattr(mlp, "experts"):
        k_over_e = cfg.num_experts_per_tok / cfg.n_routed_experts
        q_side += mlp.gate.weight.numel() + sum(p.numel() for p in mlp.shared_experts.parameters())
        q_side += (mlp.experts.gate_up_proj.numel() + mlp.experts.down_proj.numel()) * k_over_e
    else:
        q_side += sum(p.numel() for p in mlp.parameters())
    indexer_q = ix.wq_b.weight.numel() + ix.weights_proj.weight.numel()  # forward only: 2 FLOPs each
    dk, dv = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    saved = 6 * (q_side - indexer_q + model.lm_head.weight.numel()) + 2 * indexer_q
    saved += 3 * 2 * cfg.num_attention_heads * (dk + dv) * 1  # the position-0 query attends one key
    full, _ = bench.train_step_flops(model, batch=1, seq=2)
    part, _ = bench.train_step_flops(model, batch=1, seq=2, start=1)
    assert full - part == pytest.approx(saved)


def test_micro_batch_figure():
    rows = bench.bench_micro_batches(TINY, "cpu", long=16, short=4, rows=8, row_size=2)
    _check(rows, 1)
    assert rows[0]["unit"] == "updates/s" and rows[0]["target"] is None
    assert "4 micro-batches of 2 rows vs 3 of <= 64 tokens" in rows[0]["note"]  # [32, 20], 3 x 20, 3 x 20
