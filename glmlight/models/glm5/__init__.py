"""GLM-5 (GlmMoeDsa) kernels shared by the trainer and the embedded engine: which models the fast
paths reproduce (`arch`), the MoE block (`moe`, also GLM-4.5's and GLM-4.7-Flash's), the training
forward (`forward`), routing and index replay (`replay`) and the DSA indexer installed on loaded
models (`indexer`)."""
