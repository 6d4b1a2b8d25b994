"""The agent gateway, driven by the official `openai` and `anthropic` clients: multi-turn episodes with
tools, streaming, exact token capture, rewritten histories, concurrent episodes, agents that crash, hang
or send malformed requests, weight updates while requests are served, and task=gateway_agent training."""

import asyncio
import functools
import sys
import threading
from collections import Counter

import anthropic
import openai
import pytest
import torch

import glmlight
from glmlight import compose
from glmlight.agents import AgentLoop, encode_observation, generation_prompt
from glmlight.agents.envs import CalculatorEnv
from glmlight.agents.expert import ExpertEngine
from glmlight.config.rollout import RolloutConfig
from glmlight.agents.options import AgentOptions
from glmlight.data.rollout import RolloutDataModule
from glmlight.data.sources import ArithmeticTask, ListSource
from glmlight.prompt import Prompt
from glmlight.gateway.runner import GatewayOptions, GatewayRollout, load_agent
from glmlight.models.tokenizer import encode_chat
from glmlight.engines.base import SamplingParams
from glmlight.engines.local.engine import LocalEngine
from glmlight.sample import Status
from tests.conftest import overrides_for_tests
from tests.support.waiting import wait_event, wait_until

@functools.lru_cache(maxsize=None)
def _example_module(name):
    """examples/<name>.py as a module (the examples are scripts, not a package)."""
    return sys.modules[load_agent(f"examples/{name}.py:run").__module__]


def _example(name, attr):
    return getattr(_example_module(name), attr)


class Recorder:
    """An engine that records every (context, generation) the gateway asked for."""

    def __init__(self, engine):
        self.engine, self.calls, self.lock = engine, [], threading.Lock()

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, prompts, params):
        with self.lock:
            self.pending = len(self.calls) + 1
        gens = self.engine.generate(prompts, params)
        with self.lock:
            self.calls += [(list(p), g) for p, g in zip(prompts, gens)]
        return gens


def _greedy(ctx_len, stop=(1,)):
    return SamplingParams(temperature=0.0, max_new_tokens=6, stop_token_ids=list(stop))


def _rollout(tokenizer, engine, agent, prompts, n=1, params=_greedy, max_turns=4, max_context=256, **options):
    counts = Counter()
    opts = GatewayOptions(agent=agent, **options) if not isinstance(agent, list) else GatewayOptions(command=agent,
                                                                                                   **options)
    eps = GatewayRollout(engine, tokenizer, opts, params, max_turns, max_context, counts).run(prompts, n)
    return eps, counts


def _prompt(text="2*3=", label="6"):
    return Prompt(messages=[{"role": "user", "content": text}], label=label)


