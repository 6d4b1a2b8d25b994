"""Train with glmlight from the Hydra configs (conf/ in a checkout, glmlight/conf when installed).

    python -m glmlight.train                        # GRPO, tiny GLM-5, embedded engine, CPU
    python -m glmlight.train algo=grpo trainer.max_steps=20 rollout.dtype=bfloat16
    python -m glmlight.train --cfg job              # print the composed config and exit
    python -m glmlight.train --help

(`python scripts/train.py ...` and the `glmlight-train` command are the same.) Overrides are Hydra's
`key=value`, `group=option`, `+new.key=value`, `~key`. A bad key or value stops the run with one line
naming it.
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str]) -> int:
    from glmlight.cli import CONF_DIR, compose, run_with_one_line_errors, setup_logging

    if "-h" in argv or "--help" in argv:
        print(__doc__)
        groups = sorted(d for d in os.listdir(CONF_DIR) if os.path.isdir(os.path.join(CONF_DIR, d)))
        print("config groups:", ", ".join(groups))
        return 0
    show = None
    overrides = []
    it = iter(argv)
    for a in it:
        if a == "--cfg":
            show = next(it, "job")
        elif a.startswith("--cfg="):
            show = a.split("=", 1)[1]
        else:
            overrides.append(a)

    from omegaconf import OmegaConf

    from glmlight.config import validate

    setup_logging()

    def go() -> None:
        cfg = compose(overrides)
        if show is not None:
            print(OmegaConf.to_yaml(validate(cfg), resolve=show == "resolved"))
            return
        import glmlight

        glmlight.build(cfg).fit()

    return run_with_one_line_errors(go)


def cli() -> None:
    """The `glmlight-train` command."""
    sys.exit(main(sys.argv[1:]))


if __name__ == "__main__":
    cli()
