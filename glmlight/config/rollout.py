"""The rollout side of the typed configuration: servers, sampling and the rollout loop, the task
(prompts, reward, agent). `glmlight.config.schema` re-exports every class here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from glmlight.config.ranges import SEED, ranges
from glmlight.split import HELDOUT_FRACTION


@dataclass
class ServerConfig:
    """Rollout servers (rollout.backend = sglang | vllm | vllm_ascend)."""

    urls: list[str] = field(default_factory=list)  # one or more servers (requests go to the least busy one), or a router
    # urls[0] is a router (sglang-router; generation only): send generation there; list the workers after it so
    # weight sync can reach them
    router: bool = False
    # the name of the environment variable holding the API key (sent as Bearer); None or unset: no key. vLLM
    # checks it on /v1, /v2, /inference, /cohere only
    api_key_env: Optional[str] = None
    max_in_flight: int = 64  # concurrent requests from this process
    request_timeout_s: float = 600.0  # per attempt
    request_retries: int = 3  # a request's retries after connection errors, timeouts and 5xx answers; never 4xx
    request_retry_backoff_s: float = 0.5  # the wait before the first retry, doubling per retry
    # disk: safetensors under weight_sync_dir (a filesystem the servers see); shm: servers on this host map
    # safetensors the trainer writes into shared memory (two slots under shm_dir, overwritten in turn); tensor: CUDA IPC / named shared
    # memory (SGLang: trainer and server on one host) or safetensors bytes over HTTP (vLLM); distributed: a
    # broadcast from the trainer's rank 0 (NCCL; HCCL on vllm_ascend; gloo). SGLang >= 0.5.21 runs tensor and
    # distributed in a /begin_weight_update session.
    weight_sync: str = "disk"
    weight_sync_dir: str = ".cache/glmlight/weights"
    shm_dir: str = "/dev/shm"  # weight_sync=shm: a shared-memory filesystem the servers (same host) see
    # weight_sync=tensor into vLLM: send only the elements that changed since the last update (in the served
    # dtype, as a bitmask and the new values; each server keeps a copy of the weights to apply them to)
    delta_sync: bool = False
    launch: bool = False  # start the server as a managed child process
    launch_args: list[str] = field(default_factory=list)  # extra server flags, e.g. [--tp-size, "8"]
    launch_command: Optional[list[str]] = None  # replaces `python -m sglang.launch_server` / the vLLM server
    launch_python: Optional[str] = None  # the interpreter of a managed server (its own environment); default: ours
    launch_env: dict[str, str] = field(default_factory=dict)  # extra environment, e.g. {VLLM_CPU_KVCACHE_SPACE: "1"}
    launch_timeout_s: float = 900.0  # also bounds the readiness wait for servers started elsewhere
    launch_restarts: int = 3  # a managed server that exits is started again this many times (then the run stops)
    launch_log_dir: Optional[str] = None
    model_path: Optional[str] = None  # the path the server loads (default: model.path)
    sync_backend: Optional[str] = None  # weight_sync=distributed: nccl | hccl | gloo (default by device)
    sync_master_address: Optional[str] = None
    in_process: bool = False  # vllm: run vllm.LLM in this process instead of talking to a server
    update_retries: int = 2  # a failed weight update (every server back on the previous version) is retried
    resync: bool = True  # keep the current weights (tensor/distributed: a CPU copy) to re-sync a restarted server
    verify_updates: bool = True  # after an update, score a probe on every server (catches one that did not load)
    check_logprobs: bool = True  # at start: refuse a server whose log-probs are not those of the sampled distribution


ranges(ServerConfig, max_in_flight=">= 1", request_timeout_s="> 0", request_retries=">= 0", request_retry_backoff_s=">= 0",
       launch_timeout_s="> 0", update_retries=">= 0", launch_restarts=">= 0")


@dataclass
class SpeculativeConfig:
    """Speculative decoding in the embedded engine, drafting with the policy's MTP layers (docs/models.md,
    "Speculative rollout"): exact, the samples have the policy's own distribution. With a managed SGLang or vLLM
    server, `depth` goes to the server's own MTP speculative flags (docs/servers.md, "Speculative decoding")."""

    # tokens drafted per round (0: off). Embedded engine: needs a policy with MTP layers (model.mtp.layers=N, or a
    # checkpoint's own) decoded by the GLM-5 runner (GlmMoeDsa, Glm4MoeLite), without rollout.compile. Servers: a
    # managed launch (rollout.server.launch=true), not on CPU (neither CPU build speculates correctly)
    depth: int = 0
    # embedded engine only: decode plainly while the measured acceptance rate and costs say speculation is slower (rollout/spec_enabled),
    # probing the other way every probe_every decode rounds
    auto_off: bool = True
    probe_every: int = 32


