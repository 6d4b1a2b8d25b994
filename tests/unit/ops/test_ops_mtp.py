"""glmlight/ops/mtp.py: an MTP depth's input, which response tokens each depth predicts, and its loss terms."""

import torch
import torch.nn.functional as F

from glmlight.ops.mtp import mtp_input, mtp_loss_terms, mtp_mask, rms_norm


def test_mtp_input_is_the_projection_of_the_normed_embedding_then_the_normed_hidden_state():
    torch.manual_seed(0)
    H = 8
    e, h = torch.randn(3, H) * 3, torch.randn(3, H) * 0.5
    we, wh, W = torch.rand(H) + 0.5, torch.rand(H) + 0.5, torch.randn(H, 2 * H)
    eps = 1e-5

    def norm(x, w):  # the RMSNorm of GLM / DeepSeek, written out
        return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)

    want = torch.cat([norm(e, we), norm(h, wh)], -1) @ W.T  # embedding first, as SGLang's and vLLM's eh_proj
    torch.testing.assert_close(mtp_input(e, h, we, wh, W, eps), want)
    torch.testing.assert_close(rms_norm(e, we, eps), norm(e, we))


def test_depth_d_predicts_response_token_j_from_position_P_plus_j_minus_d_minus_1():
    # prompts left-padded to P = 4, responses right-padded to T = 3
    attention = torch.tensor([[0, 0, 1, 1, 1, 1, 1],    # prompt of 2 tokens (positions 2, 3)
                              [1, 1, 1, 1, 1, 1, 0]])   # prompt of 4, response of 2
    loss = torch.tensor([[1, 0, 1], [1, 1, 0]])  # the policy loss's mask (an observation token in row 0)
    P = 4
    # depth 1: token j from position P + j - 2; row 0's first response token needs position 2 (real)
    assert mtp_mask(loss, attention, P, 1).tolist() == [[1, 0, 1], [1, 1, 0]]
    # depth 2: token j from position P + j - 3 = 1 + j: row 0 position 1 is padding
    assert mtp_mask(loss, attention, P, 2).tolist() == [[0, 0, 1], [1, 1, 0]]
    # depth 4: position j - 1: before the sequence for j = 0
    assert mtp_mask(loss, attention, P, 4).tolist() == [[0, 0, 0], [0, 1, 0]]


def test_loss_terms_are_the_masked_cross_entropy_and_argmax_hits():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 5, requires_grad=True)
    labels = torch.tensor([[1, 2, 3], [0, logits[1, 1].argmax().item(), 4]])
    mask = torch.tensor([[1, 0, 1], [0, 1, 1]])
    ce, correct, n = mtp_loss_terms(logits, labels, mask)
    keep = mask.bool()
    torch.testing.assert_close(ce, F.cross_entropy(logits[keep], labels[keep], reduction="sum"))
    assert n.item() == 4
    assert correct.item() == float((logits[keep].argmax(-1) == labels[keep]).sum())
    ce.backward()
    assert logits.grad[~keep].abs().sum() == 0
    empty = mtp_loss_terms(logits, labels, torch.zeros_like(mask))
    assert [float(x.detach()) for x in empty] == [0.0, 0.0, 0.0]
