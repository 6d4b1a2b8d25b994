"""The agent gateway's episode lifecycle: coroutine agents share one event loop across episodes and
rollouts (a client made once per process keeps working), a first request over the context budget is
dropped and counted (never a placeholder sample), and an answer the agent never received (its client
went away) is not trained on."""

import asyncio
import logging
import threading
import time

import openai
import pytest

from glmlight.gateway.runner import GatewayOptions
from glmlight.engines.local.engine import LocalEngine
from glmlight.sample import Status
from tests.unit.gateway.test_gateway import Recorder, _check_record, _prompt, _rollout

# ----------------------------------------------------------------- one event loop
_SHARED: dict[str, openai.AsyncOpenAI] = {}  # one client for the process, as the OpenAI Agents SDK keeps


def _shared_client() -> openai.AsyncOpenAI:
    if "client" not in _SHARED:
        _SHARED["client"] = openai.AsyncOpenAI(base_url="http://127.0.0.1:9/v1", api_key="unused", max_retries=0)
    return _SHARED["client"]


async def _shared_client_agent(task):
    """Two turns through the process-wide client (its copies share one httpx.AsyncClient), the second
    beside a concurrent side task, joined with asyncio.gather."""
    client = _shared_client().with_options(base_url=task.openai_base_url, api_key=task.api_key)
    messages = list(task.messages)
    first = await client.chat.completions.create(model="m", messages=messages)
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "again"}]

    async def side():
        await asyncio.sleep(0.01)
        return "side"

    second, _ = await asyncio.gather(client.chat.completions.create(model="m", messages=messages), side())
    return None if second.choices else 0.0


@pytest.mark.parametrize("rollouts", [3])
def test_a_process_wide_async_client_works_across_rollouts(tokenizer, tiny_model, caplog, rollouts):
    """Coroutine agents sharing one AsyncOpenAI client: every episode of every rollout completes (before,
    each episode had an event loop of its own, closed after it: the client's connections, bound to the
    first loop, failed every later episode with `Event loop is closed`)."""
    engine = Recorder(LocalEngine(tiny_model))
    caplog.set_level(logging.WARNING)
    for r in range(rollouts):
        eps, counts = _rollout(tokenizer, engine, _shared_client_agent, [_prompt(), _prompt("4*5=", "20")], n=3)
        failures = [ep.failure for ep in eps if ep.failure is not None]
        assert not failures, f"rollout {r}: {failures}"
        assert all(ep.ep.status is Status.COMPLETED and ep.ep.turns == 2 for ep in eps)
        assert all(_check_record(ep.ep, engine.calls) == 2 for ep in eps)
    assert "never retrieved" not in caplog.text and "Event loop is closed" not in caplog.text


def test_what_a_coroutine_agent_leaves_behind_is_cancelled_with_its_episode(tokenizer, tiny_model):
    """A task the agent starts and never awaits (directly, and one started by that task) is cancelled and
    awaited when the agent returns, before its episode ends; the episode is not failed by it."""
    cancelled = []

    async def forgotten(name):
        try:
            if name == "outer":
                asyncio.get_running_loop().create_task(forgotten("inner"))
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.append(name)
            raise

    async def agent(task):
        asyncio.get_running_loop().create_task(forgotten("outer"))
        client = _shared_client().with_options(base_url=task.openai_base_url, api_key=task.api_key)
        await client.chat.completions.create(model="m", messages=task.messages)

    (ge,), _ = _rollout(tokenizer, LocalEngine(tiny_model), agent, [_prompt()])
    assert ge.failure is None and ge.ep.status is Status.COMPLETED
    assert sorted(cancelled) == ["inner", "outer"]


# ----------------------------------------------------------------- a first request over the context budget
def test_a_first_request_over_max_context_is_dropped_and_counted(tokenizer, tiny_model, caplog):
    """An agent whose first request is longer than rollout.max_context: its episode is dropped and counted
    (dropped/context_exceeded), the agent gets OpenAI's context_length_exceeded error, the log says once
    which setting to raise; the other prompt's episodes train. (Before: a trained sample with prompt
    <eos>, an empty completion, reward 0, status truncated.)"""
    from glmlight.config.rollout import RolloutConfig
    from glmlight.agents.options import AgentOptions
    from glmlight.data.rollout import RolloutDataModule
    from glmlight.data.sources import ListSource

    errors = []

    def agent(task):
        with openai.OpenAI(base_url=task.openai_base_url, api_key=task.api_key, max_retries=0) as c:
            try:
                c.chat.completions.create(model="m", messages=task.messages)
            except openai.BadRequestError as e:
                errors.append(e.body)
                raise

    long = "1+" * 100 + "1="
    source = ListSource([_prompt(long, "101"), _prompt("2*3=", "6")])
    cfg = RolloutConfig(rollout_batch_size=2, n_samples_per_prompt=2, max_new_tokens=4, max_context=64)
    reward = lambda s: float(len(s.metadata["completion_text"]) % 2)  # noqa: E731
    dm = RolloutDataModule(LocalEngine(tiny_model), tokenizer, source, reward, cfg,
                           agent=AgentOptions(gateway=GatewayOptions(agent=agent), max_turns=2))
    caplog.set_level(logging.WARNING)
    exp = dm.next_experience()
    t = dm.totals
    assert t["dropped/context_exceeded"] == 2, dict(t)
    assert t["trained"] == 2 and all(s.num_action_tokens > 0 for s in exp.samples)
    assert not any(s.status is Status.TRUNCATED for s in exp.samples)
    assert len(errors) == 2 and all(e["code"] == "context_length_exceeded" for e in errors), errors
    assert caplog.text.count("raise rollout.max_context") <= 1  # once per process (another test may have said it)


