"""`build(cfg)`: turn a validated config into a Trainer, an algorithm module and a
RolloutDataModule. User code can add callbacks before calling `run.fit()`.

`validate` has checked every value and rule of the config; what is refused here can only be known while
building: a file or task that does not exist, a class that cannot be built, a library that is missing, a model
that the asked-for forward does not support. Each part gets its own resolved section: the RolloutDataModule the
rollout section, the agent options (`agent_options`) and the evaluation section with its sets."""

from __future__ import annotations

import logging
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from glmlight.strategies.checkpoint import checkpoint_callback
from glmlight.config.schema import validate
from glmlight.run.progress import RLProgressBar
from glmlight.config.registry import algorithm
from glmlight.engines.base import filter_order_of
from glmlight.agents.options import AgentOptions
from glmlight.data.evaluation import DEFAULT_SET, EvalSet, build_eval_sets
from glmlight.data.rollout import RolloutDataModule
from glmlight.data.sources import ArithmeticTask, FileSource
from glmlight.prompt import PromptSource
from glmlight.errors import ConfigError, DataError
from glmlight.hooks import SyncsWeights
from glmlight.split import Side
from glmlight.models.gguf import prepare_model
from glmlight.models.glm5 import forward as glm_forward
from glmlight.models.loading import load_causal_lm, load_tokenizer
from glmlight.models.lora import apply_lora
from glmlight.models.mtp import attach_mtp
from glmlight.models.warm_start import label_examples, mtp_warm_start, supervised_warm_start
from glmlight.rewards import task_reward
from glmlight.run.run import Run
from glmlight.engines.factory import build_engine
from glmlight.strategies.trainer_setup import build_loggers, hardware_kwargs, make_trainer

log = logging.getLogger(__name__)

# RLModule pulls its batch from `dataloader_iter` on purpose (no prefetch: a batch is generated
# with the newest weights, after the previous step's sync); Lightning warns about that flavour.
# Checkpoints are written after an RL step's updates, by design (the ModelCheckpoint note about
# manual optimization does not apply).
for _msg in (".*dataloader_iter.*", ".*`isinstance\\(treespec, LeafSpec\\)` is deprecated.*",
             ".*Using ModelCheckpoint with manual optimization.*"):
    warnings.filterwarnings("ignore", message=_msg)


def build_sources(task: DictConfig, seed: int) -> tuple[PromptSource, PromptSource | None]:
    """The task's training source and its held-out source. A synthetic task's two streams draw from the two
    sides of one train / held-out split of its questions (glmlight.split), so they share no question."""
    train, heldout = Side(False, task.heldout_fraction), Side(True, task.heldout_fraction)
    try:
        if task.source == "running_sum":
            from glmlight.agents.envs import RunningSumTask

            make = lambda s, side: RunningSumTask(task.num_steps, task.max_operand, seed=s,  # noqa: E731
                                                  min_value=task.min_operand, side=side)
            return make(seed, train), make(seed + 1, heldout)
        if task.source == "chat":
            from glmlight.data.chat_tasks import ChatQuestionTask

            make = lambda s, side: ChatQuestionTask(  # noqa: E731
                task.question, seed=s, min_operand=task.min_operand, max_operand=task.max_operand,
                operators=task.operators, list_length=tuple(task.list_length), question_suffix=task.question_suffix,
                system_prompt=task.system_prompt, side=side)
            return make(seed, train), make(seed + 1, heldout)
        if task.source == "synthetic":
            make = lambda s, side: ArithmeticTask(task.max_operand, task.operators, seed=s,  # noqa: E731
                                                  system_prompt=task.system_prompt, side=side)
            return make(seed, train), make(seed + 1, heldout)
    except (DataError, ValueError) as e:
        raise ConfigError(f"config error: {e}") from None
    keys = dict(prompt_key=task.prompt_key, label_key=task.label_key, domain_key=task.domain_key,
                system_prompt=task.system_prompt)
    keys.update(format=task.format, split=task.split)  # jsonl and hf: the same reader (glmlight/data/files.py)
    return FileSource(task.path, **keys), (FileSource(task.eval_path, **keys) if task.eval_path else None)


