"""Multi-turn agents: the Environment protocol, the token-in/token-out loop, toy environments."""

from glmlight.agents.env import Environment, StepResult
from glmlight.agents.loop import AgentLoop, Episode, encode_observation, episode_to_sample

__all__ = ["AgentLoop", "Environment", "Episode", "StepResult", "encode_observation", "episode_to_sample"]
