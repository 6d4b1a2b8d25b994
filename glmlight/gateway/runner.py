"""`task=gateway_agent`: the rollout runs the user's own agent program once per episode.

Each episode gets a `GatewayEpisode` (its key and base URL on a gateway server started for this
rollout) and an agent: a Python callable `agent(task: AgentTask)`, run in a thread of its own
(a coroutine function as a task on the process's one agent event loop, glmlight.gateway.event_loop,
so that the clients a framework keeps for the whole process work in every episode), or a command,
run as a process of its own (in a session of its own, so that a kill takes its children too) with
the episode's URLs, key and prompt in its environment (`AgentTask.environ`). The agent runs
unchanged against the episode's URL; the gateway records the exact tokens.

An agent has `timeout_s` seconds of its own time: the time its requests wait for the engine does
not count (a paused or busy engine never times an agent out). Past it, a process is killed, a
coroutine cancelled (with the tasks it started) and a thread left behind (its episode is
closed: its next request is refused). The episode then fails: `agent_timeout`; a callable that
raises or a command that exits non-zero: `agent_crashed`; an agent that asked nothing:
`agent_no_requests`; one that received none of its answers: `client_gone` (and the gateway's own:
`bad_request`, `context_exceeded`, `engine_failed`, `aborted`). Failed episodes are counted and
never trained on; the others of the rollout are not touched.

The reward: `reward: task` scores the episode's last segment with the task's reward
(`metadata["completion_text"]` is the text of the last turn the gateway answered,
`metadata["gateway_tool_calls"]` every tool call it answered with, `[{name, arguments}]`);
`reward: agent` takes the reward the agent reported (POST /reward, or what the callable returns:
a number or `{"reward": x, "info": {...}}`), and fails the episode (`no_reward`) without one.

With `client_sampling`, the turns a request drew with its own temperature / top_p / top_k are listed in
each segment's `metadata["sampling"]` (glmlight.sample, SAMPLING_KEY; `score_episodes` adds them): the
trainer scores those tokens at the settings they were drawn with, so the log-probs it compares with the
engine's are of the same distribution (docs/agents.md).
"""

from __future__ import annotations

import concurrent.futures
import importlib
import importlib.util
import inspect
import json
import logging
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any, Callable

from glmlight.gateway.episode import GatewayEpisode
from glmlight.gateway.event_loop import AGENT_LOOP
from glmlight.gateway.server import GatewayServer
from glmlight.gateway.template import TurnCodec
from glmlight.gateway.tool_format import tool_format
from glmlight.models.tokenizer import stop_token_ids
from glmlight.prompt import Prompt
from glmlight.rewards.base import score_samples
from glmlight.engines.base import RolloutEngine, SamplingParams
from glmlight.sample import SAMPLING_KEY, Sample, Status

log = logging.getLogger(__name__)


@dataclass
class AgentTask:
    """What the agent of one episode is given: its own base URL and key, and the prompt's messages."""

    base_url: str  # http://127.0.0.1:<port>/e/<key>
    api_key: str
    messages: list[dict[str, Any]]

    @property
    def openai_base_url(self) -> str:
        """`openai.OpenAI(base_url=...)`: the client adds /chat/completions."""
        return self.base_url + "/v1"

    @property
    def anthropic_base_url(self) -> str:
        """`anthropic.Anthropic(base_url=...)`: the client adds /v1/messages."""
        return self.base_url

    def environ(self) -> dict[str, str]:
        """The environment of a command agent (what the official clients read, and the prompt)."""
        return {"GLMLIGHT_BASE_URL": self.base_url, "GLMLIGHT_API_KEY": self.api_key,
                "GLMLIGHT_PROMPT": json.dumps(self.messages), "OPENAI_BASE_URL": self.openai_base_url,
                "OPENAI_API_KEY": self.api_key, "ANTHROPIC_BASE_URL": self.anthropic_base_url,
                "ANTHROPIC_API_KEY": self.api_key}


@dataclass
class GatewayOptions:
    """How the agent runs (task.agent.gateway, glmlight.config.rollout.GatewayConfig)."""

    agent: Callable[[AgentTask], Any] | None = None
    command: list[str] | None = None
    timeout_s: float = 300.0
    max_concurrent: int = 128
    reward: str = "task"  # task | agent
    tool_format: str = "auto"
    client_sampling: bool = False
    host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if (self.agent is None) == (self.command is None):
            raise ValueError("a gateway agent is a callable or a command, exactly one of them")
        if self.reward not in ("task", "agent"):
            raise ValueError(f"gateway reward must be 'task' or 'agent', got {self.reward!r}")