def _runs(mask):
    """(start, end) of each run of loss-mask 1 (one action turn each: observations always separate them)."""
    runs, start = [], None
    for i, m in enumerate(list(mask) + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def _actions(ep):
    """The episode's action turns as (ids, log-probs, versions), in order."""
    return [(ep.response_ids[a:b], ep.logprobs[a:b], ep.versions[a:b]) for a, b in _runs(ep.loss_mask)]


def _check_record(ep, calls):
    """Every action of `ep` (an Episode or a Sample) is an engine answer, as produced (ids, log-probs,
    versions), to exactly the context before it; every other token is masked, log-prob 0, version -1.
    Returns the number of actions."""
    logprobs = ep.rollout_logprobs if hasattr(ep, "rollout_logprobs") else ep.logprobs
    by_ctx = {}
    for ctx, g in calls:
        by_ctx.setdefault(tuple(ctx), []).append(g)
    for a, b in _runs(ep.loss_mask):
        gens = by_ctx.get(tuple(ep.prompt_ids + ep.response_ids[:a]), [])
        assert any(g.token_ids == ep.response_ids[a:b] and g.logprobs == logprobs[a:b]
                   and g.versions == ep.versions[a:b] for g in gens), "an action is not an engine answer"
    assert all(lp == 0.0 and v == -1 for lp, v, m in zip(logprobs, ep.versions, ep.loss_mask) if m == 0)
    return len(_runs(ep.loss_mask))


# ----------------------------------------------------------------- exact tokens, real engine
def _echo_agent(turns, stream=False, seen=None):
    """Asks `turns` times, sending back each answer as the client returned it and then a tool result for
    each call, or a user message when there is none."""
    tools = _example("calculator_openai_agent", "TOOLS")

    def agent(task):
        with openai.OpenAI(base_url=task.openai_base_url, api_key=task.api_key, max_retries=0) as client:
            messages = list(task.messages)
            for t in range(turns):
                if stream:
                    message = _example("calculator_openai_agent", "_streamed")(client, "m", messages)
                else:
                    message = client.chat.completions.create(model="m", messages=messages, tools=tools).choices[0].message
                if seen is not None:
                    seen.append(message)
                messages.append(message.model_dump(exclude_none=True))
                if message.tool_calls:
                    messages += [{"role": "tool", "tool_call_id": c.id, "content": "= 1"} for c in message.tool_calls]
                else:
                    messages.append({"role": "user", "content": f"more {t}"})
    return agent


@pytest.mark.parametrize("stream", [False, True])
def test_openai_turns_are_the_engines_ids_exactly(tokenizer, tiny_model, stream):
    """Three turns through the openai client: the record is the prompt's encoding, then each turn's engine
    ids as produced (log-probs, versions), then only the new message's ids and the assistant opening;
    nothing is re-encoded. The same as the environment loop's splicing of the same turns."""
    engine = Recorder(LocalEngine(tiny_model))
    seen = []
    (ge,), counts = _rollout(tokenizer, engine, _echo_agent(3, stream, seen), [_prompt()])
    ep = ge.ep
    assert ep.status is Status.COMPLETED and ep.turns == 3 and counts["gateway_requests"] == 3
    assert ep.prompt_ids == encode_chat(tokenizer, [{"role": "user", "content": "2*3="}])
    assert len(engine.calls) == 3 and _check_record(ep, engine.calls) == 3
    assert ep.context == engine.calls[-1][0] + engine.calls[-1][1].token_ids
    # each turn continues the previous turn's exact context
    for (ctx, g), (nxt, _) in zip(engine.calls, engine.calls[1:]):
        assert nxt[: len(ctx) + len(g.token_ids)] == ctx + g.token_ids
    # what the agent was told is the decoded action (the raw ids stay the action)
    for m, (ctx, g) in zip(seen, engine.calls):
        if not m.tool_calls:
            assert m.content == tokenizer.decode(g.token_ids, skip_special_tokens=True)
    # the spliced turns are the environment loop's encoding of the same messages; a turn cut short (by
    # max_tokens) is closed with the template's end of turn first
    if not any(m.tool_calls for m in seen):
        expected = list(ep.prompt_ids)
        for t, (_, g) in enumerate(engine.calls):
            expected += g.token_ids
            if t < 2:
                expected += [] if g.token_ids[-1] == tokenizer.eos_token_id else [tokenizer.eos_token_id]
                expected += encode_observation(tokenizer, f"more {t}", role="user") + generation_prompt(tokenizer)
        assert ep.context == expected


@pytest.mark.parametrize("client", ["openai", "openai_stream", "anthropic"])
def test_tool_calls_round_trip_and_match_the_environment_loop(tokenizer, client):
    """The example calculator agents (official clients; tools executed in the agent) against a policy that
    calls `calc` then answers: the agent sees a structured call, the tool's result goes back as the
    template's observation turn, and the episode is token for token the calculator environment's episode
    of the same policy."""
    env = CalculatorEnv(system_prompt=None, expert_calc_rate=1.0)
    prompts = [_prompt("37*58=", "2146"), _prompt("12*11=", "132")]
    if client == "anthropic":
        agent = load_agent("examples/calculator_anthropic_agent.py:run")
    else:
        solve = _example("calculator_openai_agent", "solve")

        def agent(task):
            with openai.OpenAI(base_url=task.openai_base_url, api_key=task.api_key, max_retries=0) as c:
                return {"reward": 0.0, "info": {"answer": solve(c, task.messages, stream=client == "openai_stream")}}

    eps, counts = _rollout(tokenizer, ExpertEngine(tokenizer, env.expert), agent, prompts, params=lambda n: SamplingParams(
        max_new_tokens=16, stop_token_ids=[tokenizer.eos_token_id]))
    loop = AgentLoop(ExpertEngine(tokenizer, env.expert), tokenizer, lambda: CalculatorEnv(system_prompt=None),
                     lambda n: SamplingParams(max_new_tokens=16, stop_token_ids=[tokenizer.eos_token_id]), max_turns=3)
    reference = loop.run(prompts)
    for ge, ref, p in zip(eps, reference, prompts):
        assert ge.ep.status is Status.COMPLETED and ref.reward == 1.0
        assert ge.ep.prompt_ids == ref.prompt_ids and ge.ep.response_ids == ref.response_ids
        assert ge.ep.loss_mask == ref.loss_mask
        assert [(c.name, c.arguments) for c in ge.calls] == [("calc", {"expr": p.messages[0]["content"][:-1]})]
        assert ge.final_text == f"answer: {p.label}"
        if client != "anthropic":
            assert ge.reported == {"reward": 0.0, "info": {"answer": f"answer: {p.label}"}}
    assert counts["gateway_requests"] == 4


def test_client_echo_variants_extend_the_episode(tokenizer):
    """Clients send an answer back in other shapes (content null beside tool calls, arguments re-serialised,
    whitespace stripped, the assistant message rebuilt by hand): still the same turn, no new segment."""
    env = CalculatorEnv(system_prompt=None, expert_calc_rate=1.0)

    def agent(task):
        with openai.OpenAI(base_url=task.openai_base_url, api_key=task.api_key, max_retries=0) as c:
            msgs = list(task.messages)
            m = c.chat.completions.create(model="m", messages=msgs, tools=_example("calculator_openai_agent", "TOOLS"))
            call = m.choices[0].message.tool_calls[0]
            msgs.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": call.id, "type": "function",
                 "function": {"name": "calc", "arguments": '{ "expr" : "%s" }' % "37*58"}}]})
            msgs.append({"role": "tool", "tool_call_id": call.id, "content": "= 2146"})
            c.chat.completions.create(model="m", messages=msgs, tools=_example("calculator_openai_agent", "TOOLS"))

    (ge,), counts = _rollout(tokenizer, ExpertEngine(tokenizer, env.expert), agent, [_prompt("37*58=", "2146")],
                             params=lambda n: SamplingParams(max_new_tokens=16, stop_token_ids=[1]))
    assert ge.ep.status is Status.COMPLETED and ge.rewrites == 0 and not ge.ep.segments and ge.ep.turns == 2
    assert ge.final_text == "answer: 2146"


