"""fastpe as a Hugging Face transformers attention implementation.

    from fastpe.integrations.transformers import register
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation=register())
    # or: model.set_attn_implementation(register())

``register`` adds fastpe's attention function to ``AttentionInterface`` and a mask function to
``AttentionMaskInterface`` under the same name (without a mask function, transformers would
build no padding mask for an unknown implementation and padding would be silently ignored).

The mask function builds SDPA's boolean masks (True = attend) only when the kernel cannot do the
masking itself: when the only masking is causal, or causal plus a sliding window, with no padding
and the keys ending at the last query, it builds nothing, and the attention function runs the
causal rule and the window (``sliding_window=W`` is ``window=(W - 1, 0)``, docs/math.md) in the
kernel, which then never visits keys outside the window. Gemma 2's ``softcap`` and gpt-oss's
``s_aux`` sinks are passed to the kernel.

Training works (fastpe.attention has a backward; gpt-oss's sinks get their gradient), except
with dropout and with a learned T5 ``position_bias``, which reaches fastpe as an additive mask
(masks get no gradient): both are refused by name.

Padding-free packed batches: when the model is called with FlashAttention's sequence
boundaries — ``cu_seq_lens_q``/``cu_seq_lens_k`` keyword arguments, which transformers forwards
to the attention function, as ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``
produces them — the packed batch ``[1, total, ...]`` runs through ``fastpe.attention_varlen``
(on a GPU with the boundaries checked once per forward, at the first layer: fastpe/_step_plans.py):
each sequence attends only to itself, and no cross-sequence score is computed, forward and
backward (attention_varlen has a backward, so padding-free training works too). (Packed
``position_ids`` without those kwargs still work, through the block-diagonal mask transformers
builds; that path computes every score of the packed row.)

Continuous batching (``model.generate_batch``, paged cache): transformers runs it only with
``paged|eager``, ``sdpa`` or a FlashAttention implementation (a name containing "flash"), and
it loads a FlashAttention implementation from the ``flash_attn`` packages or from a Hub kernel
(``modeling_flash_attention_utils._lazy_imports``), not from ``AttentionInterface``.
``register_flash()`` makes fastpe one: it registers transformers' own FlashAttention wrapper and
FlashAttention mask under ``"fastpe_flash"`` (as transformers does for a Hub kernel) and wraps
that one private loader so the name resolves to ``fastpe.flash_attn``'s varlen and dense
functions (gpt-oss's sinks reach them as their ``s_aux`` keyword). That loader is the one
transformers internal register_flash patches; the wrap checks the loader's signature first
(written for transformers 5.23) and refuses a transformers whose loader differs;
tests/integrations/test_transformers_cb.py pins it.
"""

from __future__ import annotations

import fastpe
from fastpe import flash_attn
from fastpe._step_plans import step_plan


def fastpe_attention_forward(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout=0.0,
    scaling=None,
    is_causal=None,
    sliding_window=None,
    softcap=None,
    s_aux=None,
    **kwargs,
):
    """transformers' attention-function protocol: query [B, Hq, S, D], key/value [B, Hkv, Sk, D]
    (strided views are fine; GQA is read in place, no repeat_kv), returns ([B, S, Hq, Dv], None).
    """
    if _warm_on_first_use:
        _first_use_warmup("register", getattr(module, "config", None), query, flash=False)
    if kwargs.get("sinks") is not None:
        raise NotImplementedError(
            "fastpe attention takes attention sinks as s_aux= (gpt-oss's name), not sinks="
        )
    if kwargs.get("output_attentions"):
        raise NotImplementedError(
            "fastpe attention never materialises attention weights (output_attentions=True); use 'eager'"
        )
    if dropout and module.training:
        raise NotImplementedError(
            f"fastpe attention has no dropout (got dropout={dropout} in training mode)"
        )
    # the masking the kernel does itself: causal, bottom-right aligned (keys end at the last
    # query), and the sliding window (kv > q - W  <=>  kv >= q - (W - 1))
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    window = (int(sliding_window) - 1, 0) if causal and sliding_window is not None else None
    options = dict(
        causal=causal,
        causal_alignment="bottom_right",
        scale=scaling,
        window=window,
        softcap=softcap,
        sinks=s_aux,
    )
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None or cu_k is not None:
        return _packed_forward(query, key, value, cu_q, cu_k, kwargs, options)
    position_bias = kwargs.get("position_bias")
    mask = attention_mask
    if mask is not None:
        # fastpe_mask built SDPA's mask: it holds the causal rule and the window
        options.update(causal=False, window=None)
    if position_bias is not None and position_bias.requires_grad:
        raise NotImplementedError(
            "fastpe attention cannot train T5's relative attention bias: position_bias reaches "
            "it as an additive mask, which gets no gradient; train with 'sdpa' or 'eager', or "
            "run under torch.no_grad()"
        )
    if position_bias is not None:  # T5-style additive bias, combined with the boolean mask
        bias = position_bias
        if mask is not None and mask.dtype == bool:
            bias = bias.masked_fill(~mask, float("-inf"))
        elif mask is not None:
            bias = bias + mask
        mask = bias
    out = fastpe.attention(query, key, value, mask=mask, **options)
    return out.transpose(1, 2).contiguous(), None


