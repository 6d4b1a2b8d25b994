"""The vLLM backend of the server fleet: `engine.py` (`VLLMEngine`: the fleet of vLLM servers and its
start-up checks), `adapter.py` (`VLLMServer`: one server's requests), `sync.py` (`VLLMWeightSync`: its
weight-sync transport), `wire.py` (wire details and vLLM-Ascend's settings) and `inprocess.py` (a
`vllm.LLM` in this process). The worker extension the servers load is ../worker/vllm_extension.py."""
