"""The server engines' constructor settings from the run's config, read in this one place: among them
the checkpoint the servers serve (`rollout.server.model_path`, as validate resolved it)."""

from __future__ import annotations

from typing import Any


def served_model_path(cfg: Any) -> str | None:
    """The checkpoint directory the servers serve: rollout.server.model_path, which validate resolves (to
    model.path when unset: glmlight.config.rollout.resolve_server_model_path)."""
    return cfg.rollout.server.model_path


def server_settings(cfg: Any) -> dict[str, Any]:
    """Constructor arguments every server engine takes, from the whole config."""
    from glmlight.engines.servers.http import HttpSettings

    s = cfg.rollout.server
    return dict(urls=list(s.urls), router=bool(s.router), http=HttpSettings.from_config(s),
                ready_timeout_s=float(s.launch_timeout_s), weight_sync=s.weight_sync,
                weight_sync_dir=s.weight_sync_dir, shm_dir=s.shm_dir, model_path=served_model_path(cfg),
                update_retries=int(s.update_retries), resync=bool(s.resync), verify_updates=bool(s.verify_updates),
                weight_format=str(cfg.rollout.weight_format), launch_restarts=int(s.launch_restarts))


# The fleet rank 0 launched, for the ranks Lightning starts after it (they inherit this process's environment).
FLEET_ENV = "GLMLIGHT_SHARED_FLEET"


def data_parallel_rank() -> int:
    """This process's global rank as the launcher set it (RANK, SLURM_PROCID, LOCAL_RANK, ...); 0 alone."""
    from lightning.fabric.utilities.rank_zero import _get_rank

    return _get_rank() or 0


def joined_fleet(cfg: Any) -> dict[str, Any] | None:
    """For a data-parallel rank other than 0: the fleet it joins as a client instead of building its own (the
    ranks share one fleet, rollout.server.launch or not): the one rank 0 launched (its URLs, from the
    environment), or the servers in rollout.server.urls. None on rank 0 and in a single process."""
    import json
    import os

    from glmlight.errors import ConfigError

    if data_parallel_rank() == 0:
        return None
    s = cfg.rollout.server
    if os.environ.get(FLEET_ENV):
        return json.loads(os.environ[FLEET_ENV])
    if not s.launch:
        return {"urls": list(s.urls), "router": bool(s.router)}
    if len(s.urls) == int(s.num_servers) and not isinstance(s.router, str):
        return {"urls": list(s.urls), "router": False}  # rank 0 launches them there (torchrun starts every rank)
    raise ConfigError("config error: rollout.server.launch=true on a data-parallel rank that did not inherit rank "
                      "0's fleet (torchrun starts every rank at once): give rollout.server.urls, one per server, so "
                      "every rank knows where rank 0 launches them (a managed router needs Lightning's launcher)")


def publish_fleet(engine: Any) -> None:
    """On rank 0: hand the fleet it launched to the ranks Lightning starts after it."""
    import json
    import os

    if data_parallel_rank() == 0 and engine.launchers:
        os.environ[FLEET_ENV] = json.dumps({"urls": list(engine.urls), "router": bool(engine.router)})


def fleet_plan(cfg: Any, kw: dict[str, Any], replay: tuple[bool, bool]) -> tuple[dict[str, Any], list[Any]]:
    """A server engine's constructor arguments and the servers it launches: a client of the fleet another
    data-parallel rank owns (nothing to launch), or this rank's own managed fleet (rollout.server.launch: its
    servers, and the backend's router in front with rollout.server.router=sglang-router|vllm-router)."""
    from glmlight.engines.servers.launch import fleet_launch

    s = cfg.rollout.server
    joined = joined_fleet(cfg)
    if joined is not None:
        return {**kw, "urls": joined["urls"], "router": joined["router"], "owns_fleet": False}, []
    launch = fleet_launch(cfg, kw, replay) if s.launch else []
    if launch and isinstance(s.router, str):
        from glmlight.engines.servers.router import router_launch

        kw = {**kw, "router": True, "router_launch": router_launch(cfg, [spec.url for spec in launch])}
    return kw, launch
