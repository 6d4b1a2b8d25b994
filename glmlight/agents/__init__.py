"""Multi-turn agents: the Environment protocol, the token-in/token-out loop, toy environments."""

from glmlight.agents.env import Environment, StepResult
from glmlight.agents.loop import AgentLoop, Episode, Segment, encode_observation, episode_to_samples, generation_prompt

__all__ = ["AgentLoop", "Environment", "Episode", "Segment", "StepResult", "encode_observation",
           "episode_to_samples", "generation_prompt"]
