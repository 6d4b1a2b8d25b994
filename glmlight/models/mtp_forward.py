"""The training forward of a policy with MTP layers through the model's own modules: the logits of the main
model and of each MTP depth, for any causal LM `glmlight.models.mtp.attach_mtp` gives MTP layers (GLM-5,
GLM-4.5 / 4.6 / 4.7, GLM-4.7-Flash, DeepSeek-V3 in transformers). glmlight's GLM-5 forward computes the same
(`glmlight.models.glm5.forward.forward_logits_mtp`, whose docstring states the function) on fewer ops; this one
is what the trainer runs where the model's own forward runs (`model.forward=transformers`), and the reference
the fast one is tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from glmlight.models.mtp import mtp_of
from glmlight.ops.mtp import mtp_input


def hf_forward_logits_mtp(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                          position_ids: torch.Tensor, start: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(main logits [B, S - start, V] at positions start..S-1, [per MTP depth d: logits [B, S - start, V] at
    positions start-d..S-1-d]), as `forward_logits_mtp` (0 where a depth has no input)."""
    from transformers.masking_utils import create_causal_mask

    mtp = mtp_of(model)
    base = model.model
    B, S = input_ids.shape
    h = base(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
             use_cache=False).last_hidden_state  # after the final norm
    logits = model.lm_head(h[:, start:])
    emb_w, head_w = base.embed_tokens.weight.detach(), model.lm_head.weight.detach()
    prev, real = h.detach(), attention_mask.bool()
    out = []
    for d, layer in enumerate(mtp.layers, start=1):
        real_d = torch.zeros_like(real)
        real_d[:, : S - d] = real[:, : S - d] & real[:, d:]
        ids = F.pad(input_ids[:, d:], (0, d))
        x = mtp_input(F.embedding(ids, emb_w), prev, layer.enorm.weight, layer.hnorm.weight, layer.eh_proj.weight,
                      layer.enorm.variance_epsilon)
        mask = create_causal_mask(config=model.config, inputs_embeds=x, attention_mask=real_d.long(), cache=None,
                                  position_ids=position_ids, allow_is_causal_skip=False)
        y = layer.block_forward(x, attention_mask=mask, position_ids=position_ids,
                                position_embeddings=base.rotary_emb(x, position_ids))
        prev = layer.shared_head.norm(y)
        z = F.linear(prev[:, max(start - d, 0): S - d], head_w) * real_d[:, max(start - d, 0): S - d, None]
        out.append(F.pad(z, (0, 0, max(d - start, 0), 0)))
    return logits, out