def test_stop_strings_end_the_answer_where_a_server_would(tokenizer):
    """`stop` / `stop_sequences`: the answer ends at the token that completes the string (the action: the
    ids up to it, as sampled); the text returned leaves the string out."""
    env = CalculatorEnv(system_prompt=None, expert_calc_rate=1.0)
    got = {}

    def agent(task):
        with openai.OpenAI(base_url=task.openai_base_url, api_key=task.api_key, max_retries=0) as c:
            r = c.chat.completions.create(model="m", messages=task.messages, stop=["*"])
            got["openai"] = (r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens)
        with anthropic.Anthropic(base_url=task.anthropic_base_url, api_key=task.api_key, max_retries=0) as c:
            r = c.messages.create(model="m", max_tokens=16, messages=task.messages, stop_sequences=["*"])
            got["anthropic"] = (r.content[0].text, r.stop_reason, r.stop_sequence)

    (ge,), _ = _rollout(tokenizer, ExpertEngine(tokenizer, env.expert), agent, [_prompt("37*58=", "2146")],
                        params=lambda n: SamplingParams(max_new_tokens=16, stop_token_ids=[1]))
    assert got["openai"] == ("calc: 37", "stop", 9) and got["anthropic"] == ("calc: 37", "stop_sequence", "*")
    ids = tokenizer("calc: 37*", add_special_tokens=False)["input_ids"]
    (first,) = ge.ep.segments  # the second request sent the same messages again: a new segment
    assert first.response_ids == ids and first.loss_mask == [1] * 9 and len(first.logprobs) == 9
    assert ge.ep.response_ids == ids


