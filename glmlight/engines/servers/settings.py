"""The server engines' constructor settings from the run's config, read in this one place: among them
the checkpoint the servers serve (`rollout.server.model_path`, else `model.path`)."""

from __future__ import annotations

from typing import Any


def served_model_path(cfg: Any) -> str | None:
    """The checkpoint directory the servers serve: rollout.server.model_path, else model.path."""
    return cfg.rollout.server.model_path or cfg.model.path


def server_settings(cfg: Any) -> dict[str, Any]:
    """Constructor arguments every server engine takes, from the whole config."""
    from glmlight.engines.servers.http import HttpSettings

    s = cfg.rollout.server
    return dict(urls=list(s.urls), router=bool(s.router), http=HttpSettings.from_config(s),
                ready_timeout_s=float(s.launch_timeout_s), weight_sync=s.weight_sync,
                weight_sync_dir=s.weight_sync_dir, shm_dir=s.shm_dir, model_path=served_model_path(cfg),
                update_retries=int(s.update_retries), resync=bool(s.resync), verify_updates=bool(s.verify_updates),
                weight_format=str(cfg.rollout.weight_format), launch_restarts=int(s.launch_restarts))