def load_agent(spec: str) -> Callable[[AgentTask], Any]:
    """The callable `spec` names: "pkg.module:function", or "path/to/file.py:function" (a relative path from
    the current directory, else from the project's root)."""
    from glmlight.errors import ConfigError

    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ConfigError(f"config error: task.agent.gateway.agent={spec!r}: expected 'pkg.module:function' or "
                          "'path/to/file.py:function'")
    try:
        if where.endswith(".py"):
            root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            path = where if os.path.isabs(where) or os.path.exists(where) else os.path.join(root, where)
            module_name = "glmlight_agent_" + os.path.splitext(os.path.basename(path))[0]
            loader = importlib.util.spec_from_file_location(module_name, path)
            if loader is None or not os.path.isfile(path):
                raise FileNotFoundError(f"no file {where}")
            module = importlib.util.module_from_spec(loader)
            sys.modules[module_name] = module
            loader.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
        fn = getattr(module, name)
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"config error: task.agent.gateway.agent={spec!r}: {type(e).__name__}: {e}") from None
    if not callable(fn):
        raise ConfigError(f"config error: task.agent.gateway.agent={spec!r} is not callable")
    return fn


# ----------------------------------------------------------------- one running agent
class _AgentRun:
    def __init__(self, ep: GatewayEpisode, task: AgentTask, wake: threading.Event):
        self.ep, self.task, self.wake = ep, task, wake
        self.done = False
        self.failure: tuple[str, str] | None = None

    def _finished(self, failure: tuple[str, str] | None = None) -> None:
        self.failure, self.done = failure, True
        self.wake.set()


class _ThreadRun(_AgentRun):
    """A callable agent: a plain function in a thread of its own; a coroutine function as a task on the
    process's one agent loop (`AgentEventLoop`)."""

    def start(self, agent: Callable[[AgentTask], Any]) -> None:
        self._future: concurrent.futures.Future | None = None
        if inspect.iscoroutinefunction(agent) or inspect.iscoroutinefunction(getattr(agent, "__call__", None)):
            self._future = AGENT_LOOP.submit(agent(self.task), self.ep.id)
            self._future.add_done_callback(self._coroutine_done)
            return
        threading.Thread(target=self._main, args=(agent,), name=f"glmlight-agent-{self.ep.id}", daemon=True).start()

    def _main(self, agent: Callable[[AgentTask], Any]) -> None:
        try:
            out = agent(self.task)
            self._finished(_take_result(self.ep, out))
        except BaseException as e:  # noqa: BLE001 - the agent's failure is its episode's
            self._finished(("agent_crashed", f"{type(e).__name__}: {e}"))

    def _coroutine_done(self, future: concurrent.futures.Future) -> None:
        if future.cancelled():
            self._finished(("agent_crashed", "the agent's coroutine was cancelled"))
        elif future.exception() is not None:
            e = future.exception()
            self._finished(("agent_crashed", f"{type(e).__name__}: {e}"))
        else:
            self._finished(_take_result(self.ep, future.result()))

    def kill(self) -> None:
        if self._future is not None:
            self._future.cancel()


class _ProcessRun(_AgentRun):
    def start(self, command: list[str]) -> None:
        self._out = tempfile.TemporaryFile()
        env = {**os.environ, **self.task.environ()}
        env["NO_PROXY"] = ",".join(x for x in (env.get("NO_PROXY"), "127.0.0.1", "localhost") if x)
        try:
            self._proc = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=self._out,
                                          stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as e:
            self._proc = None
            self._finished(("agent_crashed", f"cannot start {command[0]!r}: {e}"))
            return
        threading.Thread(target=self._wait, name=f"glmlight-agent-{self.ep.id}", daemon=True).start()

    def _wait(self) -> None:
        code = self._proc.wait()
        self._finished(None if code == 0 else ("agent_crashed", f"exit status {code}: {self.output_tail()}"))

    def output_tail(self, n: int = 400) -> str:
        self._out.seek(0, os.SEEK_END)
        size = self._out.tell()
        self._out.seek(max(size - n, 0))
        return self._out.read().decode(errors="replace").strip().replace("\n", " | ")

    def kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _take_result(ep: GatewayEpisode, out: Any) -> tuple[str, str] | None:
    """A callable's return value: None, a reward, or {"reward": x, "info": {...}}; anything else fails."""
    if out is None:
        return None
    reward, info = (out.get("reward"), out.get("info", {})) if isinstance(out, dict) else (out, {})
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward) \
            or not isinstance(info, dict):
        return ("bad_reward", f"the agent returned {out!r}; expected None, a finite number or "
                              "{'reward': <number>, 'info': {...}}")
    try:
        ep.report(float(reward), info)
    except Exception as e:  # noqa: BLE001 - the episode was closed meanwhile
        return ("bad_reward", str(e))
    return None