# ----------------------------------------------------------------- rewritten history
def test_rewritten_history_opens_a_new_segment(tokenizer, tiny_model):
    """Turn 3 drops the earlier turns (a summary in their place): the first two turns stay one segment, as
    produced; the episode goes on as a new segment whose prompt is the new messages' encoding; it is
    counted. As samples: one per segment, one rollout id, one reward."""
    engine = Recorder(LocalEngine(tiny_model))

    def agent(task):
        with openai.OpenAI(base_url=task.openai_base_url, api_key=task.api_key, max_retries=0) as c:
            msgs = list(task.messages)
            for t in range(2):
                m = c.chat.completions.create(model="m", messages=msgs).choices[0].message
                msgs += [{"role": "assistant", "content": m.content}, {"role": "user", "content": f"and {t}"}]
            c.chat.completions.create(model="m", messages=[{"role": "user", "content": "summary: 6. go on"}])
            return 1.0

    (ge,), counts = _rollout(tokenizer, engine, agent, [_prompt()], reward="agent")
    ep = ge.ep
    assert ep.status is Status.COMPLETED and ep.turns == 3 and ge.rewrites == 1 and counts["gateway_rewrites"] == 1
    assert len(ep.segments) == 1
    first = ep.segments[0]
    assert first.prompt_ids == encode_chat(tokenizer, [{"role": "user", "content": "2*3="}])
    assert first.prompt_ids + first.response_ids == engine.calls[1][0] + engine.calls[1][1].token_ids
    assert ep.prompt_ids == encode_chat(tokenizer, [{"role": "user", "content": "summary: 6. go on"}])
    assert ep.response_ids == engine.calls[2][1].token_ids and set(ep.loss_mask) == {1}

    from glmlight.agents.loop import episode_to_samples
    from glmlight.gateway.runner import score_episodes
    samples = episode_to_samples(ep, group_id=0, rollout_id=7)
    score_episodes([ge], [samples], None, "agent", Counter())
    assert [s.segment for s in samples] == [0, 1] and {s.rollout_id for s in samples} == {7}
    assert [s.reward for s in samples] == [1.0, 1.0] and samples[0].metadata["num_segments"] == 2


