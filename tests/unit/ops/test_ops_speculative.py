"""glmlight.ops.speculative: speculative sampling's acceptance, residual and round (Leviathan et al. 2023,
Algorithm 1), and the speedup rule, against numbers worked out by hand from the formulas."""

import pytest
import torch

from glmlight.ops.speculative import (accept_drafts, acceptance_estimate, acceptance_probability,
                                      expected_tokens_per_round, invert_cdf, residual_distribution,
                                      speculation_on, speculation_speedup)

P = torch.tensor([0.5, 0.3, 0.2])
Q = torch.tensor([0.2, 0.6, 0.2])


def test_acceptance_and_residual_of_a_three_token_vocabulary():
    # min(1, p/q): 0.5/0.2 -> 1, 0.3/0.6 = 0.5, 0.2/0.2 = 1
    assert torch.allclose(acceptance_probability(P, Q), torch.tensor([1.0, 0.5, 1.0]))
    # max(0, p - q) = [0.3, 0, 0] -> normalised [1, 0, 0]
    assert torch.allclose(residual_distribution(P, Q), torch.tensor([1.0, 0.0, 0.0]))
    # p = [0.1, 0.6, 0.3], q = [0.4, 0.4, 0.2]: max(0, p - q) = [0, 0.2, 0.1] -> [0, 2/3, 1/3]; min(1, p/q) = [1/4, 1, 1]
    p2, q2 = torch.tensor([0.1, 0.6, 0.3]), torch.tensor([0.4, 0.4, 0.2])
    assert torch.allclose(residual_distribution(p2, q2), torch.tensor([0.0, 2 / 3, 1 / 3]))
    assert torch.allclose(acceptance_probability(p2, q2), torch.tensor([0.25, 1.0, 1.0]))
    # p = q: no positive residual mass (a rejection has probability 0): p itself
    assert torch.equal(residual_distribution(P, P), P)
    # q(x) = 0 (never drawn from q): 1 where p(x) > 0, 0 where p(x) = 0
    assert acceptance_probability(torch.tensor([0.3, 0.0]), torch.tensor([0.0, 0.0])).tolist() == [1.0, 0.0]


def test_one_step_output_distribution_is_the_target_by_the_formula():
    # P(emit x) = q(x) min(1, p(x)/q(x)) + (1 - sum_y min(p(y), q(y))) r(x); by hand for P, Q:
    # beta = 0.2 + 0.3 + 0.2 = 0.7; x=0: 0.2 * 1 + 0.3 * 1 = 0.5; x=1: 0.6 * 0.5 = 0.3; x=2: 0.2 * 1 = 0.2
    beta = torch.minimum(P, Q).sum()
    out = Q * acceptance_probability(P, Q) + (1 - beta) * residual_distribution(P, Q)
    assert torch.allclose(out, P)
    g = torch.Generator().manual_seed(0)
    for _ in range(20):  # and for random pairs
        p, q = torch.rand(7, generator=g).softmax(-1), (3 * torch.rand(7, generator=g)).softmax(-1)
        beta = torch.minimum(p, q).sum()
        assert torch.allclose(q * acceptance_probability(p, q) + (1 - beta) * residual_distribution(p, q), p, atol=1e-6)


def test_invert_cdf_takes_the_first_token_past_u_and_never_a_zero_one():
    probs = torch.tensor([[0.5, 0.0, 0.3, 0.2, 0.0]] * 4)
    # cdf = [0.5, 0.5, 0.8, 1.0, 1.0]
    assert invert_cdf(probs, torch.tensor([0.0, 0.5, 0.79, 0.999999])).tolist() == [0, 2, 2, 3]
    assert invert_cdf(probs[:1], torch.tensor([1.0])).tolist() == [3]  # u * total at the end: the last positive one


def test_a_round_accepts_up_to_the_first_rejection_then_draws_from_the_residual_or_the_bonus():
    # K = 2, V = 3. Target p_1 = P, p_2 = [0.1, 0.6, 0.3], p_3 = [0.2, 0.2, 0.6]; draft q_1 = Q, q_2 = [0.4, 0.4, 0.2]
    p = torch.stack([P, torch.tensor([0.1, 0.6, 0.3]), torch.tensor([0.2, 0.2, 0.6])])[None].repeat(4, 1, 1)
    q = torch.stack([Q, torch.tensor([0.4, 0.4, 0.2])])[None].repeat(4, 1, 1)
    drafts = torch.tensor([[1, 0], [1, 0], [0, 0], [2, 1]])
    # acceptance probabilities: row 0/1 draft 1 = token 1: 0.5; row 2 draft 1 = token 0: 1 then draft 2 = 0: 0.25;
    # row 3: token 2: 1, token 1: 1
    u_accept = torch.tensor([[0.6, 0.0], [0.4, 0.9], [0.3, 0.2], [0.99, 0.99]], dtype=torch.float64)
    u_final = torch.tensor([[0.1, 0.1, 0.1], [0.5, 0.5, 0.5], [0.7, 0.7, 0.7], [0.5, 0.5, 0.5]], dtype=torch.float64)
    accepted, tokens = accept_drafts(p, q, drafts, u_accept, u_final)
    assert accepted.tolist() == [0, 1, 2, 2]
    # row 0: 0.6 >= 0.5 rejects draft 1: residual of (P, Q) = [1, 0, 0] -> 0
    # row 1: 0.4 < 0.5 accepts; 0.9 >= 1/4 rejects draft 2 (token 0): residual [0, 2/3, 1/3], u 0.5 -> token 1
    # row 2: accepts both (1, then 0.2 < 0.25): bonus from p_3 = [0.2, 0.2, 0.6], u 0.7 -> cdf [0.2, 0.4, 1] -> 2
    # row 3: accepts both; bonus at u 0.5 -> 2
    assert tokens.tolist() == [[0, 0, 0], [1, 1, 0], [0, 0, 2], [2, 1, 2]]


def test_expected_tokens_speedup_and_the_on_off_rule():
    assert expected_tokens_per_round(0.5, 2) == pytest.approx(1.75)  # (1 - 0.5^3) / 0.5
    assert expected_tokens_per_round(0.0, 4) == 1.0
    assert expected_tokens_per_round(1.0, 3) == 4.0
    assert expected_tokens_per_round(0.8, 3) == pytest.approx(1 + 0.8 + 0.64 + 0.512)
    # 1.75 tokens per round of 2 drafts x 1 ms + 2 ms, against one token per 2 ms: 1.75 * 2 / 4
    assert speculation_speedup(0.5, 2, 1e-3, 2e-3, 2e-3) == pytest.approx(0.875)
    assert speculation_speedup(0.8, 3, 0.2e-3, 1.2e-3, 1e-3) == pytest.approx(2.952 / 1.8)
    assert acceptance_estimate(3, 1) == 0.75 and acceptance_estimate(0, 0) is None
    assert speculation_on(0.875, True) is False and speculation_on(0.97, True) is True
    assert speculation_on(1.03, False) is False and speculation_on(1.06, False) is True
