"""One gateway episode: its exact token record, served one request at a time.

The record is a `glmlight.agents.loop.Episode`, so it becomes Samples as any agent episode does
(`episode_to_samples`: one per segment). A request whose messages extend the conversation the
record holds (the same messages, the assistant turns the ones the gateway produced, then only
user or tool messages) appends the new messages' ids (loss mask 0) and the opening of the next
assistant turn; the engine continues that exact context, and its ids go in as sampled (loss mask
1, with their log-probs and versions). Any other request (history dropped, edited or summarised,
an assistant turn the gateway did not produce, other tools where the template renders them) closes
the current segment and opens a new one from the request's messages, rendered by the chat template
(as CompactionRL's segments: each segment is a sample of its own, all share the episode's reward).
A request that extends the conversation opens a new segment as well when the chat template renders that
conversation otherwise than the record holds it (`TurnCodec.extend`: GLM-4.5's template drops the reasoning
of the turns before the last user turn, GLM-4.7's renders a turn without kept reasoning as `</think>` alone,
and a turn holding special tokens the agent never saw renders without them), so every context the engine
continues is the template's own rendering of the conversation (docs/agents.md, segments).

Ids the model did not sample go in as context too (loss mask 0, no log-prob of their own), so the
trainer scores the sampled ids under exactly the context the engine sampled them in: a final assistant
message the request asks the turn to continue (a prefill: its ids as the template renders that message
left open; the answer holds only the continuation, and the conversation the whole message; the agent's
own answer cut by max_tokens, sent back to continue, is continued in place, one action), and the
opening of a tool call a forced `tool_choice` asks for (`TurnCodec.forced_call`; the answer is read off
the forced and the sampled text together; one that is no call, or a call of a tool the request does not
allow, is answered as text and counted).

Nothing is trained that the agent did not see or that holds no action: an episode whose first
request is over the context budget (`rollout.max_context`) fails as `context_exceeded` (counted,
never a placeholder sample; the log says once which setting to raise), and a turn whose answer
never reached the agent (its client disconnected or timed out first) is withdrawn from the record
(`withdraw`): the record is again what it was before that request, so a retry continues from there;
an episode that asked but received no answer fails as `client_gone`.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import Counter
from typing import Any, Callable

from glmlight.agents.loop import Episode
from glmlight.gateway.messages import (CLOSED, CONTEXT, SERVER, Message, ToolCall, ToolSpec,
                                       TurnRequest, TurnResult, WireError)
from glmlight.gateway.template import TurnCodec
from glmlight.prompt import Prompt
from glmlight.engines.base import Generation, RolloutEngine, SamplingParams
from glmlight.sample import Status

log = logging.getLogger(__name__)

MAX_REGENERATIONS = 3  # a turn a weight update aborted is generated again this many times at most

# the fields of the record (glmlight.agents.loop.Episode) one turn changes: what `withdraw` puts back
_RECORD = ("prompt_ids", "response_ids", "loss_mask", "logprobs", "versions", "turns", "segments", "action_lengths",
           "routed_experts", "indexer_topk", "records_lost", "record_turns", "turn_rewards")
_context_noted = threading.Event()  # the advice to raise rollout.max_context is logged once per process


class GatewayEpisode:
    """`params(context_len)`: the run's sampling params of one turn (max_new_tokens within the context
    budget). With `client_sampling`, a request's temperature, top_p and top_k replace the run's; the
    turns drawn with other settings than the run's are recorded per segment (`sampling`), so the
    trainer scores them at the settings they were drawn with (glmlight.sample, SAMPLING_KEY)."""

    def __init__(self, index: int, prompt: Prompt, codec: TurnCodec, engine: RolloutEngine,
                 params: Callable[[int], SamplingParams], max_turns: int, max_context: int, counts: Counter,
                 client_sampling: bool = False):
        self.key = "glk-" + secrets.token_hex(16)
        self.id = f"episode-{index}"
        self.codec, self.engine, self.params, self.counts = codec, engine, params, counts
        self.max_turns, self.max_context, self.client_sampling = max_turns, max_context, client_sampling
        self.ep = Episode(prompt=prompt, env=None, prompt_ids=[])
        self.history: list[Message] | None = None  # the conversation the current segment's ids hold
        self.tools: list[ToolSpec] = []
        self.last_action: list[int] = []
        self.open_text: str | None = None  # the last answer's whole text when max_tokens cut it (to continue)
        self.forced_unparsed = 0  # forced tool calls whose answer was no call
        self.failure: tuple[str, str] | None = None  # (reason, message): the episode failed
        self.truncated: str | None = None  # why the episode ended at its budget
        self.closed = False
        self.reported: dict[str, Any] | None = None  # a reward the agent reported
        self.final_text = ""  # the text of the last turn the gateway answered
        self.calls: list[ToolCall] = []  # every tool call the gateway answered with
        self.requests = self.rewrites = self.regenerated = 0
        self.withdrawn = 0  # turns whose answer never reached the agent (`withdraw`)
        self._before: tuple[dict[str, Any], dict[str, Any]] | None = None  # the state before the last turn
        # per segment (closed ones, then the current one): [start, end, temperature, top_k, top_p] of each
        # action turn drawn with other settings than the run's, in the segment's response positions
        self.sampling: list[list[list[float]]] = [[]]
        self._state = threading.Lock()
        self._clock = threading.Lock()
        self._inflight, self._agent_s, self._since = 0, 0.0, time.monotonic()

    # ----------------------------------------------------------------- the agent's own time
    def start_clock(self) -> None:
        """The agent starts now."""
        with self._clock:
            self._agent_s, self._since = 0.0, time.monotonic()

    def enter(self) -> None:
        """A request of this episode is being served (the agent's clock stops)."""
        with self._clock:
            if self._inflight == 0:
                self._agent_s += time.monotonic() - self._since
            self._inflight += 1

    def leave(self) -> None:
        with self._clock:
            self._inflight -= 1
            if self._inflight == 0:
                self._since = time.monotonic()

    def agent_seconds(self) -> float:
        """Seconds the agent has spent on its own: its time alive minus the time its requests were served."""
        with self._clock:
            return self._agent_s + (time.monotonic() - self._since if self._inflight == 0 else 0.0)

    # ----------------------------------------------------------------- outcome
    def fail(self, reason: str, message: str) -> None:
        with self._state:
            self._fail(reason, message)

    def _fail(self, reason: str, message: str) -> None:
        if self.failure is None and self.truncated is None and not self.closed:
            self.failure = (reason, message)
            # context_exceeded is logged once for all episodes (`_prepare`)
            log.log(logging.DEBUG if reason == "context_exceeded" else logging.WARNING,
                    "gateway %s failed (%s): %s", self.id, reason, message)

    def report(self, reward: float, info: dict[str, Any]) -> None:
        with self._state:
            if self.closed:
                raise WireError(400, CLOSED, "this episode has ended")
            self.reported = {"reward": reward, "info": info}

    def finish(self, agent_failure: tuple[str, str] | None) -> Episode:
        """Close the episode (later requests are refused) and set the record's status."""
        with self._state:
            if agent_failure is not None:
                self._fail(*agent_failure)
            self._no_turn_fails()
            self.closed = True
            self._set_status()
            return self.ep

    def _no_turn_fails(self) -> None:
        """An episode without a turn the agent received fails (it has nothing to train on)."""
        if self.failure is None and self.ep.turns == 0:  # (also after close: `withdraw`)
            self.truncated = None  # a budget reached before any turn is no ending to train on
            self.failure = (("client_gone", f"the agent received none of its answers ({self.requests} request(s); "
                                            "it or its client went away before they arrived)") if self.requests
                            else ("agent_no_requests", "the agent ended without asking the model anything"))
            log.warning("gateway %s failed (%s): %s", self.id, *self.failure)

    def _set_status(self) -> None:
        ep = self.ep
        if not ep.prompt_ids:  # it never got as far as a prompt (a Sample needs one; a failed one is not trained)
            ep.prompt_ids = [self.codec.tokenizer.eos_token_id]
        if self.failure is not None:
            ep.finish(Status.FAILED, f"{self.failure[0]}: {self.failure[1]}")
        else:
            ep.finish(Status.TRUNCATED if self.truncated else Status.COMPLETED, self.truncated)
        ep.info.update(requests=self.requests, rewrites=self.rewrites, tool_calls=len(self.calls),
                       regenerated=self.regenerated, withdrawn=self.withdrawn, forced_unparsed=self.forced_unparsed)

    # ----------------------------------------------------------------- an answer the agent never received
    def _snapshot(self) -> tuple[dict[str, Any], dict[str, Any]]:
        copy = lambda v: list(v) if isinstance(v, list) else v  # noqa: E731 - turns only append to these lists
        return ({k: copy(getattr(self.ep, k)) for k in _RECORD},
                {"history": copy(self.history), "tools": list(self.tools), "last_action": list(self.last_action),
                 "sampling": [list(s) for s in self.sampling], "calls": list(self.calls),
                 "final_text": self.final_text, "rewrites": self.rewrites, "open_text": self.open_text,
                 "forced_unparsed": self.forced_unparsed})

    def withdraw(self, why: str) -> None:
        """The last turn's answer never reached the agent (`why`): the record, the conversation and the
        answered tool calls go back to what they were before its request, so the answer is not trained on
        and a retry of the request continues the record from there. Called before the episode's next
        request is served (the server holds the episode's lock until the answer is sent)."""
        with self._state:
            if self._before is None:
                return
            record, own = self._before
            self._before = None
            for k, v in record.items():
                setattr(self.ep, k, v)
            for k, v in own.items():
                setattr(self, k, v)
            self.withdrawn += 1
            self.counts["gateway_withdrawn_turns"] += 1
            log.warning("gateway %s: turn %d withdrawn from the record, its answer never reached the agent (%s)",
                        self.id, record["turns"] + 1, why)
            if self.closed:  # the agent ended meanwhile: its record's status again
                self._no_turn_fails()
                self._set_status()

    # ----------------------------------------------------------------- a turn
    def turn(self, req: TurnRequest) -> TurnResult:
        """Serve one request (called with the episode's requests one at a time)."""
        with self._state:
            self._check_open()
            self.requests += 1
            self._before = None
            before = self._snapshot()
            ctx, params, own, lead, forced = self._prepare(req)
        g = self._generate(ctx, params)
        with self._state:
            self._check_open()
            start = len(self.ep.response_ids)
            out = self._take(req, g, len(ctx), lead, forced)
            if own is not None and len(self.ep.response_ids) > start:
                self.sampling[-1].append([start, len(self.ep.response_ids), *own])
            self._before = before
            return out

    def _check_open(self) -> None:
        if self.failure is not None:
            raise WireError(400, CLOSED, f"this episode has failed ({self.failure[0]}: {self.failure[1]})")
        if self.truncated is not None:
            raise WireError(400, CONTEXT, f"this episode has ended: {self.truncated}")
        if self.closed:
            raise WireError(400, CLOSED, "this episode has ended (the rollout closed it)")

    def _truncate(self, why: str) -> WireError:
        self.truncated = why
        return WireError(400, CONTEXT, why)

    def _new_messages(self, req: TurnRequest) -> list[Message] | None:
        """The messages `req` adds to the conversation the record holds; None when it does not extend it."""
        h = self.history
        if h is None or len(req.messages) <= len(h):
            return None
        if self.codec.renders_tools and [t.key() for t in req.tools] != [t.key() for t in self.tools]:
            return None
        if any(a.key() != b.key() for a, b in zip(req.messages, h)):
            return None
        new = req.messages[len(h):]
        return None if any(m.role == "assistant" for m in new) else new

    def _continues_last_answer(self, req: TurnRequest) -> bool:
        """Whether `req` sends back the last answer, cut by max_tokens, as the message to continue: the same
        conversation before it, its whole text as the prefill. The record then continues as it is."""
        h = self.history
        if req.prefill is None or self.open_text is None or h is None or len(req.messages) != len(h) - 1:
            return False
        if self.codec.renders_tools and [t.key() for t in req.tools] != [t.key() for t in self.tools]:
            return False
        return all(a.key() == b.key() for a, b in zip(req.messages, h)) and req.prefill.content == self.open_text

    def _prepare(self, req: TurnRequest) -> tuple[list[int], SamplingParams, list[float] | None, str, int]:
        """The turn's context and sampling params, [temperature, top_k, top_p] when those are not the run's
        (the request's own, `client_sampling`; None when they are), the text the answer starts with that the
        model does not sample (a prefill, or a forced tool-call opening) and the number of forced ids."""
        if self.ep.turns >= self.max_turns:
            raise self._truncate(f"the episode's turn limit ({self.max_turns} turns) is reached")
        forced, lead = self.codec.forced_call(req.tool_name) if req.tool_choice == "required" else ([], "")
        if req.prefill is not None:  # (a prefill and a forced call are refused together: forced is [])
            lead = req.prefill.content
        ids = None  # the ids that extend the record; None: the request opens a new segment
        if self._continues_last_answer(req):
            ids = []  # the record holds the answer's ids, unclosed: the engine continues them
        elif (new := self._new_messages(req)) is not None:
            opened = [] if req.prefill is None else self.codec.prefill(req.prefill, req.tools)
            spliced = None if opened is None else self.codec.extend(self.ep.context, self.last_action, new,
                                                                    req.messages, req.tools)
            if spliced is not None:
                ids = spliced + opened + forced
        if ids is not None:
            if len(self.ep.context) + len(ids) >= self.max_context:
                raise self._truncate(f"the conversation exceeds the episode's context budget "
                                     f"({self.max_context} tokens)")
            self.ep.add_observation(ids)
        else:
            prompt = self.codec.encode(req.messages, req.tools, req.prefill)
            if len(prompt) + len(forced) >= self.max_context:
                why = f"the messages take {len(prompt)} tokens, the episode's context budget is {self.max_context}"
                if self.ep.turns == 0:  # nothing to train on: the episode is dropped, not truncated
                    self._fail("context_exceeded", why)
                    if not _context_noted.is_set():
                        _context_noted.set()
                        log.warning("gateway: an agent's first request takes %d tokens, over rollout.max_context="
                                    "%d; such episodes are dropped and counted (rollout/dropped/context_exceeded): "
                                    "raise rollout.max_context above the agent's prompts (logged once)",
                                    len(prompt), self.max_context)
                    raise WireError(400, CONTEXT, why)
                raise self._truncate(why)
            if self.history is not None:
                self._new_segment()
            self.ep.prompt_ids = prompt
            self.ep.add_observation(forced)
        self.history, self.tools = list(req.messages), list(req.tools)
        ctx = list(self.ep.context)
        p = self.params(len(ctx))
        cap = p.max_new_tokens if req.max_tokens is None else min(p.max_new_tokens, req.max_tokens)
        mine = self.client_sampling
        params = SamplingParams(
            temperature=req.temperature if mine and req.temperature is not None and p.temperature > 0 else p.temperature,
            top_p=req.top_p if mine and req.top_p is not None else p.top_p,
            top_k=req.top_k if mine and req.top_k is not None else p.top_k,
            max_new_tokens=max(cap, 1), stop_token_ids=list(p.stop_token_ids), seed=p.seed)
        own = [params.temperature, params.top_k, params.top_p]
        return ctx, params, None if own == [p.temperature, p.top_k, p.top_p] else own, lead, len(forced)

    def _new_segment(self) -> None:
        """Close the current segment (when it holds an action) and start an empty one: a rewritten history."""
        if self.ep.new_segment([]):
            self.sampling.append([])
        self.sampling[-1] = []
        self.last_action, self.open_text = [], None
        self.rewrites += 1
        self.counts["gateway_rewrites"] += 1

    def _generate(self, ctx: list[int], params: SamplingParams) -> Generation:
        """The engine's answer; a turn a weight update aborted is generated again (the agent never saw it)."""
        for _ in range(MAX_REGENERATIONS + 1):
            try:
                g = self.engine.generate([ctx], [params])[0]
            except Exception as e:  # noqa: BLE001 - an engine without retries of its own
                g = Generation([], [], "error", [])
                log.warning("gateway %s: engine error: %s: %s", self.id, type(e).__name__, e)
            if g.finish_reason != "abort":
                return g
            self.regenerated += 1
            self.counts["gateway_regenerated"] += 1
        with self._state:
            self._fail("aborted", f"a weight update aborted this turn {MAX_REGENERATIONS + 1} times")
        raise WireError(503, SERVER, "the turn was aborted by weight updates too many times")

    def _take(self, req: TurnRequest, g: Generation, prompt_len: int, lead: str, forced: int) -> TurnResult:
        """Record the sampled turn and read the answer off `lead` (the text before it the model did not
        sample: a prefill, or a forced tool-call opening of `forced` ids) and the sampled text. The forced ids
        are the answer's in its usage (the agent reads them as the model's output), a prefill the prompt's."""
        if g.finish_reason == "error":
            self._fail("engine_failed", "the rollout engine failed on this turn (after its retries)")
            raise WireError(500, SERVER, "the rollout engine failed on this turn")
        g, stop, text = self._cut_at_stop(g, req.stop, prompt_len)
        self.ep.add_action(g)
        self.ep.turns += 1
        self.ep.action_lengths.append(len(g.token_ids))
        self.last_action = list(g.token_ids)
        whole = lead + text
        self.open_text = whole if g.finish_reason == "length" and stop is None else None
        content, calls = self._calls(req, whole)
        self.calls += calls
        self.final_text = content
        self.history.append(Message("assistant", content, calls))
        finish = ("length" if g.finish_reason == "length" else "stop_sequence" if stop is not None
                  else "tool_calls" if calls else "stop")
        if req.prefill is not None and content.startswith(req.prefill.content):
            content = content[len(req.prefill.content):]  # the answer continues the prefill: only what follows
        return TurnResult(content, calls, finish, stop, prompt_len - forced, forced + len(g.token_ids), self.ep.turns,
                          self.id)

    def _calls(self, req: TurnRequest, text: str) -> tuple[str, list[ToolCall]]:
        """(the message's text, its tool calls). A call of a tool the request does not allow (`allowed`), a
        call of a `strict` tool whose arguments do not conform, or a forced turn that holds no call, is
        answered as text (as any unparseable call), and counted."""
        if req.tool_choice == "none" or not req.tools:
            return text, []
        if req.tool_choice == "required":
            self.counts["gateway_forced_calls"] += 1
        content, calls = self.codec.fmt.parse(text, req.tools, self._call_id)
        specs = {t.name: t for t in req.tools}
        if req.allowed is not None and any(c.name not in req.allowed for c in calls):
            self.counts["gateway_disallowed_calls"] += 1
            content, calls = text, []
        if not all(specs[c.name].accepts(c.arguments) for c in calls):
            self.counts["gateway_strict_mismatch"] += 1
            content, calls = text, []
        if req.tool_choice == "required" and not calls:
            self.forced_unparsed += 1
            self.counts["gateway_forced_unparsed"] += 1
        return content, calls

    def _call_id(self) -> str:
        return f"call_{secrets.token_hex(8)}"

    def _cut_at_stop(self, g: Generation, stops: list[str], prompt_len: int) -> tuple[Generation, str | None, str]:
        """The generation up to the token that completes the first stop string (as a server stops there),
        the stop string, and the turn's text without it."""
        decode = self.codec.decode
        text = decode(g.token_ids)
        if not stops or not any(s in text for s in stops):
            return g, None, text
        for k in range(1, len(g.token_ids) + 1):
            part = decode(g.token_ids[:k])
            hits = [(part.find(s), s) for s in stops if s in part]
            if hits:
                at, stop = min(hits)
                ran = prompt_len + k - 1  # positions whose records stay (module docstring of glmlight.sample)
                cut = Generation(g.token_ids[:k], g.logprobs[:k], "stop", g.versions[:k],
                                 None if g.routed_experts is None else g.routed_experts[:ran],
                                 None if g.indexer_topk is None else g.indexer_topk[:max(ran - _topk_start(g, prompt_len), 0)])
                return cut, stop, part[:at]
        return g, None, text


def _topk_start(g: Generation, prompt_len: int) -> int:
    """The first query position of `g`'s DSA records (they start at k_ix; see glmlight.sample)."""
    ran = prompt_len + len(g.token_ids) - 1
    return ran - len(g.indexer_topk) if g.indexer_topk is not None else 0