@pytest.mark.parametrize("rewrite", ["edited_answer", "dropped_tool_result", "other_tools"])
def test_histories_that_do_not_extend_open_a_segment(tokenizer, rewrite):
    """An edited assistant turn, a dropped message: a new segment (the template renders no tools, so other
    tools alone do not change the context and the episode goes on)."""
    env = CalculatorEnv(system_prompt=None, expert_calc_rate=1.0)
    tools = _example("calculator_openai_agent", "TOOLS")

    def agent(task):
        with openai.OpenAI(base_url=task.openai_base_url, api_key=task.api_key, max_retries=0) as c:
            msgs = list(task.messages)
            m = c.chat.completions.create(model="m", messages=msgs, tools=tools).choices[0].message
            echoed = m.model_dump(exclude_none=True)
            if rewrite == "edited_answer":
                echoed["tool_calls"][0]["function"]["arguments"] = '{"expr": "1+1"}'
            msgs.append(echoed)
            if rewrite != "dropped_tool_result":
                msgs.append({"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "= 2146"})
            else:
                msgs.append({"role": "user", "content": "again"})
                del msgs[-2]
            c.chat.completions.create(model="m", messages=msgs, tools=tools[:1] if rewrite == "other_tools" else tools)

    (ge,), _ = _rollout(tokenizer, ExpertEngine(tokenizer, env.expert), agent, [_prompt("37*58=", "2146")],
                        params=lambda n: SamplingParams(max_new_tokens=16, stop_token_ids=[1]))
    assert ge.ep.status is Status.COMPLETED and ge.ep.turns == 2
    assert ge.rewrites == (0 if rewrite == "other_tools" else 1)


# ----------------------------------------------------------------- concurrency
def test_concurrent_episodes_through_the_data_module(tokenizer, tiny_model):
    """6 prompts x 4 episodes at once, sampled, through RolloutDataModule: every episode's record holds
    only its own engine answers, the engine batched requests of different episodes, every sample is
    trained or counted."""
    engine = Recorder(LocalEngine(tiny_model))
    cfg = RolloutConfig(rollout_batch_size=6, n_samples_per_prompt=4, max_new_tokens=5, max_context=256)
    reward = lambda s: float(len(s.metadata["completion_text"]) % 3)  # noqa: E731 - differs within groups
    dm = RolloutDataModule(engine, tokenizer, ArithmeticTask(seed=0), reward, cfg,
                           agent=AgentOptions(gateway=GatewayOptions(agent=_echo_agent(2)), max_turns=4))
    exp = dm.next_experience()
    # a turn whose ids hold special tokens the agent never saw (the tiny model samples e.g. `<pad>` mid-turn) is
    # rendered otherwise by the chat template: its episode goes on in a new segment, a sample of its own
    produced = dm.totals["produced"]
    assert produced >= 24 and dm.totals["trained"] + sum(
        v for k, v in dm.totals.items() if k.startswith("dropped/")) == produced
    assert all(s.metadata["turns"] == 2 for s in exp.samples)
    actions = Counter()
    for s in exp.samples:
        assert s.status is Status.COMPLETED
        actions[s.rollout_id, s.metadata["num_segments"]] += _check_record(s, engine.calls)
        if s.segment == 0:
            question = dm.source[s.metadata["prompt_index"]].messages[-1]["content"]
            assert tokenizer.decode(s.prompt_ids, skip_special_tokens=True) == question
    assert all(n == 2 for (_, segments), n in actions.items() if segments == 1)
    assert engine.stats()["max_batch"] > 1


# ----------------------------------------------------------------- failures
def _failing_agents(release):
    """Agent behaviour by the prompt's text."""
    tools = _example("calculator_openai_agent", "TOOLS")
    errors = {}

    def agent(task):
        kind = task.messages[0]["content"]
        with openai.OpenAI(base_url=task.openai_base_url, api_key=task.api_key, max_retries=0) as c:
            msgs = list(task.messages)
            c.chat.completions.create(model="m", messages=msgs, tools=tools)
            if kind == "crash":
                raise RuntimeError("the agent's own bug")
            if kind == "hang":
                release.wait()
                c.chat.completions.create(model="m", messages=msgs + [{"role": "user", "content": "late"}])
                return
            bad = {"malformed": dict(messages=[{"role": "wizard", "content": "x"}]),
                   "n2": dict(messages=msgs, n=2), "logprobs": dict(messages=msgs, logprobs=True),
                   "forced": dict(messages=msgs, tools=tools,
                                  tool_choice={"type": "function", "function": {"name": "nope"}})}.get(kind)
            if bad is not None:
                try:
                    c.chat.completions.create(model="m", **bad)
                except openai.BadRequestError as e:
                    got = errors.setdefault(kind, {}).setdefault(task.api_key, [(e.status_code, e.body)])
                    try:  # the episode has failed: a later request is refused too
                        c.chat.completions.create(model="m", messages=msgs)
                    except openai.BadRequestError as e2:
                        got.append((e2.status_code, e2.body))
                    raise
    return agent, errors


def test_failed_agents_are_counted_and_nothing_else_is_lost(tokenizer, tiny_model):
    """Per prompt, 4 episodes of one kind: agents that crash, send a malformed or unsupported request, or
    hang (past task.agent.gateway.timeout_s of their own time; the working agents' own time is far below
    it: one request each), beside agents that work. Each bad agent
    gets one clear error in the OpenAI error form; its episode fails and is counted under
    rollout/dropped/<reason>; the good episodes are trained on, untouched."""
    release = threading.Event()
    agent, errors = _failing_agents(release)
    kinds = ["ok", "crash", "malformed", "n2", "logprobs", "forced", "hang"]
    source = ListSource([Prompt(messages=[{"role": "user", "content": k}], label="0") for k in kinds])
    cfg = RolloutConfig(rollout_batch_size=len(kinds), n_samples_per_prompt=2, max_new_tokens=4, max_context=256)
    dm = RolloutDataModule(LocalEngine(tiny_model), tokenizer, source, lambda s: float(len(s.response_ids) % 2), cfg,
                           agent=AgentOptions(gateway=GatewayOptions(agent=agent, timeout_s=10.0), max_turns=4))
    try:
        exp = dm.next_experience()
    finally:
        release.set()
    t = dm.totals
    assert t["produced"] == 14 and t["trained"] == 2
    assert t["dropped/agent_crashed"] == 2 and t["dropped/agent_timeout"] == 2
    assert t["dropped/bad_request"] == 8
    assert all(s.status is Status.COMPLETED and s.metadata["turns"] == 1 for s in exp.samples)
    for kind, needle in [("malformed", "role must be one of"), ("n2", "n=2 is not supported"),
                         ("logprobs", "logprobs are not returned"),
                         ("forced", "tool_choice names the function 'nope'")]:
        assert len(errors[kind]) == 2  # both episodes of the prompt
        for (status, body), (later, later_body) in errors[kind].values():
            assert status == 400 and needle in body["message"] and body["type"] == "invalid_request_error", body
            assert later == 400 and "this episode has failed (bad_request" in later_body["message"]
    dropped = {s.metadata["drop_reason"] for s in dm.last_dropped}
    assert dropped == {"agent_crashed", "agent_timeout", "bad_request"}


def test_anthropic_errors_are_in_its_wire_form(tokenizer, tiny_model):
    """A content block the gateway cannot serve (an image) gets Anthropic's error form; an unknown key
    a 401 of its own."""
    got = {}

    def agent(task):
        with anthropic.Anthropic(base_url=task.anthropic_base_url, api_key=task.api_key, max_retries=0) as c:
            try:
                c.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": [
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])
            except anthropic.BadRequestError as e:
                got["bad"] = (e.status_code, e.body)
        root = task.base_url.rsplit("/e/", 1)[0]
        with anthropic.Anthropic(base_url=root, api_key="not-a-key", max_retries=0) as c:
            try:
                c.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
            except anthropic.AuthenticationError as e:
                got["auth"] = (e.status_code, e.body)

    (ge,), _ = _rollout(tokenizer, LocalEngine(tiny_model), agent, [_prompt()])
    status, body = got["bad"]
    assert status == 400 and body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "'image' are not supported" in body["error"]["message"]
    assert got["auth"][0] == 401 and got["auth"][1]["error"]["type"] == "authentication_error"
    assert ge.ep.status is Status.FAILED and ge.failure[0] == "bad_request"


