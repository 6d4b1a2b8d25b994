"""The rollout side of the typed configuration: servers, sampling and the rollout loop, the task
(prompts, reward, agent). Each key's range and allowed values sit on its field (`field_range`, `choice`), each
section's cross-key rules in its `check`; `glmlight.config.schema.validate` walks them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from glmlight.config.ranges import SEED, field_range
from glmlight.config.rules import choice
from glmlight.dtypes import DTYPES
from glmlight.errors import ConfigError
from glmlight.split import HELDOUT_FRACTION


@dataclass
class ServerConfig:
    """Rollout servers (rollout.backend = sglang | vllm | vllm_ascend)."""

    urls: list[str] = field(default_factory=list)  # one or more servers (requests go to the least busy one), or a router
    # true: urls[0] is a router you run (generation goes there; list its workers after it so weight sync can reach
    # them); sglang-router | vllm-router: glmlight launches the backend's own router (installed from the package
    # registry) in front of the servers it launches (launch=true), and takes a restarting server out of its rotation
    router: Any = choice(False, True, "sglang-router", "vllm-router", default=False)
    router_args: list[str] = field(default_factory=list)  # extra router flags (default: --policy cache_aware)
    # the name of the environment variable holding the API key (sent as Bearer); None or unset: no key. vLLM
    # checks it on /v1, /v2, /inference, /cohere only
    api_key_env: Optional[str] = None
    max_in_flight: int = field_range(">= 1", 64)  # concurrent requests from this process
    request_timeout_s: float = field_range("> 0", 600.0)  # per attempt
    # a request's retries after connection errors, timeouts and 5xx answers; never 4xx
    request_retries: int = field_range(">= 0", 3)
    request_retry_backoff_s: float = field_range(">= 0", 0.5)  # the wait before the first retry, doubling per retry
    # disk: safetensors under weight_sync_dir (a filesystem the servers see); shm: servers on this host map
    # safetensors the trainer writes into shared memory (two slots under shm_dir, overwritten in turn); tensor: CUDA IPC / named shared
    # memory (SGLang: trainer and server on one host) or safetensors bytes over HTTP (vLLM); distributed: a
    # broadcast from the trainer's rank 0 (NCCL; HCCL on vllm_ascend; gloo). SGLang >= 0.5.21 runs tensor and
    # distributed in a /begin_weight_update session.
    weight_sync: str = choice("disk", "shm", "tensor", "distributed", default="disk")
    weight_sync_dir: str = ".cache/glmlight/weights"
    shm_dir: str = "/dev/shm"  # weight_sync=shm: a shared-memory filesystem the servers (same host) see
    # weight_sync=tensor into vLLM: send only the elements that changed since the last update (in the served
    # dtype, as a bitmask and the new values; each server keeps a copy of the weights to apply them to)
    delta_sync: bool = False
    launch: bool = False  # start the server as a managed child process
    # with launch: start this many servers of the backend, each on its own port (urls: one per server, or none for
    # free ports) and its own share of the CPU cores (VLLM_/SGLANG_CPU_OMP_THREADS_BIND) or of the visible devices
    # (CUDA_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES: devices_per_server each; pass the tensor-parallel size in
    # launch_args); every one is stopped on every exit path
    num_servers: int = field_range(">= 1", 1)
    devices_per_server: Optional[int] = field_range(">= 1", None)
    launch_args: list[str] = field(default_factory=list)  # extra server flags, e.g. [--tp-size, "8"]
    launch_command: Optional[list[str]] = None  # replaces `python -m sglang.launch_server` / the vLLM server
    launch_python: Optional[str] = None  # the interpreter of a managed server (its own environment); default: ours
    launch_env: dict[str, str] = field(default_factory=dict)  # extra environment, e.g. {VLLM_CPU_KVCACHE_SPACE: "1"}
    launch_timeout_s: float = field_range("> 0", 900.0)  # also bounds the readiness wait for servers started elsewhere
    # a managed server that exits is started again this many times (then the run stops)
    launch_restarts: int = field_range(">= 0", 3)
    launch_log_dir: Optional[str] = None
    # the path the server loads; unset: model.path (resolve_server_model_path sets it, with a server backend)
    model_path: Optional[str] = None
    sync_backend: Optional[str] = None  # weight_sync=distributed: nccl | hccl | gloo (default by device)
    sync_master_address: Optional[str] = None
    in_process: bool = False  # vllm: run vllm.LLM in this process instead of talking to a server
    # a failed weight update (every server back on the previous version) is retried
    update_retries: int = field_range(">= 0", 2)
    resync: bool = True  # keep the current weights (tensor/distributed: a CPU copy) to re-sync a restarted server
    verify_updates: bool = True  # after an update, score a probe on every server (catches one that did not load)
    check_logprobs: bool = True  # at start: refuse a server whose log-probs are not those of the sampled distribution

    def check(self, cfg: DictConfig) -> None:
        """delta_sync's backend and sync mode; with a server backend (rollout.backend other than local, no
        rollout.engine of one's own): where the servers are. (That a started server has a checkpoint to load is
        checked when the engine is built: a GGUF source becomes model.path only then.)"""
        r = cfg.rollout
        if self.delta_sync and (r.backend not in ("vllm", "vllm_ascend") or self.weight_sync != "tensor"):
            raise ConfigError("config error: rollout.server.delta_sync sends changed elements over weight_sync=tensor "
                              f"into vLLM servers (rollout=vllm or vllm_ascend); got rollout.backend={r.backend}, "
                              f"weight_sync={self.weight_sync}")
        if r.backend == "local" or r.engine:
            return
        if not self.urls and not self.launch and not self.in_process:
            raise ConfigError(f"config error: rollout.backend={r.backend} needs rollout.server.urls (running servers) "
                              "or rollout.server.launch=true (start one)")
        named = self.router if isinstance(self.router, str) else None
        if self.router is True and self.launch:
            raise ConfigError("config error: rollout.server.router=true is a router you run (urls[0]) and cannot be "
                              "launched; rollout.server.router=sglang-router or vllm-router launches the backend's "
                              "router in front of the managed servers")
        if named is not None:
            if not self.launch:
                raise ConfigError(f"config error: rollout.server.router={named} is started in front of the servers "
                                  "glmlight launches: set rollout.server.launch=true (a router you run yourself: "
                                  "router=true with its URL first in rollout.server.urls)")
            want = "sglang" if named == "sglang-router" else "vllm"
            if r.backend.split("_")[0] != want:
                raise ConfigError(f"config error: rollout.server.router={named} routes {want} servers; this run's "
                                  f"rollout.backend is {r.backend}")
        if self.num_servers > 1 and (not self.launch or self.in_process):
            raise ConfigError(f"config error: rollout.server.num_servers={self.num_servers} starts a fleet of managed "
                              "servers: set rollout.server.launch=true (servers you run: list them in rollout.server.urls)")
        if self.launch and len(self.urls) not in (0, 1, self.num_servers):
            raise ConfigError(f"config error: rollout.server.urls lists {len(self.urls)} addresses for "
                              f"{self.num_servers} managed server(s): give one per server, or none for free ports")


@dataclass
class SpeculativeConfig:
    """Speculative decoding in the embedded engine, drafting with the policy's MTP layers (docs/models.md,
    "Speculative rollout"): exact, the samples have the policy's own distribution. With a managed SGLang or vLLM
    server, `depth` goes to the server's own MTP speculative flags (docs/servers.md, "Speculative decoding")."""

    # tokens drafted per round (0: off). Embedded engine: needs a policy with MTP layers (model.mtp.layers=N, or a
    # checkpoint's own) decoded by the GLM-5 runner (GlmMoeDsa, Glm4MoeLite), without rollout.compile. Servers: a
    # managed launch (rollout.server.launch=true), not on CPU (neither CPU build speculates correctly)
    depth: int = field_range(">= 0", 0)
    # embedded engine only: decode plainly while the measured acceptance rate and costs say speculation is slower (rollout/spec_enabled),
    # probing the other way every probe_every decode rounds
    auto_off: bool = True
    probe_every: int = field_range(">= 1", 32)

    def check(self, cfg: DictConfig) -> None:
        """A server speculates only when glmlight starts it, and not on CPU; speculation decodes eagerly."""
        r, depth = cfg.rollout, self.depth
        if depth > 0 and r.backend != "local" and (r.server.in_process or not r.server.launch):
            raise ConfigError(f"config error: rollout.speculative.depth={depth} with rollout={r.backend} adds the "
                              "server's MTP speculative flags to a managed server's command (rollout.server.launch=true); "
                              "start a server of your own with them yourself and leave the depth at 0 (docs/servers.md, "
                              "Speculative decoding)")
        if depth > 0 and r.backend in ("sglang", "vllm") and cfg.trainer.accelerator == "cpu":
            raise ConfigError(f"config error: rollout.speculative.depth={depth} with rollout={r.backend} on CPU: "
                              + ("SGLang 0.5.23's CPU build cannot start speculative decoding (sgl_kernel has no "
                                 "copy_all_layer_kv_cache_cpu) and verifies drafts greedily on CPU"
                                 if r.backend == "sglang" else
                                 "vLLM 0.32's CPU build answers sampled speculative requests with token 0 at log-prob "
                                 "0.0 or non-finite log-probs (HTTP 400)")
                              + "; speculate with the embedded engine (rollout=local) or on a GPU (docs/servers.md, "
                                "Speculative decoding)")
        if depth > 0 and r.compile:
            raise ConfigError(f"config error: rollout.speculative.depth={depth} decodes eagerly: set rollout.compile=false")


