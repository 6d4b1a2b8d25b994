"""The embedded engine (`engine.py`: `LocalEngine`, `rollout=local`): the policy's own architecture in
torch, in its own weight copy, with continuous batching (`batch.py`), glmlight's sampling
(`sampling.py`) and three runners: GLM-5 (`glm_runner.py`, `glm_weights.py`), dense Llama-family
(`dense_runner.py`) and any other causal LM (`hf_runner.py`); replay capture in `records.py`."""
