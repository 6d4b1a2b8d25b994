#!/usr/bin/env python
"""Train with glmlight from the Hydra configs in conf/ (the same as `python -m glmlight.run.train`).

    python scripts/train.py                         # GRPO, tiny GLM-5, embedded engine, CPU
    python scripts/train.py algo=grpo trainer.max_steps=20 rollout.dtype=bfloat16
    python scripts/train.py --cfg job               # print the composed config and exit
    python scripts/train.py --help

Overrides are Hydra's `key=value`, `group=option`, `+new.key=value`, `~key`.
A bad key or value stops the run with one line naming it.
"""

import sys

from glmlight.run.train import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
