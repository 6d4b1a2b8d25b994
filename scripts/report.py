#!/usr/bin/env python
"""Write the report of a run: runs/<name>/report.png (the curves) and runs/<name>/summary.json (the
final figures), from the run's metrics.jsonl. Every run writes them at its end (logger.report=true);
this command redraws them, for instance while a run is going or after a resume.

    python scripts/report.py runs/default
    python scripts/report.py runs/default --print      # also print the headline figures
    python scripts/report.py runs/a --compare runs/b --out ab.png [--labels A B] [--keys K ...]
                                                         # runs side by side, one panel per metric

The PNG needs matplotlib: pip install matplotlib.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="the run directory, e.g. runs/default")
    parser.add_argument("--print", action="store_true", help="print the last value of the main metrics")
    parser.add_argument("--compare", nargs="+", metavar="RUN_DIR", help="draw these runs beside run_dir (needs --out)")
    parser.add_argument("--out", help="the comparison's PNG path")
    parser.add_argument("--labels", nargs="+", help="one legend label per run (run_dir first)")
    parser.add_argument("--keys", nargs="+", help="the metrics to compare (default: held-out pass@1, greedy, reward)")
    args = parser.parse_args(argv)
    from glmlight.run.report import COMPARE_KEYS, draw_comparison, read_metrics, summarize, write_report

    if args.compare:
        if not args.out:
            parser.error("--compare needs --out PATH")
        try:
            draw_comparison([args.run_dir, *args.compare], args.out, tuple(args.keys or COMPARE_KEYS), args.labels)
        except (FileNotFoundError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(args.out)
        return 0

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
