"""A managed fleet's launch plan: each server's port and share of the machine, the router's command line, and
the config's rules for fleets and routers (the servers themselves: tests/integration/servers/test_fleet.py)."""

import os

import pytest

from glmlight.config.schema import validate
from glmlight.engines.servers.launch import fleet_launch, fleet_targets, placement_env
from glmlight.engines.servers.router import RouterAdmin, router_command
from glmlight.engines.servers.settings import server_settings
from glmlight.errors import ConfigError, EngineError


def test_each_server_gets_its_own_share_of_the_cpu_cores():
    cores = [0, 1, 2, 3]
    assert [placement_env("vllm", "cpu", i, 2, cores, [], None) for i in range(2)] == [
        {"VLLM_CPU_OMP_THREADS_BIND": "0,1"}, {"VLLM_CPU_OMP_THREADS_BIND": "2,3"}]
    assert [placement_env("sglang", "cpu", i, 3, [0, 1], [], None) for i in range(3)] == [
        {"SGLANG_CPU_OMP_THREADS_BIND": "0"}, {"SGLANG_CPU_OMP_THREADS_BIND": "1"},
        {"SGLANG_CPU_OMP_THREADS_BIND": "0"}]  # more servers than cores: they share them in turn
    assert placement_env("vllm", "cpu", 0, 1, cores, [], None) == {}  # one server keeps the whole machine


def test_each_server_gets_its_own_devices():
    devices = ["0", "1", "2", "3", "4", "5", "6", "7"]
    assert [placement_env("sglang", "gpu", i, 2, [], devices, None) for i in range(2)] == [
        {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}]
    assert placement_env("vllm_ascend", "npu", 1, 4, [], devices, 2) == {"ASCEND_RT_VISIBLE_DEVICES": "2,3"}
    with pytest.raises(ConfigError, match="3 servers of 4 device\\(s\\) each need 12 devices; 8 are visible"):
        placement_env("vllm", "gpu", 2, 3, [], devices, 4)


def test_servers_get_distinct_ports_or_the_listed_ones():
    targets = fleet_targets([], 3)
    assert len({port for _, port in targets}) == 3 and {host for host, _ in targets} == {"127.0.0.1"}
    assert fleet_targets(["http://10.0.0.2:30000", "http://10.0.0.3:30001"], 2) == [("10.0.0.2", 30000),
                                                                                      ("10.0.0.3", 30001)]


def _fleet_cfg(tmp_path, **server):
    return validate({"rollout": {"backend": server.pop("backend", "vllm"),
                                 "server": {"launch": True, "launch_python": "/venv/bin/python",
                                            "api_key_env": None, **server}},
                     "model": {"path": str(tmp_path)}, "trainer": {"default_root_dir": str(tmp_path)}})


def test_a_fleet_of_two_vllm_servers_and_its_router(tmp_path):
    from glmlight.engines.servers.router import router_launch

    cfg = _fleet_cfg(tmp_path, num_servers=2, router="vllm-router", launch_env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    specs = fleet_launch(cfg, server_settings(cfg))
    assert len(specs) == 2 and specs[0].port != specs[1].port
    binds = [s.env.get("VLLM_CPU_OMP_THREADS_BIND") for s in specs]
    assert all(binds) and (binds[0] != binds[1] or len(os.sched_getaffinity(0)) == 1)  # the cores split between them
    assert all(s.env["VLLM_CPU_KVCACHE_SPACE"] == "1" for s in specs)
    router = router_launch(cfg, [s.url for s in specs])
    assert router.command[:1] == ["/venv/bin/vllm-router"]
    assert router.command[router.command.index("--worker-urls") + 1:][:2] == [s.url for s in specs]
    assert router.command[-2:] == ["--policy", "cache_aware"]
    assert router_command("sglang-router", "/sg/bin/python", "127.0.0.1", 9, ["http://w"], ["--policy", "round_robin"]) == [
        "/sg/bin/python", "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", "9", "--worker-urls",
        "http://w", "--policy", "round_robin"]


@pytest.mark.parametrize("server, message", [
    ({"router": "vllm-router", "launch": False, "urls": ["http://a"]},
     "config error: rollout.server.router=vllm-router is started in front of the servers glmlight launches: set "
     "rollout.server.launch=true"),
    ({"router": "sglang-router"}, "config error: rollout.server.router=sglang-router routes sglang servers; this "
                                  "run's rollout.backend is vllm"),
    ({"router": "nginx"}, "config error: rollout.server.router='nginx' is not one of"),
    ({"num_servers": 2, "launch": False, "urls": ["http://a"]},
     "config error: rollout.server.num_servers=2 starts a fleet of managed servers: set rollout.server.launch=true"),
    ({"num_servers": 3, "urls": ["http://a:1", "http://b:2"]},
     "config error: rollout.server.urls lists 2 addresses for 3 managed server(s)"),
    ({"num_servers": 0}, "config error: rollout.server.num_servers"),
])
def test_fleet_and_router_settings_that_cannot_work_are_one_line(tmp_path, server, message):
    with pytest.raises(ConfigError) as err:
        _fleet_cfg(tmp_path, **server)
    assert str(err.value).startswith(message)


def test_the_router_admin_names_an_unknown_router_and_an_unreachable_one():
    with pytest.raises(EngineError, match="unknown router 'nginx'"):
        RouterAdmin("nginx", "http://127.0.0.1:1")
    with pytest.raises(EngineError, match="vllm-router at http://127.0.0.1:1: GET /list_workers failed"):
        RouterAdmin("vllm-router", "http://127.0.0.1:1", timeout_s=1).workers()
