"""The embedded engine (`engine.py`: `LocalEngine`, `rollout=local`): the policy's own architecture in
torch, in its own weight copy, with continuous batching (`batch.py`), glmlight's sampling
(`sampling.py`) and three runners: GLM-5 and GLM-4.7-Flash (`glm_runner.py`, `glm_weights.py`), dense
attention (`dense_runner.py`: Llama family, GLM-4.5's Glm4Moe) and any other causal LM (`hf_runner.py`);
replay capture in `records.py`."""
