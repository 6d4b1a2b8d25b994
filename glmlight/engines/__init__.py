"""The inference engines: token ids in, token ids and log-probs out (docs/contracts.md).

- `base.py`: the `RolloutEngine` protocol, its optional abilities, `SamplingParams` and `Generation`;
- `factory.py`: the engine a run's config asks for (`build_engine`);
- `retry.py`: engine calls that survive transient failures;
- `transport.py`: the weight transport every engine shares (checkpoints, buckets, the update group);
- `local/`: the embedded engine (`rollout=local`) and its runners;
- `servers/`: the SGLang and vLLM clients, the servers glmlight launches, the vLLM worker extension.

`local/` and `servers/` import the modules above, never each other. This package imports nothing at
import time: a vLLM worker imports `servers/worker/vllm_extension.py` with torch and safetensors alone.
"""
