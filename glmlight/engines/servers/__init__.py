"""The server engines: clients of SGLang (`sglang.py`) and vLLM (`vllm.py`, `vllm_inprocess.py`) over
what both share (`base.py`: `ServerEngineBase`), their HTTP pieces (`http.py`), wire formats
(`sglang_wire.py`, `vllm_wire.py`, `replay_codec.py`), start-up checks, replay and suspects
(`server_*.py`), the servers glmlight starts itself (`launch.py`, run under `server_guard.py`), and the
vLLM worker extension (`vllm_worker.py`), which runs inside vLLM's workers. Imports nothing at import
time."""
