"""The parts of scripts/bench.py, one benchmark per module (docs/performance.md)."""