def build_env_factory(agent: DictConfig):
    """A zero-argument factory of fresh environments (one per episode), or None for single-turn tasks."""
    if agent.env is None:
        return None
    spec = OmegaConf.to_container(agent.env, resolve=True)
    try:
        instantiate(spec)
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"config error: task.agent.env: cannot build {spec['_target_']} ({_root_cause(e)})") from None
    return lambda: instantiate(spec)


def build_gateway(agent: DictConfig):
    """The agent gateway's options (glmlight.gateway.runner.GatewayOptions), or None when no agent program is set."""
    g = agent.gateway
    if g.agent is None and g.command is None:
        return None
    try:
        from glmlight.gateway.runner import GatewayOptions, load_agent
    except ImportError as e:
        raise ConfigError(f"config error: task.agent.gateway needs the gateway's server library ({e}); "
                          "pip install 'glmlight[gateway]'") from None
    return GatewayOptions(agent=load_agent(g.agent) if g.agent is not None else None,
                          command=list(g.command) if g.command is not None else None, timeout_s=g.timeout_s,
                          max_concurrent=g.max_concurrent, reward=g.reward, tool_format=g.tool_format,
                          client_sampling=g.client_sampling, host=g.host)


def expert_factory(agent: DictConfig):
    """What the format warm start's expert comes from: task.agent.gateway.expert, else the environment."""
    spec = agent.gateway.expert
    if spec is None:
        return build_env_factory(agent)
    spec = OmegaConf.to_container(spec, resolve=True)
    try:
        instantiate(spec)
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"config error: task.agent.gateway.expert: cannot build {spec['_target_']} "
                          f"({_root_cause(e)})") from None
    return lambda: instantiate(spec)


def compaction_options(agent: DictConfig) -> dict[str, Any] | None:
    """CompactingAgentLoop's options, or None without task.agent.compact_threshold."""
    if agent.compact_threshold is None:
        return None
    return {"threshold": agent.compact_threshold, "keep_last_steps": agent.keep_last_steps,
            "summary_max_tokens": agent.summary_max_tokens, "summary_prompt": agent.summary_prompt,
            "resume_header": agent.resume_header}


def build_callbacks(cfg: DictConfig) -> list[pl.Callback]:
    out = []
    for name, spec in cfg.callbacks.items():
        if spec is None:
            continue
        try:
            out.append(instantiate(spec, _convert_="all"))
        except Exception as e:  # noqa: BLE001
            raise ConfigError(f"config error: callbacks.{name}: cannot build {spec['_target_']} ({_root_cause(e)})") from None
    synced = any(isinstance(cb, SyncsWeights) and cb.syncs_weights for cb in out)
    if not synced and cfg.rollout.backend == "local":
        log.warning("no weight-sync callback configured: the engine will keep serving the initial weights")
    return out


def _root_cause(e: BaseException) -> str:
    while e.__cause__ is not None:
        e = e.__cause__
    return f"{type(e).__name__}: {e}"


def use_glm_forward(cfg: DictConfig, policy: torch.nn.Module) -> bool:
    """model.forward: whether the trainer runs glmlight's GLM-5 forward instead of the model's own."""
    choice = cfg.model.forward
    if choice == "transformers":
        return False
    reasons = []
    if cfg.model.lora.rank > 0:  # (it reads the base weights directly, not through the adapters)
        reasons.append("model.lora.rank > 0 (LoRA layers run through the model's own forward)")
    elif cfg.model.gradient_checkpointing:  # (the checkpointed layers run through the model's own forward)
        reasons.append("model.gradient_checkpointing=true")
    elif not glm_forward.supports(policy):
        reasons.append(f"{type(policy).__name__} is not a GLM-5 (GlmMoeDsa) model of a shape it supports")
    if cfg.trainer.strategy == "deepspeed":
        reasons.append("trainer.strategy=deepspeed: ZeRO-3 gathers parameters only inside the modules' own forward "
                       "(trainer.strategy=fsdp runs it)")
    if reasons and choice == "glmlight":
        raise ConfigError(f"config error: model.forward=glmlight cannot be used: {'; '.join(reasons)}")
    if reasons:
        log.info("trainer forward: the model's own (%s)", "; ".join(reasons))
    return not reasons


