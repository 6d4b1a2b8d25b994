"""Micro-batches: which rows of a batch run one forward pass together.

`by_rows` cuts the rows into chunks of `algo.micro_batch_size` rows. `by_tokens`
(`algo.micro_batch_tokens=N`) packs rows by their length instead (verl's use_dynamic_bsz,
slime's --use-dynamic-batch-size): rows sorted longest first fill a micro-batch while its padded
size, rows × (longest prompt + longest response), stays ≤ N, and each micro-batch is `trim`med to
exactly those columns (prompts are left-padded, responses right-padded), so a batch with a few long
and many short responses is not padded to the longest and no forward runs more than N tokens. The losses of
the micro-batches add up to the same minibatch loss either way (their denominators are the
minibatch's), so the gradients are the same; only the padding differs.
"""

from __future__ import annotations

import torch

from glmlight.sample import Experience


def by_rows(rows: torch.Tensor, size: int) -> list[torch.Tensor]:
    """`rows` in chunks of `size`; none for no rows."""
    return list(rows.split(size)) if len(rows) else []


def row_lengths(exp: Experience) -> tuple[torch.Tensor, torch.Tensor]:
    """Real prompt tokens and real response tokens of every row: ([B], [B])."""
    P = exp.prompt_length
    return exp.attention_mask[:, :P].sum(-1), exp.attention_mask[:, P:].sum(-1)


def by_tokens(rows: torch.Tensor, prompts: torch.Tensor, responses: torch.Tensor, budget: int) -> list[torch.Tensor]:
    """`rows` packed into micro-batches of at most `budget` padded tokens: rows × (longest prompt +
    longest response), the width `trim` leaves. Longest rows first, so similar lengths share a
    micro-batch; a row longer than the budget runs alone. `prompts[i]`, `responses[i]`: the lengths of
    row `rows[i]`."""
    if not len(rows):
        return []
    prompts, responses = prompts.cpu(), responses.cpu()
    order = torch.argsort(prompts + responses, descending=True, stable=True)
    out: list[list[int]] = []
    prompt = response = 0
    for i in order.tolist():
        p, r = int(prompts[i]), int(responses[i])
        if out and (max(prompt, p) + max(response, r)) * (len(out[-1]) + 1) <= budget:
            out[-1].append(i)
            prompt, response = max(prompt, p), max(response, r)
        else:
            out.append([i])
            prompt, response = p, r
    return [rows[torch.tensor(chunk, dtype=torch.long)] for chunk in out]


def trim(exp: Experience) -> Experience:
    """`exp` without the columns none of its rows uses: the left prompt padding above its longest
    prompt and the right response padding past its longest response. Response position t stays t;
    the DSA replay records, which hold key columns of this layout, move left with the columns."""
    P, T = exp.prompt_length, exp.response_length
    prompt = int(exp.attention_mask[:, :P].sum(-1).max()) if exp.batch_size else P
    response = max(int(exp.response_mask.sum(-1).max()) if exp.batch_size else T, 1)
    if prompt == P and response == T:
        return exp
    start, stop = P - prompt, P + response
    out = Experience(**{f: getattr(exp, f) for f in exp.__dataclass_fields__})
    for f in exp.__dataclass_fields__:
        v = getattr(exp, f)
        if isinstance(v, torch.Tensor) and v.dim() >= 2:
            if v.shape[1] == P + T:
                v = v[:, start:stop]
                setattr(out, f, v.where(v < 0, v - start) if f == "indexer_topk" and start else v)
            elif v.shape[1] == T:
                setattr(out, f, v[:, :response])
    out.prompt_length = prompt
    out.stats = dict(exp.stats)
    return out


def place_rows(parts: list[tuple[torch.Tensor, torch.Tensor]], batch_size: int, width: int) -> torch.Tensor:
    """Per-micro-batch results [b, t ≤ width] back into one [batch_size, width] tensor, row i of a part
    at its row index (zeros past each part's width)."""
    ref = parts[0][1]
    out = ref.new_zeros(batch_size, width)
    for idx, values in parts:
        out[idx.to(out.device), : values.shape[1]] = values
    return out