@dataclass
class RolloutConfig:
    backend: str = choice("local", "sglang", "vllm", "vllm_ascend", default="local")
    # An engine of your own: {_target_: pkg.make_engine, ...}, called as make_engine(cfg=, policy=, tokenizer=,
    # **kwargs) and returning a RolloutEngine (glmlight/engines/base.py); replaces `backend`.
    engine: Any = None
    mode: str = choice("sync", "async", default="sync")
    # the engine's own weight copy (e.g. bfloat16 while training runs in fp32)
    dtype: str = choice(*DTYPES, default="float32")
    # auto: every weight in `dtype`; fp8: linear weights block-quantised (float8_e4m3fn, one scale per
    # 128 x 128 block, the GLM-5 / DeepSeek-V3 FP8 checkpoint layout) at every sync, computed in `dtype`.
    # Servers: start them with an FP8 checkpoint (scripts/export.py --fp8); the sync sends that layout.
    weight_format: str = choice("auto", "fp8", default="auto")
    device: Optional[str] = None  # embedded engine device; None = the trainer's device
    # embedded engine, GLM-5 and dense Llama-family models: torch.compile the decode step. Pays for long
    # generations (the first steps wait for the compile, ~10-30 s on CPU, which needs a C++ compiler)
    compile: bool = False
    # embedded engine: intra-op CPU threads of its decode thread (None: torch's setting). 1 suits small models,
    # whose decode steps are many small ops; a model whose steps are big matmuls gains from more
    num_threads: Optional[int] = field_range(">= 1", 1)
    temperature: float = field_range(">= 0", 1.0)
    top_p: float = field_range("(0, 1]", 1.0)
    top_k: int = field_range(">= 0", 0)
    max_new_tokens: int = field_range(">= 1", 6)
    rollout_batch_size: int = field_range(">= 1", 32)  # prompts per training step
    n_samples_per_prompt: int = field_range(">= 1", 8)  # group size
    over_sample: float = field_range(">= 1", 1.0)  # draw this many times rollout_batch_size prompts per round
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal, refill
    max_refill_rounds: int = field_range(">= 0", 4)
    overlong: str = choice("none", "mask", "soft_penalty", default="none")  # DAPO
    overlong_cache: int = field_range(">= 0", 4)  # L_cache of the soft overlong penalty
    max_context: int = field_range(">= 2", 2048)  # prompt + response token budget
    # async: rollout batches generated ahead of training (1: each is one step off-policy)
    queue_size: int = field_range(">= 1", 1)
    engine_retries: int = field_range(">= 0", 3)  # retries of a failed engine call before its samples are FAILED
    engine_retry_backoff_s: float = field_range(">= 0", 0.5)
    # async: in-flight generations continue (per-token versions) or abort
    on_weight_update: str = choice("continue", "abort", default="continue")
    # the prompt order and the engine's sampling seeds; conf/train.yaml sets it to the run's seed
    seed: int = field_range(SEED, 0)
    # embedded engine: speculative rollout with the policy's MTP layers (speculative.depth=K; default off)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    server: "ServerConfig" = field(default_factory=lambda: ServerConfig())

    def check(self, cfg: DictConfig) -> None:
        """rollout.compile is the embedded engine's; an engine of one's own is built from its _target_."""
        if self.compile and self.backend != "local":
            raise ConfigError(f"config error: rollout.compile is for the embedded engine (rollout=local); "
                              f"{self.backend} servers capture their own graphs")
        if self.engine and "_target_" not in self.engine:
            raise ConfigError("config error: rollout.engine needs a _target_ (a function returning a RolloutEngine)")