ranges(SpeculativeConfig, depth=">= 0", probe_every=">= 1")


@dataclass
class RolloutConfig:
    backend: str = "local"  # local | sglang | vllm | vllm_ascend
    # An engine of your own: {_target_: pkg.make_engine, ...}, called as make_engine(cfg=, policy=, tokenizer=,
    # **kwargs) and returning a RolloutEngine (glmlight/engines/base.py); replaces `backend`.
    engine: Any = None
    mode: str = "sync"  # sync | async
    dtype: str = "float32"  # the engine's own weight copy (e.g. bfloat16 while training runs in fp32)
    # auto: every weight in `dtype`; fp8: linear weights block-quantised (float8_e4m3fn, one scale per
    # 128 x 128 block, the GLM-5 / DeepSeek-V3 FP8 checkpoint layout) at every sync, computed in `dtype`.
    # Servers: start them with an FP8 checkpoint (scripts/export.py --fp8); the sync sends that layout.
    weight_format: str = "auto"
    device: Optional[str] = None  # embedded engine device; None = the trainer's device
    # embedded engine, GLM-5 and dense Llama-family models: torch.compile the decode step. Pays for long
    # generations (the first steps wait for the compile, ~10-30 s on CPU, which needs a C++ compiler)
    compile: bool = False
    # embedded engine: intra-op CPU threads of its decode thread (None: torch's setting). 1 suits small models,
    # whose decode steps are many small ops; a model whose steps are big matmuls gains from more
    num_threads: Optional[int] = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 6
    rollout_batch_size: int = 32  # prompts per training step
    n_samples_per_prompt: int = 8  # group size
    over_sample: float = 1.0  # draw this many times rollout_batch_size prompts per round
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal, refill
    max_refill_rounds: int = 4
    overlong: str = "none"  # none | mask | soft_penalty (DAPO)
    overlong_cache: int = 4  # L_cache of the soft overlong penalty
    max_context: int = 2048  # prompt + response token budget
    queue_size: int = 1  # async: rollout batches generated ahead of training (1: each is one step off-policy)
    engine_retries: int = 3  # retries of a failed engine call before its samples are FAILED
    engine_retry_backoff_s: float = 0.5
    on_weight_update: str = "continue"  # async: in-flight generations continue (per-token versions) or abort
    seed: int = 0
    # embedded engine: speculative rollout with the policy's MTP layers (speculative.depth=K; default off)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    server: "ServerConfig" = field(default_factory=lambda: ServerConfig())


ranges(RolloutConfig, num_threads=">= 1", temperature=">= 0", top_p="(0, 1]", top_k=">= 0", max_new_tokens=">= 1",
       rollout_batch_size=">= 1", n_samples_per_prompt=">= 1", over_sample=">= 1", max_refill_rounds=">= 0",
       overlong_cache=">= 0", max_context=">= 2", queue_size=">= 1", engine_retries=">= 0",
       engine_retry_backoff_s=">= 0", seed=SEED)


@dataclass
class GatewayConfig:
    """The agent gateway (docs/agents.md): the user's own agent program, run once per episode against
    OpenAI- and Anthropic-compatible endpoints that record the exact tokens. On when `agent` or
    `command` is set."""

    agent: Optional[str] = None  # a callable agent(task): "pkg.module:function" or "path/to/file.py:function"
    command: Optional[list[str]] = None  # or a command; the episode's URLs, key and prompt are in its environment
    timeout_s: float = 300.0  # the agent's own time per episode (time waiting for the engine not counted)
    max_concurrent: int = 128  # agents running at once
    reward: str = "task"  # task: task.reward scores the episode | agent: the reward the agent reports
    tool_format: str = "auto"  # how tool calls look in the model's text: auto | line | hermes | glm
    client_sampling: bool = False  # honour a request's temperature / top_p / top_k (off: the run's sampling)
    host: str = "127.0.0.1"
    # The format warm start's demonstrations: an object with expert(messages, summarize) (or experts()),
    # built with _target_ and played through the gateway with the agent (e.g. the calculator environment).
    expert: Optional[dict[str, Any]] = None


ranges(GatewayConfig, timeout_s="> 0", max_concurrent=">= 1")


