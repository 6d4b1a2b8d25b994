#!/usr/bin/env python
"""Evaluate a model on a task's held-out prompts, without training: the run's held-out evaluation
(eval.k sampled answers per prompt at the rollout temperature and one greedy answer; pass@1, pass@k,
maj@k, the greedy pass rate) through the same engine, prompts and reward a training run would use.

    python scripts/evaluate.py model=smollm2 task=chat_sort
    python scripts/evaluate.py model=hf model.path=runs/smollm2_grpo/hf experiment=smollm2_grpo
    python scripts/evaluate.py ... --json out.json     # also write the metrics

Overrides are those of scripts/train.py. Prints one line per held-out set and, with --show N, the
first N greedy answers, one JSON line each: the question (the prompt's last user message), the label, the
reward, the completion and the prompt's messages.
"""

from __future__ import annotations

import json
from collections import Counter
import sys
import tempfile
import time


def main(argv: list[str]) -> int:
    from glmlight.config.compose import compose
    from glmlight.run.cli import run_with_one_line_errors, setup_logging

    if "-h" in argv or "--help" in argv:
        print(__doc__)
        return 0
    out_json, show, overrides = None, 0, []
    it = iter(argv)
    for a in it:
        if a == "--json":
            out_json = next(it)
        elif a == "--show":
            show = int(next(it))
        else:
            overrides.append(a)
    setup_logging()

    def go() -> None:
        import glmlight
        from glmlight.data.evaluation import LocalIds, SeededEngine
        from glmlight.prompt import last_user_message

        root = tempfile.mkdtemp(prefix="glmlight-eval-")
        cfg = compose(overrides + ["logger=none", f"trainer.default_root_dir={root}", "export.enabled=false"])
        t0 = time.perf_counter()
        with glmlight.build(cfg) as run:
            dm = run.datamodule
            metrics = dm.evaluate()
            for name in dm.eval_sets:
                p = f"eval/{name}"
                ks = sorted(int(k.rsplit("@", 1)[1]) for k in metrics if k.startswith(f"{p}/pass@"))
                line = " ".join(f"pass@{k}={metrics[f'{p}/pass@{k}']:.3f}" for k in ks)
                maj = [k for k in metrics if k.startswith(f"{p}/maj@")]
                line += "".join(f" {k.rsplit('/', 1)[1]}={metrics[k]:.3f}" for k in maj)
                if f"{p}/greedy/pass_rate" in metrics:
                    line += f" greedy={metrics[f'{p}/greedy/pass_rate']:.3f}"
                length = metrics.get(f"{p}/response_length", metrics.get(f"{p}/greedy/response_length", 0.0))
                print(f"[eval] {name}: {line} len={length:.1f} | {metrics[f'{p}/seconds']:.0f} s "
                      f"{metrics[f'{p}/tokens']:.0f} tok", flush=True)
            if show:
                prompts = dm.eval_sets["heldout"].prompts()[:show]
                samples = dm.rollout(prompts, 1, Counter(), greedy=True, engine=SeededEngine(dm.engine, "show", 0),
                                     ids=LocalIds())
                for p, s in zip(prompts, samples):  # one greedy answer per prompt, in order
                    question = p.metadata.get("question") or last_user_message(p.messages)
                    print(json.dumps({"question": question, "label": s.metadata.get("label"), "reward": s.reward,
                                      "completion": s.metadata.get("completion_text"), "prompt": p.messages},
                                     default=str))
        print(f"({time.perf_counter() - t0:.0f} s)")
        if out_json:
            with open(out_json, "w") as f:
                json.dump(metrics, f, indent=2)

    return run_with_one_line_errors(go)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