def resolve_server_model_path(cfg: DictConfig) -> None:
    """rollout.server.model_path, the checkpoint the servers load, resolved once (by validate): with a server
    backend and the key unset, `${model.path}`, so that it follows model.path where a GGUF source becomes a
    checkpoint directory after validate (glmlight.models.gguf.prepare_model). Engines read only this key."""
    server = cfg.rollout.server
    if cfg.rollout.backend != "local" and server.model_path is None and not OmegaConf.is_missing(cfg.model, "path"):
        server.model_path = "${model.path}"


@dataclass
class GatewayConfig:
    """The agent gateway (docs/agents.md): the user's own agent program, run once per episode against
    OpenAI- and Anthropic-compatible endpoints that record the exact tokens. On when `agent` or
    `command` is set."""

    agent: Optional[str] = None  # a callable agent(task): "pkg.module:function" or "path/to/file.py:function"
    command: Optional[list[str]] = None  # or a command; the episode's URLs, key and prompt are in its environment
    # the agent's own time per episode (time waiting for the engine not counted)
    timeout_s: float = field_range("> 0", 300.0)
    max_concurrent: int = field_range(">= 1", 128)  # agents running at once
    # task: task.reward scores the episode | agent: the reward the agent reports
    reward: str = choice("task", "agent", default="task")
    # how tool calls look in the model's text (glmlight/gateway/tool_format.py)
    tool_format: str = choice("auto", "line", "hermes", "glm", default="auto")
    client_sampling: bool = False  # honour a request's temperature / top_p / top_k (off: the run's sampling)
    host: str = "127.0.0.1"
    # The format warm start's demonstrations: an object with expert(messages, summarize) (or experts()),
    # built with _target_ and played through the gateway with the agent (e.g. the calculator environment).
    expert: Optional[dict[str, Any]] = None

    def check(self, cfg: DictConfig) -> None:
        """An agent program is a callable or a command, instead of an environment; the expert plays through it."""
        agent = cfg.task.agent
        if self.agent is None and self.command is None:
            if self.expert is not None:
                raise ConfigError("config error: task.agent.gateway.expert needs an agent program "
                                  "(task.agent.gateway.agent or .command)")
            return
        if self.agent is not None and self.command is not None:
            raise ConfigError("config error: task.agent.gateway: set agent (a callable) or command, not both")
        if agent.env is not None:
            raise ConfigError("config error: task.agent.gateway runs an agent program; task.agent.env must be null")
        if agent.compact_threshold is not None:
            raise ConfigError("config error: task.agent.compact_threshold is for task.agent.env episodes; a gateway "
                              "agent manages its own context (a rewritten history opens a new segment)")
        if self.command is not None and not self.command:
            raise ConfigError("config error: task.agent.gateway.command is empty")
        if self.expert is not None and "_target_" not in self.expert:
            raise ConfigError("config error: task.agent.gateway.expert needs a _target_")