@dataclass
class AgentConfig:
    """Multi-turn episodes: set env to an Environment class (_target_) to turn the task into an agent task."""

    env: Optional[dict[str, Any]] = None
    # The prompt domains (Prompt.domain) that run as episodes; the others stay single-turn, scored by
    # task.reward (a mixed-domain prompt set, e.g. cross-stage distillation). Empty = every prompt.
    domains: list[str] = field(default_factory=list)
    max_turns: int = 4
    max_new_tokens: Optional[int] = None  # tokens per turn; None = rollout.max_new_tokens
    # the role of the environment's observations in the chat template: auto (the first of observation, tool,
    # user that the template renders; glmlight/agents/observation_role.py), or one of them; one the template
    # renders nothing of is a config error at start-up
    observation_role: str = "auto"
    # Context compaction (CompactionRL): summarise when the remaining budget falls below this.
    compact_threshold: Optional[int] = None
    keep_last_steps: int = 2  # k action/observation steps copied into the resume prompt
    summary_max_tokens: int = 32
    summary_prompt: str = "Summarize."  # the user turn that asks the policy for its summary
    resume_header: str = "Summary: "  # opens the resume turn that carries the summary
    gateway: GatewayConfig = field(default_factory=GatewayConfig)  # an agent program instead of an env


ranges(AgentConfig, max_turns=">= 1", max_new_tokens=">= 1", compact_threshold=">= 1", keep_last_steps=">= 0",
       summary_max_tokens=">= 1")


@dataclass
class RewardOptions:
    """How the reward runs (`task.reward_options`; the reward itself is `task.reward`). Every call on one
    sample has `timeout_s` seconds, else the sample is FAILED and counted (`rollout/dropped/reward_timeout`);
    at most `max_concurrency` samples are scored at once. Synchronous rewards run in worker threads
    (`executor=thread`; a timed-out call is abandoned) or worker processes (`executor=process`: for
    CPU-heavy rewards; a timed-out call's process is killed); async rewards run on an event loop, a timed-out
    call is cancelled. `style` is the reward's calling convention (glmlight/rewards/styles.py): auto (from its
    signature), sample (`fn(sample)`), trl (TRL's `fn(prompts, completions, completion_ids, **columns)`,
    batched per prompt group, the group's one call under timeout_s) or verl (`compute_score(data_source,
    solution_str, ground_truth, extra_info)`)."""

    timeout_s: float = 120.0
    max_concurrency: int = 8
    executor: str = "thread"  # thread | process
    style: str = "auto"  # auto | sample | trl | verl


ranges(RewardOptions, timeout_s="> 0", max_concurrency=">= 1")


@dataclass
class TaskConfig:
    name: str = "arithmetic"
    # synthetic | chat | running_sum | jsonl | hf; jsonl and hf read the same local files (glmlight/data/files.py)
    source: str = "synthetic"
    # a local file or directory: JSON Lines, a JSON array, parquet, a directory of them, a save_to_disk dataset
    path: Optional[str] = None
    eval_path: Optional[str] = None  # held-out prompts (same format); synthetic tasks make their own
    format: str = "auto"  # auto (by the file's name) | jsonl | json | parquet | datasets (a save_to_disk directory)
    split: str = "train"  # a DatasetDict's split, or a directory's files named after it (train.parquet, test-*.jsonl)
    # the fields of a row; a dotted key reaches a nested field (verl: label_key=reward_model.ground_truth)
    prompt_key: str = "prompt"  # a string, or a list of {role, content} messages
    label_key: Optional[str] = "label"  # null: the rows carry no label (for a reward that reads none)
    domain_key: str = "domain"
    system_prompt: Optional[str] = None
    # The answer the supervised warm start (model.warm_start) teaches for a prompt, "{label}" standing for its
    # label: \boxed{{label}} for a reward that reads the boxed answer (task=jsonl's MathVerify).
    answer_format: str = "{label}"
    # Synthetic arithmetic: operands in [0, max_operand], these operators.
    max_operand: int = 9
    operators: str = "+"
    # source=chat (glmlight/data/chat_tasks.py): questions in words; arithmetic and sort draw numbers from
    # [min_operand, max_operand]
    question: str = "arithmetic"  # arithmetic | sort | reverse | count_letter
    list_length: list[int] = field(default_factory=lambda: [3, 3])  # sort / reverse: [min, max] items
    question_suffix: str = ""  # appended to every question
    num_steps: int = 8  # running_sum: numbers per episode
    min_operand: int = 1  # running_sum: numbers in [min_operand, max_operand]
    num_eval_prompts: int = 64
    # Synthetic tasks: the share of the question space held out (glmlight/split.py). A question is a training
    # question or a held-out one by a hash of its text, never both, whatever the seed.
    heldout_fraction: float = HELDOUT_FRACTION
    agent: AgentConfig = field(default_factory=AgentConfig)
    # The reward: any callable sample -> float | (float, info), built with Hydra's _target_.
    reward: dict[str, Any] = field(default_factory=lambda: {"_target_": "glmlight.rewards.verifiers.ExactMatch"})
    reward_options: RewardOptions = field(default_factory=RewardOptions)  # timeout, concurrency, executor


ranges(TaskConfig, list_length=">= 2", max_operand=">= 1", min_operand=">= 0", num_steps=">= 1", num_eval_prompts=">= 0",
       heldout_fraction="(0, 1)")
