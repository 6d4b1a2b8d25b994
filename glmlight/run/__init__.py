"""Run assembly: `build(cfg)` turns a validated config into a Trainer, an algorithm module and a rollout
DataModule (build.py), `Run` is what it returns (run.py); the training entry point (train.py), the stage
pipeline (pipeline.py), the run report (report.py), the progress bar (progress.py), and what the scripts
share (cli.py: logging set-up and one-line errors)."""
