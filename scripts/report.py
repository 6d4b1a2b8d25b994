#!/usr/bin/env python
"""Write the report of a run: runs/<name>/report.png (the curves) and runs/<name>/summary.json (the
final figures), from the run's metrics.jsonl. Every run writes them at its end (logger.report=true);
this command redraws them, for instance while a run is going or after a resume.

    python scripts/report.py runs/default
    python scripts/report.py runs/default --print      # also print the headline figures

The PNG needs matplotlib: pip install matplotlib.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="the run directory, e.g. runs/default")
    parser.add_argument("--print", action="store_true", help="print the last value of the main metrics")
    args = parser.parse_args(argv)
    from glmlight.report import summarize, read_metrics, write_report

    try:
        paths = write_report(args.run_dir)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for p in paths.values():
        print(p)
    if args.print:
        rows, skipped = read_metrics(args.run_dir)
        metrics = summarize(rows, skipped)["metrics"]
        for k in sorted(metrics):
            if k.startswith(("rollout/reward_mean", "eval/", "train/entropy", "rollout/response_length")) and \
                    not k.endswith(("seconds", "tokens", "prompts", "failed")):
                m = metrics[k]
                print(f"{k:40s} {m['first']:10.4g} (step {m['first_rl_step']}) -> {m['last']:10.4g} "
                      f"(step {m['last_rl_step']})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
