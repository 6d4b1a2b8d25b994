"""On-policy distillation: per-token reverse-KL advantages and their mixing with outcome rewards.

Shapes: log-probs and masks are [B, T] over the response (right-padded), float32;
a per-sample outcome advantage is [B]. The student's log-probs are the train-side
old log-probs of the sampled tokens; the teacher's come from a prefill of the same tokens.
"""

from __future__ import annotations

import torch

from glmlight.ops.logprobs import log_softmax
from glmlight.ops.reduce import masked_mean


def opd_advantages(teacher_logprobs: torch.Tensor, student_logprobs: torch.Tensor, mask: torch.Tensor,
                   coef: float = 1.0) -> torch.Tensor:
    """Â_t = coef · sg(log π_teacher(y_t) − log π_student(y_t)) · m_t, discount 0.

    GLM-5 (arXiv 2602.15763) Eq. 2; Thinking Machines "On-Policy Distillation" (reverse-KL reward).
    Tokens the teacher finds likelier than the student get a positive advantage.
    """
    if teacher_logprobs.shape != student_logprobs.shape or student_logprobs.shape != mask.shape:
        raise ValueError(f"opd_advantages: shapes differ: teacher {tuple(teacher_logprobs.shape)}, "
                         f"student {tuple(student_logprobs.shape)}, mask {tuple(mask.shape)}")
    return coef * (teacher_logprobs.detach() - student_logprobs.detach()) * mask


def mix_outcome_advantages(opd_adv: torch.Tensor, orm_adv: torch.Tensor, mask: torch.Tensor,
                           orm_coef: float) -> torch.Tensor:
    """Â_t = Â_OPD,t + α · Â_ORM · m_t, the sequence-level outcome advantage broadcast over tokens.

    MOPD (Ma et al. 2026; NeMo-RL implementation): α = orm_coef; Â_ORM is e.g. the
    group-normalised reward of `glmlight.ops.advantages.group_advantages`.
    """
    if orm_adv.shape != opd_adv.shape[:1]:
        raise ValueError(f"mix_outcome_advantages: orm_adv {tuple(orm_adv.shape)} must be [B] for "
                         f"opd_adv {tuple(opd_adv.shape)}")
    return opd_adv + orm_coef * orm_adv.to(opd_adv).unsqueeze(-1) * mask


def reverse_kl(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor,
               dim: int | None = None) -> torch.Tensor:
    """Monte-Carlo reverse KL(π_student ‖ π_teacher) from tokens sampled by the student:
    E_t[log π_student(y_t) − log π_teacher(y_t)] over masked tokens (k1 estimator, Schulman 2020).

    `dim=None`: one number over the batch; `dim=-1`: one per sequence.
    """
    return masked_mean((student_logprobs - teacher_logprobs).float(), mask.float(), dim)


def full_reverse_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor,
                    student_temperature: float = 1.0, teacher_temperature: float = 1.0) -> torch.Tensor:
    """KL(π_student(·|s_t) ‖ π_teacher(·|s_t)) = Σ_v π_S(v)·(log π_S(v) − log π_T(v)) at every masked
    position t of the student's own samples: [B, T] (0 off the mask), differentiable in the student's
    logits [B, T, V], the teacher's held fixed. Each distribution is the softmax of logits / temperature.

    GKD (Agarwal et al., ICLR 2024, arXiv:2306.13649), on-policy (λ = 1) with the reverse KL as the
    token-level divergence: the exact divergence at each visited prefix, of which GLM-5's Eq. 2
    advantage log π_T(y_t) − log π_S(y_t) is the one-sample estimate (its mean over y_t ~ π_S is −KL).
    """
    if student_logits.shape != teacher_logits.shape or student_logits.shape[:-1] != mask.shape:
        raise ValueError(f"full_reverse_kl: student logits {tuple(student_logits.shape)}, teacher logits "
                         f"{tuple(teacher_logits.shape)} and mask {tuple(mask.shape)} do not match")
    keep = mask.bool()
    s = log_softmax(student_logits[keep] / student_temperature)
    t = log_softmax(teacher_logits[keep].detach() / teacher_temperature)
    kl = (s.exp() * (s - t)).sum(-1)
    return mask.new_zeros(mask.shape, dtype=kl.dtype).masked_scatter(keep, kl)
