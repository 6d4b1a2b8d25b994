"""The agent gateway: OpenAI- and Anthropic-compatible endpoints backed by the rollout engine, so that
an agent program written against the official clients runs unchanged in a rollout and is trained
token in, token out (docs/agents.md).

- `messages`: the turn as the wires share it; `openai_wire` (Chat Completions), `responses_wire` (OpenAI
  Responses), `anthropic_wire` (Messages): each wire's requests, responses, streams and errors;
- `tool_format`: how tool calls look in the model's text, per chat template;
- `template`: the ids of conversation turns, spliced turn by turn;
- `episode`: one episode's exact token record, served a request at a time;
- `server`: the HTTP server; `runner`: the agent programs of a rollout, their timeouts and rewards;
- `rewards`: task rewards over a gateway episode.
"""