@dataclass
class AgentConfig:
    """Multi-turn episodes: set env to an Environment class (_target_) to turn the task into an agent task."""

    env: Optional[dict[str, Any]] = None
    # The prompt domains (Prompt.domain) that run as episodes; the others stay single-turn, scored by
    # task.reward (a mixed-domain prompt set, e.g. cross-stage distillation). Empty = every prompt.
    domains: list[str] = field(default_factory=list)
    max_turns: int = field_range(">= 1", 4)
    max_new_tokens: Optional[int] = field_range(">= 1", None)  # tokens per turn; None = rollout.max_new_tokens
    # the role of the environment's observations in the chat template: auto (the first of observation, tool,
    # user that the template renders; glmlight/agents/observation_role.py), or one of them; one the template
    # renders nothing of is a config error at start-up
    observation_role: str = "auto"
    # Context compaction (CompactionRL): summarise when the remaining budget falls below this.
    compact_threshold: Optional[int] = field_range(">= 1", None)
    keep_last_steps: int = field_range(">= 0", 2)  # k action/observation steps copied into the resume prompt
    summary_max_tokens: int = field_range(">= 1", 32)
    summary_prompt: str = "Summarize."  # the user turn that asks the policy for its summary
    resume_header: str = "Summary: "  # opens the resume turn that carries the summary
    gateway: GatewayConfig = field(default_factory=GatewayConfig)  # an agent program instead of an env

    def check(self, cfg: DictConfig) -> None:
        """An environment is built from its _target_; compaction summarises an environment's episodes."""
        if self.env is not None and "_target_" not in self.env:
            raise ConfigError("config error: task.agent.env needs a _target_ (an Environment class)")
        if self.compact_threshold is not None and self.env is None:
            raise ConfigError("config error: task.agent.compact_threshold needs an agent task (task.agent.env)")


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

    timeout_s: float = field_range("> 0", 120.0)
    max_concurrency: int = field_range(">= 1", 8)
    executor: str = choice("thread", "process", default="thread")
    style: str = choice("auto", "sample", "trl", "verl", default="auto")


