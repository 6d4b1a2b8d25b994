"""The math of glmlight: pure tensor functions, no state, each with its shapes and its source.

Tensors are [B, T] right-padded over the response unless a docstring says otherwise; masks are
0/1; log-probs are natural-log float32.

advantages   group_advantages          GRPO / Dr.GRPO group-normalised outcome advantage, [B]
             soft_overlong_penalty     DAPO's length penalty inside the overlong cache window
gae          gae                       generalised advantage estimation, (advantages, returns)
             skip_observation_gae      GAE over action tokens only (SAO: observations skipped)
             adaptive_lambda           λ = 1 − 1/(α·l) per sequence (VAPO / SAO policy λ)
             segment_lambda            λ_s = 1 − 1/(α·L_s) of one segment (CompactionRL)
             cross_trajectory_gae      (γλ_s)^N_after scaling of each segment's advantages
             masked_whiten             (x − mean) / std over mask tokens
             masked_scale              x / std over mask tokens (no mean shift)
             explained_variance        1 − Var[R − V] / Var[R] over mask tokens
value        terminal_rewards          a sequence's reward on its last action token, [B, T]
             turn_rewards              rewards paid per turn on their turns' last tokens, the rest at the end
             segment_terminals         what each segment of a trajectory carries at its end (later segments' rewards)
             value_loss                ½·(V − R)² with optional PPO value clipping
             merge_moments             running mean / variance after one more batch
policy_loss  ppo_clip_loss             PPO clip with clip-higher (DAPO) and dual clip
dis          dis_mask                  GLM-5 DIS trust window on π_θ / π_rollout
             dis_loss_per_token        −f(r)·Â·log π_θ with f(r) = r inside the window
kl           kl_penalty                k1 / k2 / k3 estimators of KL(π_θ ‖ π_ref) per token
logprobs     logprobs_from_logits      log softmax(logits / T)[label], [B, T]
             entropy_from_logits       entropy of softmax(logits / T), [B, T]
reduce       masked_mean               mean over mask positions
             aggregate_loss            token_mean / seq_mean_token_mean / constant loss reduction
corrections  icepop                    IcePop band on k = π_old / π_rollout
             truncated_is              clamp(k, low, high)
             masked_is                 k inside [low, high], removed outside
             rejection_sampling        token / sequence / geometric IS and rejection
distill      opd_advantages            sg(log π_teacher − log π_student) per token (OPD)
             full_reverse_kl           exact KL(π_student ‖ π_teacher) over the vocabulary per position (GKD)
             mix_outcome_advantages    + α·Â_ORM broadcast over tokens (MOPD)
             reverse_kl                Monte-Carlo KL(π_student ‖ π_teacher)
mismatch     mismatch_sums             rank-summable sums behind the mismatch metrics
             reduce_mismatch_sums      mismatch KL, k3 KL, log-ppl gap, χ², trusted-token ratio
             mismatch_metrics          the two composed, for one batch
             token_agreement           greedy token agreement engine vs trainer
             topk_agreement            |A ∩ B| / k of top-k selections (DSA index agreement)
dsa          topk_mask, topk_recent    DSA top-k with the most-recent tie rule
schedule     lr_lambda                 warm-up + constant / cosine / linear learning-rate multiplier
eval_metrics pass_at_k                 unbiased pass@k of n answers, c correct (Chen et al. 2021)
             mean_pass_at_k            pass@k averaged over prompts
             majority_vote, maj_at_k   maj@k: the most frequent extracted answer, scored
quant        quantize_fp8_block        float8_e4m3fn + one scale per 128 x 128 block (DeepSeek-V3 / GLM-5 FP8)
             dequantize_fp8_block      Q · s back in a float dtype
mtp          mtp_input                 eh_proj [enorm(Emb(x_{t+d})); hnorm(h^{d-1}_t)] (DeepSeek-V3 MTP, sec. 2.2)
             mtp_mask                  the response tokens depth d predicts, [B, T]
             mtp_loss_terms            Σ cross-entropy, correct argmax and count over a mask
speculative  accept_drafts             one round of speculative sampling: accepted drafts, emitted tokens
             residual_distribution     norm(max(0, p − q)), drawn from at a rejection
             speculation_speedup       tokens/s of speculative over plain decoding (eq. 1's expected tokens)
"""

from glmlight.ops.advantages import group_advantages, soft_overlong_penalty
from glmlight.ops.corrections import CorrectionResult, icepop, masked_is, rejection_sampling, truncated_is
from glmlight.ops.dis import dis_loss_per_token, dis_mask
from glmlight.ops.distill import full_reverse_kl, mix_outcome_advantages, opd_advantages, reverse_kl
from glmlight.ops.dsa import topk_mask, topk_recent
from glmlight.ops.eval_metrics import maj_at_k, majority_vote, mean_pass_at_k, pass_at_k
from glmlight.ops.gae import (
    adaptive_lambda,
    cross_trajectory_gae,
    explained_variance,
    gae,
    masked_scale,
    masked_whiten,
    segment_lambda,
    skip_observation_gae,
)
from glmlight.ops.kl import kl_penalty
from glmlight.ops.logprobs import entropy_from_logits, logprobs_from_logits
from glmlight.ops.mismatch import mismatch_metrics, mismatch_sums, reduce_mismatch_sums, token_agreement, topk_agreement
from glmlight.ops.mtp import mtp_input, mtp_loss_terms, mtp_mask
from glmlight.ops.policy_loss import PolicyLossOutput, ppo_clip_loss
from glmlight.ops.quant import dequantize_fp8_block, quantize_fp8_block
from glmlight.ops.reduce import aggregate_loss, masked_mean
from glmlight.ops.schedule import lr_lambda
from glmlight.ops.speculative import accept_drafts, residual_distribution, speculation_speedup
from glmlight.ops.value import merge_moments, segment_terminals, terminal_rewards, turn_rewards, value_loss

__all__ = [
    "CorrectionResult", "PolicyLossOutput", "adaptive_lambda", "aggregate_loss", "cross_trajectory_gae",
    "dequantize_fp8_block", "dis_loss_per_token", "dis_mask", "entropy_from_logits", "explained_variance", "full_reverse_kl", "gae", "group_advantages",
    "icepop", "kl_penalty", "logprobs_from_logits", "lr_lambda", "maj_at_k", "majority_vote", "masked_is",
    "masked_mean", "masked_scale", "masked_whiten", "mean_pass_at_k", "merge_moments", "mismatch_metrics",
    "mismatch_sums", "mix_outcome_advantages", "mtp_input", "mtp_loss_terms", "mtp_mask", "opd_advantages",
    "pass_at_k", "ppo_clip_loss",
    "quantize_fp8_block", "reduce_mismatch_sums", "rejection_sampling", "reverse_kl", "segment_lambda",
    "segment_terminals", "skip_observation_gae", "soft_overlong_penalty", "accept_drafts",
    "residual_distribution", "speculation_speedup", "terminal_rewards", "token_agreement", "topk_agreement",
    "topk_mask", "topk_recent", "truncated_is", "turn_rewards", "value_loss",
]
