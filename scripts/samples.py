#!/usr/bin/env python
"""Look at a run's samples in the terminal: the lowest-reward, the most-masked or the dropped ones,
from runs/<name>/samples.jsonl (written by callbacks.SampleTable every sample_table.every_n_steps).

    python scripts/samples.py runs/default --worst 10        # the 10 lowest rewards
    python scripts/samples.py runs/default --masked 10       # the 10 with most tokens masked by corrections
    python scripts/samples.py runs/default --dropped 10      # dropped samples and why
    python scripts/samples.py runs/default --step 11 --all   # every row of RL step 11

Each row shows the question (the prompt's last user message), the completion, the label the reward compared
it with and the reward's info (e.g. the verifier's extracted answer, `pred`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any


def load(run_dir: str) -> tuple[list[dict[str, Any]], int]:
    path = os.path.join(run_dir, "samples.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} does not exist (callbacks.sample_table writes it every every_n_steps)")
    rows, bad = [], 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except ValueError:
                bad += 1  # a line cut short by a kill
    return rows, bad


def select(rows: list[dict[str, Any]], worst: int | None = None, masked: int | None = None,
           dropped: int | None = None, step: int | None = None) -> list[dict[str, Any]]:
    """The rows asked for: trained samples by lowest reward or most masked tokens, or dropped ones."""
    if step is not None:
        rows = [r for r in rows if r.get("rl_step") == step]
    if dropped is not None:
        return [r for r in rows if r.get("drop_reason")][-dropped:]
    trained = [r for r in rows if not r.get("drop_reason")]
    if masked is not None:
        return sorted(trained, key=_masked, reverse=True)[:masked]
    if worst is not None:
        return sorted(trained, key=_reward)[:worst]
    return rows


def _masked(r: dict[str, Any]) -> tuple[int, int]:
    """Tokens corrections took out of the loss or weighted 0; the earlier step first among equals."""
    return (r.get("masked_tokens") or 0) + (r.get("zero_weight_tokens") or 0), -r.get("rl_step", 0)


def _reward(r: dict[str, Any]) -> tuple[float, int]:
    return (r["reward"] if r.get("reward") is not None else float("-inf")), r.get("rl_step", 0)


def show(r: dict[str, Any], width: int = 100) -> str:
    """One row as text: the question (the prompt's last user message; for rows without one, the prompt's
    end, where a chat template puts it), the completion, the label, the reward's info and the tokens."""
    def clip(text: Any) -> str:
        text = str(text).replace("\n", "\\n")
        return text if len(text) <= width else text[: width - 3] + "..."

    def clip_start(text: Any) -> str:
        text = str(text).replace("\n", "\\n")
        return text if len(text) <= width else "..." + text[len(text) - width + 3:]

    head = (f"step {r.get('rl_step')}  v{r.get('policy_version')}  group {r.get('group_id')}  "
            f"rollout {r.get('rollout_id')}  reward {r.get('reward')}  {r.get('status')}")
    if r.get("drop_reason"):
        head += f"  DROPPED: {r['drop_reason']}"
    tokens = f"  tokens: {r.get('action_tokens')} action"
    if r.get("masked_tokens") is not None:
        tokens += f", {r['masked_tokens']} masked, {r.get('zero_weight_tokens')} zero-weight by corrections"
    tokens += f"; versions {r.get('versions')}"
    info = json.dumps(r.get("reward_info"), default=str)
    asked = (f"  question:   {clip(r['question'])}" if r.get("question") is not None
             else f"  prompt:     {clip_start(r.get('prompt'))}")
    lines = [head, asked, f"  completion: {clip(r.get('completion'))}"]
    if "label" in r:
        lines.append(f"  label:      {clip(json.dumps(r['label'], default=str) if not isinstance(r['label'], str) else r['label'])}")
    return "\n".join(lines + [f"  info:       {clip(info)}", tokens])


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--worst", type=int, metavar="N", help="the N lowest-reward trained samples (default 10)")
    group.add_argument("--masked", type=int, metavar="N", help="the N samples with most tokens masked by corrections")
    group.add_argument("--dropped", type=int, metavar="N", help="the last N dropped samples, with the reason")
    group.add_argument("--all", action="store_true", help="every row")
    parser.add_argument("--step", type=int, help="only rows of this RL step")
    parser.add_argument("--width", type=int, default=100, help="clip texts to this many characters")
    args = parser.parse_args(argv)
    try:
        rows, bad = load(args.run_dir)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.all:
        chosen = select(rows, step=args.step)
    else:
        nothing_else = args.masked is None and args.dropped is None
        worst = args.worst if args.worst is not None else (10 if nothing_else else None)
        chosen = select(rows, worst, args.masked, args.dropped, args.step)
    print(f"{len(chosen)} of {len(rows)} rows" + (f" ({bad} unreadable lines skipped)" if bad else ""))
    for r in chosen:
        print(show(r, args.width))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
