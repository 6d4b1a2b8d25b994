"""Critic-side math: rewards on tokens (terminal or per turn) and the (clipped) value loss."""

from __future__ import annotations

import torch


def terminal_rewards(rewards: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence's scalar reward [B] on its last action token: [B, T] (zeros elsewhere).

    Outcome-reward RL with a critic (PPO/VAPO/SAO): r_t = R at the final action token, 0 before.
    """
    T = action_mask.shape[1]
    positions = torch.arange(T, device=action_mask.device).expand_as(action_mask)
    last = torch.where(action_mask > 0, positions, torch.full_like(positions, -1)).max(dim=1).values
    out = torch.zeros_like(action_mask, dtype=torch.float32)
    has = last >= 0
    out[has.nonzero().squeeze(-1), last[has]] = rewards[has].float()
    return out


def turn_rewards(action_mask: torch.Tensor, placed: list, terminal: list[float]) -> torch.Tensor:
    """Rewards on tokens [B, T] for rewards paid turn by turn: row i gets each (position, reward) of
    `placed[i]` at that response position (an action token: the last token of the turn it paid) and
    `terminal[i]` added at its last action token. With nothing placed this is
    `terminal_rewards(terminal, action_mask)`; with γ = 1 the return at every token is the reward the
    rest of the row (and, through `terminal`, the rest of the trajectory) earns."""
    out = terminal_rewards(torch.tensor(terminal, dtype=torch.float32, device=action_mask.device), action_mask)
    T = action_mask.shape[1]
    for i, row in enumerate(placed):
        for pos, r in row:
            if not 0 <= pos < T or action_mask[i, pos] == 0:
                raise ValueError(f"row {i}: a turn reward at response position {pos} is not on an action token")
            out[i, pos] += float(r)
    return out


def segment_terminals(total: float, own: list[float]) -> list[float]:
    """What each segment of one trajectory carries at its last action token when its turns' rewards sit on
    their own tokens: segment k's terminal is R − Σ_{j<=k} own_j, the rewards of every later segment
    plus the part of the trajectory's reward R that no turn was paid (an outcome bonus, length shaping).
    The segments' rewards then sum to R, and the return at a segment's last token is what the rest of
    the trajectory earns (a summary's return is what the segments it opens earn)."""
    out, paid = [], 0.0
    for o in own:
        paid += float(o)
        out.append(float(total) - paid)
    return out


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float | None = None, total_tokens: float | None = None) -> torch.Tensor:
    """Masked value loss ½·Σ m·(V − R)² / N, N = Σ m (or `total_tokens`: the token count of the
    whole minibatch, so that the losses of its micro-batches add up to the minibatch's token mean);
    with clip c (PPO, Schulman et al. 2017 impl.): ½·Σ m·max((V − R)², (V_old + clip(V − V_old, −c, c) − R)²) / N.
    All tensors [B, T]; returns a scalar."""
    err = (values - returns) ** 2
    if clip is not None:
        clipped = old_values + (values - old_values).clamp(-clip, clip)
        err = torch.maximum(err, (clipped - returns) ** 2)
    total = mask.sum() if total_tokens is None else torch.as_tensor(total_tokens, dtype=err.dtype)
    return 0.5 * (err * mask).sum() / total.clamp(min=1.0)


def merge_moments(mean: torch.Tensor, var: torch.Tensor, count: torch.Tensor, batch_mean: torch.Tensor,
                  batch_var: torch.Tensor, batch_count: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Running mean / population variance of a stream after one more batch (Chan et al. 1979,
    parallel variance): with n = count + n_b and δ = mean_b − mean,
    mean' = mean + δ·n_b / n,  var' = (var·count + var_b·n_b + δ²·count·n_b / n) / n,  count' = n."""
    total = count + batch_count
    delta = batch_mean - mean
    new_mean = mean + delta * batch_count / total
    new_var = (var * count + batch_var * batch_count + delta**2 * count * batch_count / total) / total
    return new_mean, new_var, total