@dataclass
class TaskConfig:
    name: str = "arithmetic"
    # synthetic | chat | running_sum | jsonl | hf; jsonl and hf read the same local files (glmlight/data/files.py)
    source: str = choice("synthetic", "chat", "running_sum", "jsonl", "hf", default="synthetic")
    # a local file or directory: JSON Lines, a JSON array, parquet, a directory of them, a save_to_disk dataset
    path: Optional[str] = None
    eval_path: Optional[str] = None  # held-out prompts (same format); synthetic tasks make their own
    # auto (by the file's name) | jsonl | json | parquet | datasets (a save_to_disk directory); glmlight/data/files.py
    format: str = choice("auto", "jsonl", "json", "parquet", "datasets", default="auto")
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
    max_operand: int = field_range(">= 1", 9)
    operators: str = "+"
    # source=chat (glmlight/data/chat_tasks.py): questions in words; arithmetic and sort draw numbers from
    # [min_operand, max_operand]
    # arithmetic | sort | reverse | count_letter (glmlight/data/chat_tasks.py)
    question: str = choice("arithmetic", "sort", "reverse", "count_letter", default="arithmetic")
    list_length: list[int] = field_range(">= 2", default_factory=lambda: [3, 3])  # sort / reverse: [min, max] items
    question_suffix: str = ""  # appended to every question
    num_steps: int = field_range(">= 1", 8)  # running_sum: numbers per episode
    min_operand: int = field_range(">= 0", 1)  # running_sum: numbers in [min_operand, max_operand]
    num_eval_prompts: int = field_range(">= 0", 64)
    # Synthetic tasks: the share of the question space held out (glmlight/split.py). A question is a training
    # question or a held-out one by a hash of its text, never both, whatever the seed.
    heldout_fraction: float = field_range("(0, 1)", HELDOUT_FRACTION)
    agent: AgentConfig = field(default_factory=AgentConfig)
    # The reward: any callable sample -> float | (float, info), built with Hydra's _target_.
    reward: dict[str, Any] = field(default_factory=lambda: {"_target_": "glmlight.rewards.verifiers.ExactMatch"})
    reward_options: RewardOptions = field(default_factory=RewardOptions)  # timeout, concurrency, executor

    def check(self, cfg: DictConfig) -> None:
        """The warm start's answer names the label; chat lists have two bounds; file sources have a path."""
        if self.answer_format is not None and "{label}" not in self.answer_format:
            raise ConfigError(f"config error: task.answer_format={self.answer_format!r} must contain {{label}} (where "
                              "the warm start puts each prompt's label, e.g. \\boxed{{label}})")
        if self.source == "chat" and len(self.list_length) != 2:
            raise ConfigError(f"config error: task.list_length={list(self.list_length)} must be [min, max]")
        if self.source in ("jsonl", "hf") and not OmegaConf.is_missing(self, "path") and not self.path:
            raise ConfigError(f"config error: task.source={self.source} needs task.path")