def test_async_agent_that_hangs_is_cancelled_and_command_agents_are_killed(tokenizer, tiny_model):
    """An async callable past its timeout is cancelled; a command past it is killed (with its children);
    a command that exits non-zero fails with its output's tail; a command that works is an episode."""
    cancelled = threading.Event()

    async def hangs(task):
        try:
            await asyncio.sleep(3600)
        finally:
            cancelled.set()

    (ge,), _ = _rollout(tokenizer, LocalEngine(tiny_model), hangs, [_prompt()], timeout_s=1.0)
    wait_event(cancelled, what="the hung coroutine's cancellation")
    assert ge.ep.status is Status.FAILED and ge.failure[0] == "agent_timeout"

    env = CalculatorEnv(system_prompt=None, expert_calc_rate=1.0)
    engine = ExpertEngine(tokenizer, env.expert)
    params = lambda n: SamplingParams(max_new_tokens=16, stop_token_ids=[1])  # noqa: E731
    cases = {"works": ([sys.executable, "examples/calculator_openai_agent.py"], 600.0),  # (a start-up's time is
             "exits": ([sys.executable, "-c", "import sys; print('no luck'); sys.exit(3)"], 600.0),  # its own)
             "sleeps": ([sys.executable, "-c", "import time; time.sleep(3600)"], 2.0)}
    out = {k: _rollout(tokenizer, engine, cmd, [_prompt("37*58=", "2146")], params=params, timeout_s=t)[0][0]
           for k, (cmd, t) in cases.items()}
    assert out["works"].ep.status is Status.COMPLETED and out["works"].final_text == "answer: 2146"
    assert out["exits"].failure[0] == "agent_crashed" and "exit status 3: no luck" in out["exits"].failure[1]
    assert out["sleeps"].failure[0] == "agent_timeout"