def warm_start(cfg: DictConfig, policy: torch.nn.Module, tokenizer: Any, source: PromptSource,
               make_datamodule: Any, fit: Any = None) -> str | None:
    """The supervised warm start (cached): on reference answers, or on the environment's expert episodes
    through the task's own agent loop (model.warm_start.data); with model.warm_start.mix, the rows of
    other tasks (each built as its own run would build it) in the same batches. `fit`: what trains on the rows
    (`supervised_warm_start` by default, or `mtp_warm_start` for the MTP layers)."""
    identity, examples = _warm_start_rows(cfg, tokenizer, make_datamodule)
    mix = []
    for name in cfg.model.warm_start.mix:
        other = _task_config(cfg, name)
        other_source, _ = build_sources(other.task, other.seed)
        reward = task_reward(other.task, other_source)
        other_identity, other_examples = _warm_start_rows(
            other, tokenizer, _datamodule_factory(other, policy, tokenizer, other_source, reward))
        mix.append((other_source, other_examples or label_examples(tokenizer, other.task.answer_format)))
        identity.setdefault("mix", []).append(other_identity)
    examples = examples or label_examples(tokenizer, cfg.task.answer_format)
    return (fit or supervised_warm_start)(policy, tokenizer, source, cfg.model.warm_start, identity, examples, mix)


def _task_config(cfg: DictConfig, name: str) -> DictConfig:
    """The config a run of task `name` (conf/task/<name>.yaml) would have, with this run's model, seed and
    warm-start settings: what a warm-start mix entry trains on."""
    from glmlight.config.compose import compose

    try:
        other = compose([f"task={name}"])
    except Exception as e:  # noqa: BLE001 - Hydra's missing-config error: one line
        raise ConfigError(f"config error: model.warm_start.mix: no task {name!r} in conf/task ({_root_cause(e)})") from None
    other.model, other.seed = cfg.model, cfg.seed
    return other


def _warm_start_rows(cfg: DictConfig, tokenizer: Any, make_datamodule: Any) -> tuple[dict[str, Any], Any]:
    """(the task's identity for the warm start's cache key, its row maker or None for reference answers)."""
    from glmlight.agents.expert import env_experts, expert_examples

    ws, task = cfg.model.warm_start, cfg.task
    identity = {k: task[k] for k in ("name", "source", "path", "max_operand", "operators", "system_prompt",
                                     "num_steps", "min_operand")}
    if task.source == "chat":
        identity.update(question=task.question, list_length=list(task.list_length), question_suffix=task.question_suffix)
    identity["seed"] = cfg.seed
    if task.source in ("synthetic", "chat", "running_sum"):  # trains on the training side of the split only
        identity["heldout_fraction"] = task.heldout_fraction
    experts = env_experts(expert_factory(task.agent)) if ws.data in ("auto", "expert") else []
    if ws.data == "expert" and not experts:
        raise ConfigError("config error: model.warm_start.data=expert needs an agent task whose environment "
                          "has an expert(messages, summarize) or experts() method")
    if not experts:
        return identity, None
    identity["agent"] = OmegaConf.to_container(task.agent, resolve=True)
    identity["max_context"] = cfg.rollout.max_context
    identity["max_new_tokens"] = cfg.rollout.max_new_tokens
    from glmlight.agents.observation_role import resolve_observation_role

    role = resolve_observation_role(tokenizer, task.agent.observation_role)
    return identity, expert_examples(make_datamodule, tokenizer, experts, task.agent.summary_prompt, role)


def agent_options(agent: DictConfig, tokenizer: Any) -> AgentOptions:
    """task.agent resolved once for the RolloutDataModule: the environment factory, the agent program's options,
    compaction, and an environment's observation role resolved (`auto`) and checked against the chat template
    here, at start-up (glmlight.agents.observation_role)."""
    from glmlight.agents.observation_role import resolve_observation_role

    role = resolve_observation_role(tokenizer, agent.observation_role) if agent.env else agent.observation_role
    return AgentOptions(env_factory=build_env_factory(agent), gateway=build_gateway(agent), max_turns=agent.max_turns,
                        turn_max_new_tokens=agent.max_new_tokens, observation_role=role,
                        compaction=compaction_options(agent), domains=frozenset(agent.domains or ()))


