"""fastpe as a Hugging Face transformers attention implementation.

    from fastpe.integrations.transformers import register
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation=register())
    # or: model.set_attn_implementation(register())

``register`` adds fastpe's attention function to ``AttentionInterface`` and SDPA's mask
function to ``AttentionMaskInterface`` under the same name (without the mask function,
transformers would build no padding mask for an unknown implementation and padding would be
silently ignored). The masks are therefore SDPA's: boolean, True = attend, or None when the
pattern is plain causal — which is then SDPA's top-left causal rule.
"""

from __future__ import annotations

import fastpe

UNSUPPORTED = {
    "softcap": "logit soft-capping (Gemma 2)",
    "s_aux": "attention sinks",
    "sinks": "attention sinks",
}


def fastpe_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                             is_causal=None, **kwargs):  # fmt: skip
    """transformers' attention-function protocol: query [B, Hq, S, D], key/value [B, Hkv, Sk, D]
    (strided views are fine; GQA is read in place, no repeat_kv), returns ([B, S, Hq, Dv], None).
    """
    for name, what in UNSUPPORTED.items():
        if kwargs.get(name) is not None:
            raise NotImplementedError(
                f"fastpe attention does not support {what} ({name}=); use 'eager' or 'sdpa'"
            )
    if kwargs.get("output_attentions"):
        raise NotImplementedError(
            "fastpe attention never materialises attention weights (output_attentions=True); use 'eager'"
        )
    if dropout and module.training:
        raise NotImplementedError(
            f"fastpe attention has no dropout (got dropout={dropout} in training mode)"
        )
    position_bias = kwargs.get("position_bias")
    q_len = query.shape[2]
    causal = False
    mask = attention_mask
    if mask is None:
        # SDPA's rule when transformers skipped the mask: causal, top-left aligned, for q_len > 1
        causal = (
            bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
            and q_len > 1
        )
    if position_bias is not None:  # T5-style additive bias, combined with the boolean mask
        bias = position_bias
        if mask is not None and mask.dtype == bool:
            bias = bias.masked_fill(~mask, float("-inf"))
        elif mask is not None:
            bias = bias + mask
        mask = bias
    out = fastpe.attention(
        query, key, value, causal=causal, causal_alignment="top_left", mask=mask, scale=scaling
    )
    return out.transpose(1, 2).contiguous(), None


def register(name: str = "fastpe") -> str:
    """Register fastpe's attention (and SDPA's mask function) under ``name``; returns ``name``
    for ``attn_implementation=`` / ``model.set_attn_implementation``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, fastpe_attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
