"""AgentOptions: how a run's prompts play as agent episodes, resolved once from the task's agent section
(`task.agent`, `glmlight.config.rollout.AgentConfig`) by the builder (`glmlight.run.build.agent_options`) and
handed to the RolloutDataModule: the environment factory or the agent program, the turn budget, compaction,
the observation's chat role (resolved against the chat template) and the domains that run as episodes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional


@dataclass(frozen=True)
class AgentOptions:
    """None of them set (the default): every prompt is single-turn."""

    env_factory: Optional[Callable[[], Any]] = None  # a fresh environment per episode
    gateway: Any = None  # glmlight.gateway.runner.GatewayOptions: episodes run the user's agent program
    max_turns: int = 4
    turn_max_new_tokens: Optional[int] = None  # tokens per turn (None: rollout.max_new_tokens)
    observation_role: str = "auto"  # the environment's observations' role in the chat template
    compaction: Optional[dict[str, Any]] = None  # CompactingAgentLoop's options (task.agent.compact_threshold set)
    domains: frozenset[str] = frozenset()  # only prompts of these domains are episodes (empty: every prompt)

    @property
    def episodic(self) -> bool:
        """Whether any prompt runs as an episode (an environment or an agent program is set)."""
        return self.env_factory is not None or self.gateway is not None
