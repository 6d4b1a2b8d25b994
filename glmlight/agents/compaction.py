"""Context compaction (CompactionRL, Li et al. 2026): agents that summarise their own context.

When the remaining budget C − |h| falls below T_comp, the same policy is asked to
write a summary (a user turn with the summary instruction; the summary tokens are
actions, loss_mask 1). The segment is closed and execution resumes from a new
prompt: the opening messages + a resume turn carrying the summary + the last k
(action, observation) steps, k reduced until the prompt leaves T_comp tokens of
room. The copied summary and tail are prompt tokens of the new segment (never
trained on there); all ids are spliced as produced, never re-tokenized.

The summary's ids go inside the resume turn, before whatever the template closes a
user turn with (nothing in GLM's template, `<|im_end|>` and a newline in ChatML).

The summary request is a user turn of the conversation, checked against the chat template's rendering as an
observation is (`AgentLoop.extension`): where the template renders the conversation otherwise once a user turn
follows (GLM-4.5's drops the reasoning of earlier turns), the summary is asked for in a new segment whose prompt
is that rendering. The resume prompt is the context's replacement by design (a new segment); the conversation
resumes as the opening messages, the resume turn with the summary's text and the kept steps' turns, and the
turns after it are checked against its rendering as any turn is.
"""

from __future__ import annotations

from typing import Any

from glmlight.agents.loop import AgentLoop, Episode, encode_observation
from glmlight.errors import DataError
from glmlight.models.tokenizer import encode_chat, turn_closing
from glmlight.engines.base import SamplingParams
from glmlight.sample import Status

SUMMARY_PROMPT = "Summarize."
RESUME_HEADER = "Summary: "


class CompactingAgentLoop(AgentLoop):
    def __init__(self, *args: Any, threshold: int, keep_last_steps: int = 2, summary_max_tokens: int = 32,
                 summary_prompt: str = SUMMARY_PROMPT, resume_header: str = RESUME_HEADER, **kw: Any):
        super().__init__(*args, **kw)
        if threshold < 1 or threshold >= self.max_context:
            raise ValueError(f"compaction threshold must be in [1, max_context), got {threshold}")
        self.threshold, self.keep_last_steps = threshold, keep_last_steps
        self.summary_max_tokens = summary_max_tokens
        self.request_ids = encode_observation(self.tokenizer, summary_prompt, "user", self.closing) + self.gen_prompt
        self.request = {"role": "user", "content": summary_prompt}
        self.resume_header = resume_header
        self.user_closing = turn_closing(self.tokenizer, "user")
        if threshold <= len(self.request_ids) + summary_max_tokens:
            raise ValueError(f"compaction threshold {threshold} leaves no room for the summary request "
                             f"({len(self.request_ids)} tokens) and summary ({summary_max_tokens} tokens)")

    def before_turn(self, active: list[Episode]) -> None:
        due = [e for e in active if not e.done and e.awaiting_prompt
               and self.max_context - len(e.context) < self.threshold]
        room = []
        for e in due:
            try:
                ids, segment = self.extension(e, [self.request], self.request_ids)
            except DataError as err:  # the template cannot render the conversation with the request
                e.finish(Status.FAILED, f"summary request: {err}")
                continue
            if (len(ids) if segment else len(e.context) + len(ids)) + 1 < self.max_context:
                room.append((e, ids, segment))
            else:
                e.finish(Status.TRUNCATED)
        if not room:
            return
        for e, ids, segment in room:
            self.take(e, [], ids, segment)  # (the conversation resumes from the summary: the request is not in it)
            e.awaiting_prompt = False
        room = [e for e, _, _ in room]
        params = []
        for e in room:
            p = self.params(len(e.context))
            budget = min(self.summary_max_tokens, self.max_context - len(e.context))
            params.append(SamplingParams(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                                         max_new_tokens=max(budget, 1), stop_token_ids=p.stop_token_ids))
        for e, g in zip(room, self.engine.generate([e.context for e in room], params)):
            if g.finish_reason == "error":  # no summary to resume from: the episode fails, as any failed turn does
                e.finish(Status.FAILED, "summary: engine failed after retries")
                continue
            e.add_action(g)  # the summary is the policy's own output: trained on
            if g.finish_reason == "abort":  # a weight update cut the summary short: generated again, never resumed from
                e.finish(Status.ABORTED)
                continue
            self.resume(e, g.token_ids)

    def resume_prompt(self, ep: Episode, summary_ids: list[int], k: int) -> list[int]:
        core = summary_ids[:-1] if summary_ids and summary_ids[-1] in self.stop_ids else summary_ids
        head = encode_chat(self.tokenizer, ep.messages + [{"role": "user", "content": self.resume_header}],
                           add_generation_prompt=False)
        head = head[: len(head) - len(self.user_closing)]  # the resume turn stays open for the summary
        tail: list[int] = []
        for action, obs in ep.steps[len(ep.steps) - k:] if k else []:
            tail += self.gen_prompt + action + obs
        return head + list(core) + self.user_closing + tail + self.gen_prompt

    def resume(self, ep: Episode, summary_ids: list[int]) -> None:
        """Close the current segment and continue from the resume prompt."""
        ep.summary_lengths.append(len(summary_ids))  # the segment's last action tokens are its summary
        k = min(self.keep_last_steps, len(ep.steps))
        prompt = self.resume_prompt(ep, summary_ids, k)
        while k > 0 and len(prompt) + self.threshold > self.max_context:
            k -= 1
            prompt = self.resume_prompt(ep, summary_ids, k)
        ep.new_segment(prompt)
        ep.steps = ep.steps[len(ep.steps) - k:] if k else []
        core = summary_ids[:-1] if summary_ids and summary_ids[-1] in self.stop_ids else summary_ids
        summary = self.tokenizer.decode(core, skip_special_tokens=True)
        # the last steps' turns are the conversation's last messages (an assistant turn and an observation each)
        ep.conversation = (ep.messages + [{"role": "user", "content": self.resume_header + summary}]
                           + (ep.conversation[len(ep.conversation) - 2 * k:] if k else []))
        ep.info["compactions"] = ep.info.get("compactions", 0) + 1
        if len(prompt) + 1 >= self.max_context:
            ep.finish(Status.TRUNCATED)