# ----------------------------------------------------------------- the rollout
class GatewayRollout:
    """Runs `n` agent episodes per prompt against a gateway server started for the call."""

    def __init__(self, engine: RolloutEngine, tokenizer: Any, options: GatewayOptions,
                 params: Callable[[int], SamplingParams], max_turns: int, max_context: int, counts: Counter):
        self.engine, self.tokenizer, self.options, self.params = engine, tokenizer, options, params
        self.max_turns, self.max_context, self.counts = max_turns, max_context, counts
        fmt = tool_format(options.tool_format, getattr(tokenizer, "chat_template", None))
        self.codec = TurnCodec(tokenizer, fmt, stop_token_ids(tokenizer))

    def run(self, prompts: list[Prompt], n: int = 1) -> list[GatewayEpisode]:
        eps = [GatewayEpisode(i, p, self.codec, self.engine, self.params, self.max_turns, self.max_context,
                              self.counts, self.options.client_sampling)
               for i, p in enumerate(p for p in prompts for _ in range(n))]
        with GatewayServer(self.options.host, 0, workers=min(self.options.max_concurrent, 256)) as server:
            self._run_agents(server, eps)
        self.counts["gateway_requests"] += sum(ep.requests for ep in eps)
        return eps

    def _run_agents(self, server: GatewayServer, eps: list[GatewayEpisode]) -> None:
        todo, running, wake = deque(eps), [], threading.Event()
        o = self.options
        while todo or running:
            while todo and len(running) < o.max_concurrent:
                ep = todo.popleft()
                task = AgentTask(server.add(ep), ep.key, [dict(m) for m in ep.ep.prompt.messages])
                run = _ThreadRun(ep, task, wake) if o.agent is not None else _ProcessRun(ep, task, wake)
                ep.start_clock()
                run.start(o.agent if o.agent is not None else o.command)
                running.append(run)
            for run in list(running):
                if run.done:
                    run.ep.finish(run.failure)
                elif run.ep.agent_seconds() > o.timeout_s:
                    run.kill()
                    run.ep.finish(("agent_timeout", f"the agent ran past its {o.timeout_s:g}s of own time "
                                                    "(time waiting for the engine not counted)"))
                else:
                    continue
                running.remove(run)
            wake.wait(0.1)
            wake.clear()


def score_episodes(episodes: list[GatewayEpisode], trajectories: list[list[Sample]], reward_fn: Any, source: str,
                   counts: Counter) -> None:
    """Give each episode's samples its reward (module docstring); fail those without one. Each segment
    also gets the turns drawn at a request's own sampling (metadata["sampling"], module docstring)."""
    todo = []
    for ge, segs in zip(episodes, trajectories):
        for s, ranges in zip(segs, ge.sampling):
            if ranges:
                s.metadata[SAMPLING_KEY] = [list(r) for r in ranges]
        calls = [{"name": c.name, "arguments": c.arguments} for c in ge.calls]
        for s in segs:
            s.metadata.update(completion_text=ge.final_text, gateway_tool_calls=calls)
            if ge.failure is not None:
                s.metadata["failure"] = ge.failure[0]
        if segs[-1].status is Status.FAILED:
            continue
        if source == "agent":
            if ge.reported is None:
                _fail(segs, "no_reward", "the agent reported no reward (task.agent.gateway.reward=agent)")
                continue
            for s in segs:
                s.reward = ge.reported["reward"]
                s.metadata["reward_info"] = dict(ge.reported["info"])
        else:
            todo.append(segs)
    if todo:
        scored = score_samples(reward_fn, [segs[-1] for segs in todo])
        counts["reward_failed"] += scored["failed"]
        counts["reward_timeout"] += scored["timeout"]
        for segs in todo:
            last = segs[-1]
            for s in segs[:-1]:
                s.reward, s.status = last.reward, last.status
                s.metadata.update({k: last.metadata[k] for k in ("reward_info", "reward_error", "reward_timeout")
                                   if k in last.metadata})
    for segs in trajectories:  # numeric reward details are logged as the environment's info is
        for k, v in segs[-1].metadata.get("reward_info", {}).items():
            if isinstance(v, (bool, int, float)):
                for s in segs:
                    s.metadata[f"env/{k}"] = v


def _fail(segs: list[Sample], reason: str, message: str) -> None:
    log.warning("gateway episode failed (%s): %s", reason, message)
    for s in segs:
        s.status, s.reward = Status.FAILED, None
        s.metadata["failure"], s.metadata["env_error"] = reason, f"{reason}: {message}"
