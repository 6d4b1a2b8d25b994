"""The server engines: one fleet of inference servers (`fleet.py`: `ServerFleet`) drives one adapter per
server and its backend's weight-sync transport (`protocol.py`); the backends are `vllm/` and `sglang/`.
The fleet's parts: the HTTP client (`http.py`), the servers marked out (`suspects.py`), start-up and
post-update checks (`checks.py`), replay records (`replay.py`, formats in `replay_codec.py`), the
weight-update process group (`group.py`) and shared-memory slots (`shm.py`); its settings from the config
(`settings.py`); the servers glmlight starts itself (`launch.py`, run under `guard.py`). `worker/` runs
inside the servers' processes (the vLLM worker extension). Imports nothing at import time."""
