#!/usr/bin/env python
"""Export a run's Lightning checkpoint as a Hugging Face checkpoint (safetensors; LoRA merged).

    python scripts/export.py runs/default/checkpoints/last.ckpt runs/default/hf
    python scripts/export.py CKPT OUT --config runs/default/config.yaml
    python scripts/export.py CKPT OUT --fp8      # the block-FP8 layout an SGLang / vLLM server starts with
                                                 # for rollout.weight_format=fp8

The run's config (model, LoRA, warm start) is read from --config, by default the config.yaml that
`scripts/train.py` stores beside the run's checkpoints/ directory. OUT is written atomically.
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ckpt", help="a Lightning checkpoint of a glmlight run (e.g. runs/NAME/checkpoints/last.ckpt)")
    parser.add_argument("out", help="the Hugging Face checkpoint directory to write")
    parser.add_argument("--config", help="the run's config.yaml (default: beside the checkpoints/ directory)")
    parser.add_argument("--fp8", action="store_true", help="write block-FP8 weights (float8_e4m3fn, 128 x 128 scales)")
    args = parser.parse_args(argv)

    from glmlight.run.cli import run_with_one_line_errors, setup_logging

    setup_logging()

    def go() -> None:
        from omegaconf import OmegaConf

        from glmlight.run.build import policy_from_checkpoint
        from glmlight.errors import ConfigError
        from glmlight.models.export import export_hf

        config = args.config or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(args.ckpt))), "config.yaml")
        if not os.path.isfile(args.ckpt):
            raise ConfigError(f"checkpoint {args.ckpt} does not exist")
        if not os.path.isfile(config):
            raise ConfigError(f"no run config at {config}; pass --config runs/NAME/config.yaml")
        policy, tokenizer = policy_from_checkpoint(OmegaConf.load(config), args.ckpt)
        print(f"exported {args.ckpt} to {export_hf(policy, tokenizer, args.out, fp8=args.fp8)}")

    return run_with_one_line_errors(go)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