def _packed_forward(query, key, value, cu_q, cu_k, kwargs, options):
    """A padding-free packed batch: query [1, Hq, total_q, D], key/value [1, Hkv, total_k, D],
    sequence boundaries cu_q/cu_k (FlashAttention's varlen convention, bottom-right causal)."""
    if cu_q is None or cu_k is None:
        raise ValueError("cu_seq_lens_q and cu_seq_lens_k must be given together")
    if query.shape[0] != 1:
        raise ValueError(
            f"cu_seq_lens_q/cu_seq_lens_k describe one packed row; got a batch of {query.shape[0]}"
        )
    if kwargs.get("position_bias") is not None:
        raise NotImplementedError("a T5 position_bias with packed sequences is not supported")
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    # every layer of the forward passes the same boundary tensors: checked once, at the first
    plan = step_plan(
        lambda: fastpe.plan_varlen(cu_q, cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k),
        (cu_q, cu_k, max_q, max_k),
        (),
        query,
    )
    if plan is not None:
        cu_q = cu_k = max_q = max_k = None
    out = fastpe.attention_varlen(
        query[0].transpose(0, 1),
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
        cu_q,
        cu_k,
        max_seqlen_q=max_q,
        max_seqlen_k=max_k,
        plan=plan,
        **options,
    )
    return out[None], None


def fastpe_mask(
    batch_size,
    q_length,
    kv_length,
    q_offset=0,
    kv_offset=0,
    attention_mask=None,
    local_size=None,
    allow_is_causal_skip=True,
    config=None,
    **kwargs,
):
    """transformers' mask-function protocol: None when the kernel can apply the masking itself
    (see the module docstring), else SDPA's boolean mask."""
    from transformers.masking_utils import sdpa_mask

    if allow_is_causal_skip and _kernel_can_mask(
        q_length, kv_length, q_offset, kv_offset, attention_mask, local_size, config
    ):
        return None
    return sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        attention_mask=attention_mask,
        local_size=local_size,
        allow_is_causal_skip=False,
        config=config,
        **kwargs,
    )


def _kernel_can_mask(q_length, kv_length, q_offset, kv_offset, attention_mask, local_size, config):
    import torch

    # transformers allows the skip only for a causal mask function, with local_size set for
    # sliding windows and for chunked attention alike: only the sliding window is the kernel's
    if local_size is not None and local_size != getattr(config, "sliding_window", None):
        return False
    if local_size is not None and local_size == getattr(config, "attention_chunk_size", None):
        return False
    # a static cache's tensor offset (reading it would break a compiled graph), or keys that do
    # not end at the last query (a static cache's empty slots): bottom-right alignment fails
    if isinstance(q_offset, torch.Tensor) or isinstance(kv_offset, torch.Tensor):
        return False
    if kv_offset + kv_length != q_offset + q_length:
        return False
    if attention_mask is None:
        return True
    if torch.compiler.is_compiling():  # reading the padding mask would break the graph
        return False
    seen = attention_mask[:, kv_offset : kv_offset + kv_length]
    return seen.shape[-1] == kv_length and bool(seen.all())


def config_attention_options(config: dict) -> dict:
    """The options of ``fastpe.attention`` that a transformers model of ``config`` (a config's
    dict) passes in its attention layers, each None or False where the config does not turn it
    on: ``window``, its ``sliding_window`` W (``window=(W - 1, 0)`` in a causal call),
    ``softcap``, Gemma 2's ``attn_logit_softcapping``, and ``sinks``, True for gpt-oss, whose
    learned sink per head no config field names."""
    window, softcap = config.get("sliding_window"), config.get("attn_logit_softcapping")
    return {
        "window": int(window) if window else None,
        "softcap": float(softcap) if softcap else None,
        "sinks": config.get("model_type") == "gpt_oss" or bool(config.get("sinks")),
    }


