"""GLM-5 (GlmMoeDsa) kernels shared by the trainer and the embedded engine: which models the fast
paths reproduce (`arch`), the MoE block (`moe`), the training forward (`forward`) and the DSA
indexer installed on loaded models (`indexer`)."""
