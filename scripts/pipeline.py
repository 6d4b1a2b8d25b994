#!/usr/bin/env python
"""Run the GLM-5 post-training stages in order, each from the previous stage's checkpoint
(glmlight/run/pipeline.py has the details).

    python scripts/pipeline.py                                      # conf/pipeline/glm5.yaml
    python scripts/pipeline.py pipeline=smollm2 pipeline.seed=1     # conf/pipeline/smollm2.yaml, seed 1
    python scripts/pipeline.py pipeline.skip=[agentic]              # leave a stage out
    python scripts/pipeline.py "pipeline.common=[trainer.max_steps=20]"
    python scripts/pipeline.py --config conf/pipeline/glm5.yaml pipeline.dir=runs/pipeline/try2

Overrides are `pipeline.KEY=VALUE` (values parsed as YAML).
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    from glmlight.run.cli import run_with_one_line_errors, setup_logging
    from glmlight.run.pipeline import DEFAULT_CONFIG, load_config, named_config, run_pipeline

    if "-h" in argv or "--help" in argv:
        print(__doc__)
        return 0
    config, named, overrides = DEFAULT_CONFIG, None, []
    it = iter(argv)
    for a in it:
        if a == "--config":
            config = next(it, DEFAULT_CONFIG)
        elif a.startswith("--config="):
            config = a.split("=", 1)[1]
        elif a.startswith("pipeline="):
            named = a.split("=", 1)[1]
        else:
            overrides.append(a)
    setup_logging()

    def go() -> None:
        manifest = run_pipeline(load_config(named_config(named) if named else config, overrides))
        for s in manifest["stages"]:
            print(f"{s['name']:>12}: {s['status']:<9} {s.get('output_checkpoint') or ''}")

    return run_with_one_line_errors(go)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