def test_agent_reported_reward(tokenizer):
    """task.agent.gateway.reward=agent: the reward the agent posts (or returns); none is a counted failure."""
    env = CalculatorEnv(system_prompt=None, expert_calc_rate=1.0)
    engine = ExpertEngine(tokenizer, env.expert)
    solve = _example("calculator_openai_agent", "solve")

    def agent(task):
        with openai.OpenAI(base_url=task.openai_base_url, api_key=task.api_key, max_retries=0) as c:
            answer = solve(c, task.messages)
            if task.messages[0]["content"].startswith("1"):
                c.post("/reward", body={"reward": 0.25 if answer else 0.0, "info": {"len": len(answer)}},
                       cast_to=object)

    cfg = RolloutConfig(rollout_batch_size=2, n_samples_per_prompt=2, max_new_tokens=16, max_context=256)
    source = ListSource([_prompt("12*3=", "36"), _prompt("37*58=", "2146")])
    dm = RolloutDataModule(engine, tokenizer, source, None, cfg,
                           agent=AgentOptions(gateway=GatewayOptions(agent=agent, reward="agent"), max_turns=3))
    counts = Counter()
    samples = dm.rollout(list(source.prompts), 2, counts)
    rewards = {s.metadata["label"]: (s.reward, s.status, s.metadata.get("failure")) for s in samples}
    assert rewards["36"] == (0.25, Status.COMPLETED, None)
    assert rewards["2146"] == (None, Status.FAILED, "no_reward")
    assert counts["env_failed"] == 2
    assert [s.metadata["env/len"] for s in samples if s.metadata["label"] == "36"] == [10, 10]


# ----------------------------------------------------------------- weight updates
def _perturbed(model, scale):
    return [(n, t + scale * torch.randn_like(t)) for n, t in model.state_dict().items()]


def _two_turns(go, turn_two_sent=None):
    def agent(task):
        with openai.OpenAI(base_url=task.openai_base_url, api_key=task.api_key, max_retries=0) as c:
            msgs = list(task.messages)
            m = c.chat.completions.create(model="m", messages=msgs).choices[0].message
            go.wait()
            msgs += [{"role": "assistant", "content": m.content}, {"role": "user", "content": "next"}]
            c.chat.completions.create(model="m", messages=msgs)
    return agent