# Compile ahead (register(warmup=...)): the register functions that asked to warm up on their
# first call, and the configs already warmed up in this process
_warm_on_first_use: set[str] = set()
_warmed: set = set()


def _warmup_now(config, flash: bool) -> None:
    """Compile what a model of ``config`` runs (fastpe.warmup), once per config per process."""
    key = (repr(sorted(fastpe._warmup.read_model_config(config).items())), flash)
    if key not in _warmed:
        _warmed.add(key)
        # no check process: this process is about to load (or has compiled) every kernel
        report = fastpe.warmup(model_config=config, flash=flash, check=False)
        import logging

        logging.getLogger("fastpe").info("%s", report.summary())


def _first_use_warmup(which, config, query, flash) -> None:
    """register(warmup=True): the first attention call warms up for its model's config (the
    attention module's ``config``), before computing anything: the compiles the model's later
    calls would make one by one (prefill, decode, each dtype) happen now, in worker processes
    where there are several CPUs, with progress on stderr."""
    import torch

    # under torch.compile's tracing the kernels run through fastpe's custom ops, after tracing:
    # warm up at the first eager call instead of spawning processes from a traced function
    if which not in _warm_on_first_use or torch.compiler.is_compiling():
        return
    _warm_on_first_use.discard(which)
    if config is None:  # a caller without a config (a bare function call): its own shape
        config = {"num_attention_heads": query.shape[-3], "head_dim": query.shape[-1]}
    # the dtype the model runs in, which may not be the config's torch_dtype (a bfloat16
    # checkpoint loaded in float32 on a CPU)
    try:
        config = {
            **fastpe._warmup._load_config(config),
            "torch_dtype": str(query.dtype).removeprefix("torch."),
        }
        _warmup_now(config, flash)
    except Exception as exc:  # noqa: BLE001 - the model's call goes on; kernels compile as used
        import logging

        logging.getLogger("fastpe").warning(
            "fastpe: register(warmup=True) could not warm up for this model (%s: %s); the "
            "kernels compile on first use instead",
            type(exc).__name__,
            exc,
        )


def _arm_warmup(which: str, warmup, flash: bool) -> None:
    if warmup is True:
        _warm_on_first_use.add(which)
    elif warmup is not False and warmup is not None:
        _warmup_now(warmup, flash)


