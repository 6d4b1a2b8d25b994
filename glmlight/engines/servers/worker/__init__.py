"""Code that runs inside the inference servers' own processes, in their environments: the vLLM worker
extension (`vllm_extension.py`, loaded by vLLM's `--worker-extension-cls`) and the checks it makes of an
update (`checks.py`). Modules here import torch, safetensors, the standard library and glmlight modules that
import nothing more (glmlight.dtypes, glmlight.engines.transport, glmlight.engines.weight_delta); a
vLLM server's environment has no Lightning, Hydra, OmegaConf, transformers or aiohttp."""
