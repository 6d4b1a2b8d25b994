"""The vLLM worker extension's former path, which vLLM servers are started with:
`--worker-extension-cls glmlight.rollout.vllm_worker.WeightLoaderExtension` is
`glmlight.engines.servers.vllm_worker.WeightLoaderExtension` (docs/servers.md)."""

from glmlight.engines.servers.vllm_worker import WeightLoaderExtension  # noqa: F401