# ----------------------------------------------------------------- a client that goes away
class Scripted:
    """An engine answering "a0", "a1", ... in call order (ids, log-probs -0.5, version 0); `hold` blocks a
    call (by its index) until the event it maps to is set."""

    def __init__(self, tokenizer, hold=None):
        self.tokenizer, self.hold, self.calls, self.lock, self.version = tokenizer, hold or {}, [], threading.Lock(), 0

    def generate(self, prompts, params):
        from glmlight.engines.base import Generation

        out = []
        for ctx in prompts:
            with self.lock:
                k = len(self.calls)
                self.calls.append(None)
            if k in self.hold:
                assert self.hold[k].wait(30), "the test's client never gave up"
                time.sleep(0.5)  # the server notices the closed connection meanwhile
            ids = self.tokenizer(f"a{k}", add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
            g = Generation(ids, [-0.5] * len(ids), "stop", [0] * len(ids))
            self.calls[k] = (list(ctx), g)
            out.append(g)
        return out


def _texts(tokenizer, ep):
    from tests.unit.gateway.test_gateway import _runs

    return [tokenizer.decode(ep.response_ids[a:b], skip_special_tokens=True) for a, b in _runs(ep.loss_mask)]


@pytest.mark.parametrize("then", ["retries", "gives_up"])
def test_a_non_streamed_answer_after_the_client_timed_out_is_not_trained(tokenizer, then):
    """The client times out while its first turn is generated: that answer ("a0") never reaches the agent
    and is withdrawn from the record. An agent that retries continues the record from before it (its
    record: "a1", "a2"); one that gives up leaves an episode without a turn: dropped as client_gone.
    (Before: "a0" stayed in the record, trained with the episode's reward.)"""
    gave_up = threading.Event()
    engine = Scripted(tokenizer, hold={0: gave_up})

    def agent(task):
        messages = list(task.messages)
        with openai.OpenAI(base_url=task.openai_base_url, api_key=task.api_key, max_retries=0, timeout=0.5) as c:
            try:
                c.chat.completions.create(model="m", messages=messages)
                raise AssertionError("the first request should time out")
            except openai.APITimeoutError:
                gave_up.set()
            if then == "gives_up":
                time.sleep(1.0)  # while the turn ends (and is withdrawn): the agent returns after
                return
        with openai.OpenAI(base_url=task.openai_base_url, api_key=task.api_key, max_retries=0) as c:
            first = c.chat.completions.create(model="m", messages=messages).choices[0].message
            messages += [first.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
            c.chat.completions.create(model="m", messages=messages)

    (ge,), counts = _rollout(tokenizer, engine, agent, [_prompt()])
    trained = [_texts(tokenizer, seg) for seg in ge.ep.segments] + [_texts(tokenizer, ge.ep)]
    if then == "retries":
        assert trained == [["a1", "a2"]] and ge.rewrites == 0
        assert ge.failure is None and ge.ep.status is Status.COMPLETED and ge.ep.turns == 2
        assert _check_record(ge.ep, engine.calls) == 2
    else:
        assert ge.ep.status is Status.FAILED and ge.failure[0] == "client_gone" and ge.ep.turns == 0, trained
    assert ge.withdrawn == 1 and counts["gateway_withdrawn_turns"] == 1


def test_a_stream_the_client_dropped_midway_is_not_trained(tokenizer, monkeypatch):
    """The client reads the first event of a streamed answer and closes the connection: the answer ("a0")
    is withdrawn; its non-streamed retry ("a1") is the episode's one turn."""
    from aiohttp import web

    write = web.StreamResponse.write

    async def paced_write(self, data):  # after the first event, wait until the client has gone
        self._glmlight_events = getattr(self, "_glmlight_events", 0) + 1
        if self._glmlight_events == 2:
            for _ in range(500):
                if self._req.transport is None or self._req.transport.is_closing():
                    break
                await asyncio.sleep(0.01)
        return await write(self, data)

    monkeypatch.setattr(web.StreamResponse, "write", paced_write)
    engine = Scripted(tokenizer)
    got = []

    def agent(task):
        with openai.OpenAI(base_url=task.openai_base_url, api_key=task.api_key, max_retries=0) as c:
            with c.chat.completions.create(model="m", messages=task.messages, stream=True) as stream:
                got.append(next(iter(stream)).choices[0].delta.role)
            got.append(c.chat.completions.create(model="m", messages=task.messages).choices[0].message.content)

    (ge,), counts = _rollout(tokenizer, engine, agent, [_prompt()])
    assert got == ["assistant", "a1"]
    trained = [_texts(tokenizer, seg) for seg in ge.ep.segments] + [_texts(tokenizer, ge.ep)]
    assert trained == [["a1"]] and ge.failure is None and ge.ep.turns == 1
    assert _check_record(ge.ep, engine.calls) == 1
    assert ge.withdrawn == 1 and counts["gateway_withdrawn_turns"] == 1