def vocab_size(policy: torch.nn.Module, tokenizer: Any) -> int:
    """The ids an engine may answer with: [0, this) (the model's rows, or the tokenizer's if it has more)."""
    return max(policy.config.vocab_size, len(tokenizer))


def eval_sets(cfg: DictConfig, eval_source: PromptSource | None) -> dict[str, EvalSet]:
    """The held-out sets by name: the task's own ("heldout": its first task.num_eval_prompts prompts), then
    eval.sets."""
    own = {DEFAULT_SET: EvalSet(eval_source, cfg.task.num_eval_prompts)} if eval_source is not None else {}
    return {**own, **build_eval_sets(cfg.eval, cfg.task)}


def _datamodule_factory(cfg: DictConfig, policy: torch.nn.Module, tokenizer: Any, source: PromptSource,
                        reward: Any) -> Any:
    """engine -> a RolloutDataModule of this run's task (the expert warm start plays the task's agent loop)."""
    agent, vocab = agent_options(cfg.task.agent, tokenizer), vocab_size(policy, tokenizer)
    return lambda engine: RolloutDataModule(engine, tokenizer, source, reward, cfg.rollout, agent=agent,
                                            vocab_size=vocab)


def build_policy(cfg: DictConfig, tokenizer: Any, source: PromptSource | None = None, reward: Any = None,
                 warm: bool = True) -> torch.nn.Module:
    """The run's policy before LoRA, the one construction path of training (`build`), export and
    `policy_from_checkpoint`: loaded from model.path or built from model.preset with every model.* option,
    gradient checkpointing, and with `warm` the supervised warm start (cached) when model.warm_start.steps
    > 0, on the task's `source` scored by `reward` (both built from the config when not given)."""
    m = cfg.model
    policy = load_causal_lm(m.path, tokenizer, preset=m.preset, dtype=m.dtype, seed=m.seed, arch=m.arch,
                            trust_remote_code=m.trust_remote_code, index_topk=m.index_topk,
                            n_routed_experts=m.n_routed_experts, num_experts_per_tok=m.num_experts_per_tok)
    if m.gradient_checkpointing:
        policy.gradient_checkpointing_enable()
    warm = warm and m.warm_start.steps > 0
    if warm:
        source = source if source is not None else build_sources(cfg.task, cfg.seed)[0]
        reward = reward if reward is not None else task_reward(cfg.task, source)
        warm_start(cfg, policy, tokenizer, source, _datamodule_factory(cfg, policy, tokenizer, source, reward))
    # the MTP layers (after the warm start, which trains the main model only): the checkpoint's, or fresh ones
    layers = m.mtp.layers
    if layers is None and (m.lora.rank > 0 or cfg.trainer.strategy in ("fsdp", "deepspeed")):
        if getattr(policy.config, "num_nextn_predict_layers", 0) and m.path:
            log.info("%s: its MTP layers are not kept with model.lora / trainer.strategy=%s", m.path,
                     cfg.trainer.strategy)
        layers = 0
    if attach_mtp(policy, layers, path=m.path, seed=m.seed) and warm and m.warm_start.mtp:
        # then fitted on the warm start's rows, the main model frozen (cached)
        warm_start(cfg, policy, tokenizer, source, _datamodule_factory(cfg, policy, tokenizer, source, reward),
                   fit=mtp_warm_start)
    return policy


def model_tokenizer(m: DictConfig) -> Any:
    """The policy's tokenizer: model.path's (or the tiny models' character tokenizer) with model.chat_template."""
    return load_tokenizer(m.path, m.trust_remote_code, chat_template=m.chat_template)


def with_lora(cfg: DictConfig, policy: torch.nn.Module) -> torch.nn.Module:
    """`policy` with the LoRA adapters of model.lora (unchanged at rank 0)."""
    lora = cfg.model.lora
    return apply_lora(policy, lora.rank, lora.alpha, lora.dropout, lora.target_modules)


