"""Held-out evaluation: k sampled answers per prompt at the rollout temperature and one greedy
answer, on one or more named prompt sets, through the same engine and rollout path as training
(single-turn answers or whole agent episodes, scored by the task's reward).

Per set, under `<prefix>/<name>/`: pass@1 (the mean over samples), unbiased pass@j for j = 2, 4, ...,
k (`glmlight.ops.eval_metrics`), maj@k where the reward reports an extracted answer (the
verifier's `pred`), the mean reward and response length, the greedy pass rate, reward and
length, failures, and the cost (`seconds`, `tokens`); `<prefix>/seconds` and `<prefix>/tokens`
sum over the sets. Agent tasks add, per episode (a compacted episode counts once),
`turns_per_episode`, `tool_calls_per_episode`, `compactions_per_episode`, `truncated_frac`,
`summary_length` (tokens per summary, under compaction) and the mean of every numeric environment
info value (`env/<key>`); a set whose prompts come from several domains also reports each domain's
pass@1 and greedy pass rate (`<prefix>/<name>/<domain>/pass@1`, `.../greedy/pass_rate`). An answer
is correct when its reward (before any overlong penalty) reaches `eval.pass_threshold`.

Evaluation has its own seed stream and leaves training's alone: every request carries a seed
derived from (eval.seed, the set's name, the engine call, the row), so the engine's own seed
stream is never drawn from (in async mode the rollout producer draws from it concurrently); the
samples take their group and rollout ids from a private counter, not the prompt stream; the
torch and Python RNGs are restored afterwards. Every evaluation uses the same seeds, so the
curves compare policies on the same random numbers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import random
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterator

import torch

from glmlight.config.schema import EvalConfig
from glmlight.prompt import Prompt, PromptSource
from glmlight.ops.eval_metrics import maj_at_k, mean_pass_at_k, pass_k_values
from glmlight.engines.base import Generation, RolloutEngine, SamplingParams
from glmlight.sample import Sample, Status

DEFAULT_SET = "heldout"  # the task's own held-out prompts (task.eval_path, or the synthetic held-out stream)


@dataclass
class EvalSet:
    """The first `num_prompts` prompts of a source (None: all)."""

    source: PromptSource
    num_prompts: int | None = None

    def prompts(self) -> list[Prompt]:
        n = len(self.source) if self.num_prompts is None else min(self.num_prompts, len(self.source))
        return [self.source[i] for i in range(n)]


class SeededEngine:
    """An engine whose requests without a seed get one from evaluation's own stream:
    seed = hash(eval seed, set name, call number, row). Everything else is the wrapped engine's.
    `interrupt`, if given, is called before every generation and raises to stop the evaluation."""

    def __init__(self, engine: RolloutEngine, name: str, seed: int, interrupt: Callable[[], None] | None = None):
        self.engine, self.name, self.seed, self.interrupt = engine, name, seed, interrupt
        self.calls = 0

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.engine, attr)

    def request_seed(self, call: int, row: int) -> int:
        digest = hashlib.blake2b(f"glmlight-eval:{self.seed}:{self.name}:{call}:{row}".encode(), digest_size=8)
        return int.from_bytes(digest.digest(), "little") >> 2  # 62 bits, as the engine's own seeds

    def generate(self, prompts: list[list[int]], params: Any) -> list[Generation]:
        if self.interrupt is not None:
            self.interrupt()
        call, self.calls = self.calls, self.calls + 1
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        seeded = [p if p.seed is not None else _with_seed(p, self.request_seed(call, i)) for i, p in enumerate(params)]
        return self.engine.generate(prompts, seeded)


def _with_seed(p: SamplingParams, seed: int) -> SamplingParams:
    return SamplingParams(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, max_new_tokens=p.max_new_tokens,
                          stop_token_ids=list(p.stop_token_ids), seed=seed)


class LocalIds:
    """Group and rollout ids for evaluation samples (the prompt stream's are training's)."""

    def __init__(self) -> None:
        self.next_group_id = self.next_rollout_id = 0

    def new_group_id(self) -> int:
        self.next_group_id += 1
        return self.next_group_id - 1

    def take_rollout_ids(self, k: int) -> int:
        self.next_rollout_id += k
        return self.next_rollout_id - k


@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """Restore the torch (CPU and CUDA) and Python RNG states on exit."""
    cpu, py = torch.get_rng_state(), random.getstate()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        random.setstate(py)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def build_eval_sets(cfg: EvalConfig, task: Any) -> dict[str, EvalSet]:
    """The sets named under `eval.sets`, read with the task's keys (any format glmlight/data/files.py reads, by
    the file's name)."""
    from glmlight.data.sources import FileSource
    from glmlight.errors import ConfigError, DataError

    out = {}
    for name, spec in cfg.sets.items():
        if name == DEFAULT_SET:
            raise ConfigError(f"config error: eval.sets.{DEFAULT_SET}: the name is the task's own held-out set "
                              "(task.eval_path); give this set another name")
        try:
            source = FileSource(spec.path, prompt_key=task.prompt_key, label_key=task.label_key,
                                domain_key=task.domain_key, system_prompt=task.system_prompt, split=task.split)
        except DataError as e:
            raise ConfigError(f"config error: eval.sets.{name}.path: {e}") from None
        out[name] = EvalSet(source, spec.num_prompts)
    return out