def test_requests_during_a_weight_update_wait_and_carry_the_new_version(tokenizer, tiny_model):
    """A request that arrives while the engine is loading new weights waits for them: its tokens are of the
    new version, the first turn's of the old one, observations -1."""
    engine = Recorder(LocalEngine(tiny_model, on_weight_update="continue"))
    turn_one, holding, release = threading.Event(), threading.Event(), threading.Event()
    weights = _perturbed(tiny_model, 0.01)

    def slow_weights():
        for i, item in enumerate(weights):
            if i == 1:
                holding.set()  # update_weights holds the engine now
                release.wait()
            yield item

    agent = _two_turns(turn_one)
    result = {}
    runner = threading.Thread(target=lambda: result.update(out=_rollout(tokenizer, engine, agent, [_prompt()])))
    runner.start()
    wait_until(lambda: len(engine.calls) == 1, runner.is_alive, "the first turn")
    updater = threading.Thread(target=lambda: engine.engine.update_weights(slow_weights(), version=1))
    updater.start()
    wait_event(holding, updater.is_alive, "the weight update to start")
    turn_one.set()
    wait_until(lambda: len(engine.engine._pending) == 1, runner.is_alive, "the second turn to wait in the engine")
    release.set()
    updater.join()
    runner.join()
    (ge,), _ = result["out"]
    (a1, _, v1), (a2, _, v2) = _actions(ge.ep)
    assert v1 == [0] * len(a1) and v2 == [1] * len(a2) and engine.version == 1
    assert _check_record(ge.ep, engine.calls) == 2


def test_a_turn_aborted_by_a_weight_update_is_generated_again(tokenizer, tiny_model):
    """on_weight_update=abort: an update while a turn decodes aborts it; the gateway generates the turn again
    (the agent never saw the aborted tokens), all of the new version, and counts it."""
    engine = Recorder(LocalEngine(tiny_model, on_weight_update="abort"))
    go, fired = threading.Event(), []
    weights = _perturbed(tiny_model, 0.01)

    def hook(iteration):  # on the decode thread, after a step of the second turn
        if len(engine.calls) == 1 and getattr(engine, "pending", 0) == 2 and not fired:
            fired.append(iteration)
            engine.engine.update_weights(weights, version=1)

    engine.engine.on_step = hook
    go.set()
    (ge,), counts = _rollout(tokenizer, engine, _two_turns(go), [_prompt()],
                             params=lambda n: SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=[]))
    assert fired and counts["gateway_regenerated"] == 1 and ge.regenerated == 1
    (a1, _, v1), (a2, _, v2) = _actions(ge.ep)
    assert v1 == [0] * 8 and v2 == [1] * 8
    aborted = [g for _, g in engine.calls if g.finish_reason == "abort"]
    assert len(aborted) == 1 and len(engine.calls) == 3
    assert _check_record(ge.ep, engine.calls) == 2


# ----------------------------------------------------------------- task=gateway_agent, the real Trainer
@pytest.mark.parametrize("mode, agent", [("sync", "examples/calculator_openai_agent.py:run"),
                                         ("async", "examples/calculator_anthropic_agent.py:run")])
def test_grpo_on_gateway_agent(tmp_path, mode, agent):
    run = glmlight.build(compose(overrides_for_tests(
        tmp_path, "task=gateway_agent", f"rollout.mode={mode}", f"task.agent.gateway.agent={agent}",
        "task.reward._target_=glmlight.gateway.rewards.CalculatorAnswer",
        "rollout.max_new_tokens=6", "task.agent.max_turns=2", "~callbacks.held_out_eval", "~callbacks.sample_table")))
    run.fit()
    assert run.module.policy_version == 2
    t = run.datamodule.totals
    assert t["produced"] == t["trained"] + sum(v for k, v in t.items() if k.startswith("dropped/"))
    assert t["trained"] > 0