def register(name: str = "fastpe", *, warmup=False) -> str:
    """Register fastpe's attention and mask functions under ``name``; returns ``name`` for
    ``attn_implementation=`` / ``model.set_attn_implementation``.

    ``warmup``: compile the CPU kernels the model will use before they are needed
    (``fastpe.warmup``; they are then cached on disk for every later process). A config (a
    transformers config, a ``config.json`` path or directory) warms up now, for that model;
    ``True`` warms up at the first attention call, for the config of the model that makes it
    (``register()`` is usually called before the model exists). Either way prefill and decode,
    in the config's dtype, with its window, softcap and sinks. For a cache prepared at image
    build time, run ``fastpe warmup --model-config ...`` there instead."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    _arm_warmup("register", warmup, flash=False)

    AttentionInterface.register(name, fastpe_attention_forward)
    AttentionMaskInterface.register(name, fastpe_mask)
    return name


# FlashAttention implementations resolved to fastpe by the wrapped loader (see register_flash)
_FLASH_NAMES: set[str] = set()
# transformers.modeling_flash_attention_utils._lazy_imports as of transformers 5.23
_LOADER_PARAMETERS = ("implementation", "attention_wrapper", "allow_all_kernels")


def register_flash(name: str = "fastpe_flash", *, warmup=False) -> str:
    """Register fastpe as a FlashAttention implementation named ``name`` (it must contain
    "flash", which is how transformers recognises one); returns ``name`` for
    ``attn_implementation=`` / ``model.set_attn_implementation``. Continuous batching
    (``generate_batch``) then runs its packed varlen attention through
    ``fastpe.attention_varlen``; ``generate``/``forward`` go through transformers' FlashAttention
    path (padding removed, then varlen) on fastpe too.

    ``warmup`` as for ``register``; with ``True`` the first call warms up for a config made of
    its own query's heads, head dim and dtype (FlashAttention's functions get no model), with
    the causal, decode, window, softcap and sinks features all compiled."""
    import transformers.modeling_flash_attention_utils as fa_utils
    from transformers import AttentionInterface
    from transformers.integrations.flash_attention import flash_attention_forward
    from transformers.integrations.hub_kernels import is_kernel
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.utils.generic import is_flash_attention_requested

    if not isinstance(name, str) or "flash" not in name:
        raise ValueError(
            f'name must be a str containing "flash" (transformers admits only FlashAttention '
            f"implementations, by that substring, to continuous batching); got {name!r}"
        )
    # a digit after "flash" reads as FlashAttention 2/3/4 (their packages, CUDA decode path);
    # "org/repo" reads as a Hub kernel to download
    if is_flash_attention_requested(requested_attention_implementation=name, version=[2, 3, 4]):
        raise ValueError(
            f"name must not contain a FlashAttention version digit after 'flash' (transformers "
            f"would treat it as the flash_attn package's version); got {name!r}"
        )
    if is_kernel(name):
        raise ValueError(f"name must not look like a Hub kernel 'org/repo'; got {name!r}")
    _wrap_flash_loader(fa_utils)
    _arm_warmup("register_flash", warmup, flash=True)
    _FLASH_NAMES.add(name)
    AttentionInterface.register(name, flash_attention_forward)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])
    return name


def _wrap_flash_loader(fa_utils) -> None:
    """Wrap transformers' private FlashAttention loader once: names in _FLASH_NAMES resolve to
    fastpe's functions, every other name goes to the original loader."""
    import inspect

    import transformers

    loader = getattr(fa_utils, "_lazy_imports", None)
    if getattr(loader, "_fastpe_wrapped", False):
        return
    found = None if loader is None else tuple(inspect.signature(loader).parameters)
    if found != _LOADER_PARAMETERS:
        raise RuntimeError(
            f"fastpe's continuous-batching hook wraps transformers.modeling_flash_attention_utils."
            f"_lazy_imports{_LOADER_PARAMETERS} (transformers 5.23); transformers "
            f"{transformers.__version__} has {'no such function' if found is None else found}. "
            f"register() (no continuous batching) still works; register_flash() needs updating"
        )

    def _lazy_imports(implementation, attention_wrapper=None, allow_all_kernels=False):
        if implementation in _FLASH_NAMES:
            # no flash_attn_with_kvcache: transformers uses it only for FlashAttention 2/3 on
            # CUDA/XPU, which these names are not
            return _flash_func, _flash_varlen_func, None, fa_utils._pad_input, fa_utils._unpad_input
        return loader(implementation, attention_wrapper, allow_all_kernels)

    _lazy_imports._fastpe_wrapped = True
    _lazy_imports.__wrapped__ = loader
    fa_utils._lazy_imports = _lazy_imports


# transformers reads these signatures to decide which keywords to pass (_process_flash_attention_
# kwargs): s_aux (gpt-oss's sinks) must be a parameter, else transformers drops the sinks
# silently, and block_table must not be one (transformers would pass its paged table, which
# fastpe.flash_attn's varlen function refuses). Otherwise they are fastpe.flash_attn's functions,
# plus the first-use warmup and transformers' optional max_seqlen_q/k.
def _flash_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q=None,
    max_seqlen_k=None,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    s_aux=None,
):
    """fastpe.flash_attn.flash_attn_varlen_func as transformers calls it: q [total_q, Hq, D],
    k/v [total_k, Hkv, D]; max_seqlen_q/k None for the longest sequence."""
    arguments = dict(locals())  # passed on by name: the signature above is what transformers reads
    _flash_warmup(q)
    return flash_attn.flash_attn_varlen_func(**arguments)


def _flash_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    s_aux=None,
):
    """fastpe.flash_attn.flash_attn_func as transformers calls it: q [B, Sq, Hq, D], k/v
    [B, Sk, Hkv, D]."""
    arguments = dict(locals())  # passed on by name: the signature above is what transformers reads
    _flash_warmup(q)
    return flash_attn.flash_attn_func(**arguments)


def _flash_warmup(q) -> None:
    if _warm_on_first_use:
        _first_use_warmup("register_flash", _flash_config(q), q, flash=True)


def _flash_config(q) -> dict:
    """A config for register_flash(warmup=True) from the first call's query ([..., H, D]):
    FlashAttention's functions get no model, so every feature a layer might use is warmed up
    (today they are runtime arguments of one compiled kernel: warming all costs no more)."""
    return {
        "num_attention_heads": q.shape[-2],
        "head_dim": q.shape[-1],
        "torch_dtype": str(q.dtype).removeprefix("torch."),
        "sliding_window": 4096,
        "attn_logit_softcapping": 30.0,
        "sinks": True,
    }