def policy_from_checkpoint(cfg: DictConfig | dict, ckpt_path: str) -> tuple[torch.nn.Module, Any]:
    """(policy, tokenizer) of a run's Lightning checkpoint, built as `build(cfg)` builds them (a LoRA
    checkpoint holds only the adapters: the base is rebuilt from model.path, or the seed and warm start)."""
    cfg = prepare_model(validate(cfg))
    tokenizer = model_tokenizer(cfg.model)
    lora = cfg.model.lora
    # a LoRA checkpoint holds only the adapters: the base they were trained on is rebuilt (warm start included)
    policy = with_lora(cfg, build_policy(cfg, tokenizer, warm=lora.rank > 0))
    try:
        ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=False)
        state = {k[len("policy."):]: v for k, v in ckpt["state_dict"].items() if k.startswith("policy.")}
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"cannot read the checkpoint {ckpt_path}: {_root_cause(e)}") from None
    try:
        missing, unexpected = policy.load_state_dict(state, strict=False)
    except RuntimeError as e:  # shapes that differ: another model than the run's config builds
        raise ConfigError(f"checkpoint {ckpt_path} does not fit the run's model: {str(e).splitlines()[1].strip()}") from None
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    lost = [k for k in missing if k in trainable or lora.rank == 0]
    if lost or unexpected:
        raise ConfigError(f"checkpoint {ckpt_path} does not fit the run's model (model.lora.rank={lora.rank}): "
                          f"{len(lost)} missing, {len(unexpected)} unexpected tensors, e.g. "
                          f"{(lost or unexpected)[0]!r}")
    return policy.eval(), tokenizer


def build(cfg: DictConfig | dict) -> Run:
    """Everything a run needs, from a (composed) config. Raises ConfigError on bad config."""
    cfg = validate(cfg)

    if cfg.trainer.accelerator == "npu":  # stop at start-up, before any model work, if the runtime is missing
        from glmlight.accelerators.npu import require_npu

        require_npu()
    prepare_model(cfg)  # a GGUF source becomes its cached checkpoint directory (converted on first use)
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    tokenizer = model_tokenizer(cfg.model)
    source, eval_source = build_sources(cfg.task, cfg.seed)
    held_out = eval_sets(cfg, eval_source)
    reward = task_reward(cfg.task, source)
    policy = build_policy(cfg, tokenizer, source=source, reward=reward)
    agent, vocab = agent_options(cfg.task.agent, tokenizer), vocab_size(policy, tokenizer)
    # the engine's own copy (the plain or merged model); it must be able to return the replay records asked for
    engine = build_engine(cfg, policy, tokenizer, replay=cfg.algo.replay)
    policy = with_lora(cfg, policy)
    module = algorithm(cfg.algo.name).module(
        cfg.algo, policy, temperature=cfg.rollout.temperature, top_k=cfg.rollout.top_k, top_p=cfg.rollout.top_p,
        max_new_tokens=cfg.rollout.max_new_tokens, pad_token_id=tokenizer.pad_token_id,
        use_glm_forward=use_glm_forward(cfg, policy),
        filter_order=filter_order_of(engine))  # score the rollouts with the engine's own top-k/top-p order
    datamodule = RolloutDataModule(engine, tokenizer, source, reward, cfg.rollout, agent=agent, eval_cfg=cfg.eval,
                                   eval_sets=held_out, vocab_size=vocab,
                                   policy_version=lambda: module.policy_version)
    callbacks = build_callbacks(cfg)
    steps = module.optimizer_steps_per_rl_step
    checkpoints = checkpoint_callback(cfg.trainer, steps)
    callbacks += [checkpoints] if checkpoints is not None else []
    t = cfg.trainer
    if t.enable_progress_bar:
        callbacks.append(RLProgressBar())
    trainer = make_trainer(
        **hardware_kwargs(t), max_steps=t.max_steps * steps, max_epochs=-1,
        log_every_n_steps=t.log_every_n_steps, enable_progress_bar=t.enable_progress_bar,
        deterministic=t.deterministic, default_root_dir=t.default_root_dir, callbacks=callbacks,
        logger=build_loggers(cfg) or False, num_sanity_val_steps=0, limit_val_batches=0,
        enable_model_summary=False, enable_checkpointing=checkpoints is not None,
    )
    return Run(trainer=trainer, module=module, datamodule=datamodule, cfg=cfg)