def evaluate(dm: Any, engine: RolloutEngine, sets: dict[str, EvalSet], cfg: EvalConfig,
             prefix: str = "eval", select: Callable[[Prompt], bool] | None = None,
             interrupt: Callable[[], None] | None = None) -> dict[str, float]:
    """Evaluate `engine` on every set through `dm.rollout` (the data module's generation and reward
    path); returns the metrics, named `<prefix>/<set>/<metric>`. `select` keeps only the prompts it
    accepts (an OPD teacher is evaluated on the domains routed to it); `interrupt` is called before
    every generation and may raise to stop (a run's SIGTERM). Touches no training stream."""
    out: dict[str, float] = {}
    with preserved_rng():
        for name, eval_set in sets.items():
            kept = [p for p in eval_set.prompts() if select is None or select(p)]
            prompts = [_tagged(p, i) for i, p in enumerate(kept)]
            if prompts:
                out.update(evaluate_set(dm, engine, name, prompts, cfg, prefix, interrupt))
    if out:
        out[f"{prefix}/seconds"] = sum(v for k, v in out.items() if k.endswith("/seconds"))
        out[f"{prefix}/tokens"] = sum(v for k, v in out.items() if k.endswith("/tokens"))
    return out


def evaluate_set(dm: Any, engine: RolloutEngine, name: str, prompts: list[Prompt], cfg: EvalConfig,
                 prefix: str = "eval", interrupt: Callable[[], None] | None = None) -> dict[str, float]:
    """The metrics of one set (see the module docstring)."""
    t0 = time.perf_counter()
    counts: Counter = Counter()
    p = f"{prefix}/{name}"
    m: dict[str, float] = {f"{p}/prompts": float(len(prompts))}
    failed = 0
    if cfg.k > 0:
        seeded = SeededEngine(engine, f"{name}/sampled", cfg.seed, interrupt)
        samples = dm.rollout(prompts, cfg.k, counts, engine=seeded, ids=LocalIds())
        by_prompt = _trajectories(samples, len(prompts))
        correct = [[_correct(t, cfg.pass_threshold) for t in trajs] for trajs in by_prompt]
        n = cfg.k
        for j in pass_k_values(n):
            m[f"{p}/pass@{j}"] = mean_pass_at_k([sum(c) for c in correct], n, j)
        answers = [[_answer(t) for t in trajs] for trajs in by_prompt]
        if any(a is not None for row in answers for a in row):
            m[f"{p}/maj@{n}"] = sum(maj_at_k(a, c) for a, c in zip(answers, correct)) / len(prompts)
        flat = [t for trajs in by_prompt for t in trajs]
        m.update(_means(flat, p))
        failed += sum(_failed(t) for t in flat)
        for d, rows in _by_domain(prompts, correct).items():
            m[f"{p}/{d}/pass@1"] = sum(sum(c) / max(len(c), 1) for c in rows) / len(rows)
    if cfg.greedy:
        seeded = SeededEngine(engine, f"{name}/greedy", cfg.seed, interrupt)
        samples = dm.rollout(prompts, 1, counts, greedy=True, engine=seeded, ids=LocalIds())
        by_prompt = _trajectories(samples, len(prompts))
        flat = [t for trajs in by_prompt for t in trajs]
        m[f"{p}/greedy/pass_rate"] = sum(_correct(t, cfg.pass_threshold) for t in flat) / len(prompts)
        m.update(_means(flat, f"{p}/greedy"))
        failed += sum(_failed(t) for t in flat)
        correct = [[_correct(t, cfg.pass_threshold) for t in trajs] for trajs in by_prompt]
        for d, rows in _by_domain(prompts, correct).items():
            m[f"{p}/{d}/greedy/pass_rate"] = sum(any(c) for c in rows) / len(rows)
    m[f"{p}/failed"] = float(failed)
    m[f"{p}/tokens"] = float(counts["rollout_tokens"])
    m[f"{p}/seconds"] = time.perf_counter() - t0
    return m


