"""Train with glmlight from the Hydra configs (conf/ in a checkout, glmlight/conf when installed).

    python -m glmlight.run.train                        # GRPO, tiny GLM-5, embedded engine, CPU
    python -m glmlight.run.train algo=grpo trainer.max_steps=20 rollout.dtype=bfloat16
    python -m glmlight.run.train --cfg job              # print the composed config and exit
    python -m glmlight.run.train --help

(`python scripts/train.py ...` and the `glmlight-train` command are the same.) Overrides are Hydra's
`key=value`, `group=option`, `+new.key=value`, `~key`. A bad key or value stops the run with one line
naming it. Ctrl-C stops the run at once (exit status 1), SIGTERM at the next RL step (exit status 143);
either way the run says which RL step its last checkpoint holds, which steps are lost and the command that
continues it (the same one with trainer.resume=last).
"""

from __future__ import annotations

import os
import shlex
import signal
import sys


def main(argv: list[str]) -> int:
    from glmlight.config.compose import CONF_DIR, compose
    from glmlight.run.cli import run_with_one_line_errors, setup_logging

    if "-h" in argv or "--help" in argv:
        print(__doc__)
        groups = sorted(d for d in os.listdir(CONF_DIR) if os.path.isdir(os.path.join(CONF_DIR, d)))
        print("config groups:", ", ".join(groups))
        return 0
    # A user's module beside their data (task.reward._target_=my_rewards.fn) imports as it would in a script run
    # there: `python scripts/train.py` puts scripts/ on the path, not the working directory.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
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

    from glmlight.config.schema import validate

    setup_logging()

    def go() -> None:
        cfg = compose(overrides)
        if show is not None:
            print(OmegaConf.to_yaml(validate(cfg), resolve=show == "resolved"))
            return
        import glmlight
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        run = glmlight.build(cfg)
        run.command = run_command(sys.argv[0], overrides)
        try:
            run.fit()
        except SIGTERMException:  # Lightning's own exits with status 0: a stopped run must not look finished
            raise SystemExit(128 + signal.SIGTERM) from None

    return run_with_one_line_errors(go)


def run_command(argv0: str, overrides: list[str]) -> str:
    """This run's command line without trainer.resume: the program and the other overrides."""
    if os.path.abspath(argv0).endswith(os.path.join("glmlight", "run", "train.py")):
        prog = "python -m glmlight.run.train"
    elif argv0.endswith(".py"):
        prog = f"python {shlex.quote(argv0)}"
    else:
        prog = os.path.basename(argv0) or "glmlight-train"
    kept = [o for o in overrides if not o.lstrip("+~").startswith("trainer.resume=")]
    return " ".join([prog, *(shlex.quote(o) for o in kept)])


def cli() -> None:
    """The `glmlight-train` command."""
    sys.exit(main(sys.argv[1:]))


if __name__ == "__main__":
    cli()