def _tagged(prompt: Prompt, index: int) -> Prompt:
    return dataclasses.replace(prompt, metadata={**prompt.metadata, "eval_index": index})


def _trajectories(samples: list[Sample], num_prompts: int) -> list[list[list[Sample]]]:
    """Per prompt (by position), its trajectories (the segments of one answer or episode). A prompt
    that produced nothing (too long for the context) has none: its answers count as wrong."""
    out: list[dict[int, list[Sample]]] = [{} for _ in range(num_prompts)]
    for s in samples:
        out[s.metadata["eval_index"]].setdefault(s.rollout_id, []).append(s)
    return [list(d.values()) for d in out]


def _reward(traj: list[Sample]) -> float | None:
    s = traj[-1]
    if s.reward is None or s.status is Status.FAILED:
        return None
    return s.reward - s.metadata.get("overlong_penalty", 0.0)


def _correct(traj: list[Sample], threshold: float) -> bool:
    r = _reward(traj)
    return r is not None and r >= threshold


def _failed(traj: list[Sample]) -> int:
    return int(_reward(traj) is None)


def _answer(traj: list[Sample]) -> Hashable | None:
    """The answer the reward extracted (reward_info["pred"]), hashable; None when there is none."""
    pred = traj[-1].metadata.get("reward_info", {}).get("pred")
    if pred is None or traj[-1].status is Status.FAILED:
        return None
    if isinstance(pred, str):
        return pred.strip()
    try:
        hash(pred)
        return pred
    except TypeError:
        return json.dumps(pred, sort_keys=True, default=str)


def _by_domain(prompts: list[Prompt], rows: list[list[bool]]) -> dict[str, list[list[bool]]]:
    """Per-prompt rows grouped by the prompts' domains; empty when there is only one domain."""
    out: dict[str, list[list[bool]]] = {}
    for prompt, row in zip(prompts, rows):
        out.setdefault(str(prompt.domain), []).append(row)
    return out if len(out) > 1 else {}


def _means(trajs: list[list[Sample]], p: str) -> dict[str, float]:
    rewards = [r for r in map(_reward, trajs) if r is not None]
    lengths = [sum(s.response_length for s in t) for t in trajs]
    out = {f"{p}/reward": sum(rewards) / len(rewards) if rewards else 0.0,
           f"{p}/response_length": sum(lengths) / len(lengths) if lengths else 0.0}
    out.update(agent_means(trajs, p))
    return out


def agent_means(trajs: list[list[Sample]], p: str) -> dict[str, float]:
    """Per-episode statistics of agent trajectories (the metadata of an episode's last segment)."""
    episodes = [t[-1] for t in trajs if t and "num_segments" in t[-1].metadata]
    if not episodes:
        return {}
    n = len(episodes)
    out = {f"{p}/turns_per_episode": sum(s.metadata["turns"] for s in episodes) / n,
           f"{p}/tool_calls_per_episode": sum(float(s.metadata.get("env/tool_calls", 0)) for s in episodes) / n,
           f"{p}/compactions_per_episode": sum(s.metadata["num_segments"] - 1 for s in episodes) / n,
           f"{p}/truncated_frac": sum(s.status is Status.TRUNCATED for s in episodes) / n}
    summaries = [k for s in episodes for k in s.metadata.get("summary_lengths", ())]
    if summaries:
        out[f"{p}/summary_length"] = sum(summaries) / len(summaries)
    keys = sorted({k for s in episodes for k, v in s.metadata.items()
                   if k.startswith("env/") and k != "env/tool_calls" and isinstance(v, (bool, int, float))})
    for k in keys:
        out[f"{p}/{k}"] = sum(float(s.metadata.get(k, 0)) for s in episodes) / n
    return out
