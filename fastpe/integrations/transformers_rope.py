"""Opt-in: route transformers' rotary embedding (``apply_rotary_pos_emb``) through fastpe.

    from fastpe.integrations.transformers_rope import patch_rotary
    with patch_rotary("llama"):        # or: handle = patch_rotary(...); handle.restore()
        model.generate(...)

transformers' Llama-family attention calls ``apply_rotary_pos_emb`` by its module-global name, so
replacing that one attribute of ``transformers.models.<model>.modeling_<model>`` is the whole
patch: no class, forward or config is touched, and ``restore()`` puts the original back.

The replacement rotates q and k in one ``fastpe.apply_rope((q, k), ...)`` call, in float32 with
one rounding to q's dtype (transformers rounds after each multiply and add in half precision, so
half-precision results differ in the last bit). transformers hands over cos/sin already gathered
per token, ``[B or 1, S, D]`` with the two halves duplicated; fastpe reads their first halves as a
table with one row per token. q and k that need gradients go through fastpe too (its backward
rotates the gradients back, docs/math.md#rope-gradient). The halves are compared once per
(cos, sin) pair, not per layer: the same tensors, unchanged in place since, are not compared again
(tensors made under ``torch.inference_mode`` carry no version and are compared at every call).
Anything else — halves that differ, a
layout other than ``unsqueeze_dim`` 1 or 2, cos/sin that need gradients (fastpe treats the
tables as constants) — goes to the original function.
"""

from __future__ import annotations

import importlib
import threading
import weakref

import fastpe

_lock = threading.Lock()
_originals: dict[str, object] = {}  # module name -> transformers' own apply_rotary_pos_emb
_depth: dict[str, int] = {}  # module name -> how many live patches hold it


def _module_name(model: str) -> str:
    return model if "." in model else f"transformers.models.{model}.modeling_{model}"


# The last (cos, sin) pair compared, as weak references with their versions, and the answer: a
# model computes cos/sin once per forward and passes the same tensors to every layer, so they
# are compared once per forward (torch.equal is a host sync on a GPU), not once per layer.
_last_compared: tuple = ()


def _duplicated_halves(torch, cos, sin, half: int) -> bool:
    global _last_compared
    try:
        versions = (cos._version, sin._version)
    except RuntimeError:  # inference tensors have no version: compared on every call
        versions = None
    if versions is not None and _last_compared and not torch.compiler.is_compiling():
        cos_ref, sin_ref, seen_versions, answer = _last_compared
        if cos_ref() is cos and sin_ref() is sin and seen_versions == versions:
            return answer
    answer = torch.equal(cos[..., :half], cos[..., half:]) and torch.equal(
        sin[..., :half], sin[..., half:]
    )
    if versions is not None:
        _last_compared = (weakref.ref(cos), weakref.ref(sin), versions, answer)
    return answer


def _make_replacement(original):
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        unsqueeze_dim = args[0] if args else kwargs.get("unsqueeze_dim", 1)
        torch = importlib.import_module("torch")
        if (
            args[1:]
            or set(kwargs) - {"unsqueeze_dim"}
            or unsqueeze_dim not in (1, 2)
            or cos.ndim != 3
            or cos.shape != sin.shape
            or cos.shape[-1] % 2
            or (torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad))
        ):
            return original(q, k, cos, sin, *args, **kwargs)
        batch, seq, dim = cos.shape
        half = dim // 2
        # rotate_half pairs (i, i + D/2) and transformers duplicates each frequency: a table of
        # the first halves is fastpe's; if a model ever stores different halves, fall back
        if not _duplicated_halves(torch, cos, sin, half):
            return original(q, k, cos, sin, *args, **kwargs)
        table_cos = cos.reshape(batch * seq, dim)[:, :half]
        table_sin = sin.reshape(batch * seq, dim)[:, :half]
        rows = torch.arange(batch * seq, device=cos.device)
        positions = rows if batch == 1 else rows.view(batch, seq)
        layout = "bhsd" if unsqueeze_dim == 1 else "bshd"
        return fastpe.apply_rope(
            (q, k), table_cos, table_sin, positions=positions, interleaved=False, layout=layout
        )

    apply_rotary_pos_emb.__wrapped__ = original
    apply_rotary_pos_emb.__fastpe_rope__ = True
    return apply_rotary_pos_emb


class RotaryPatch:
    """A live patch of one or more modeling modules; ``restore()`` (or leaving the ``with``
    block) undoes it. Patches nest: a module is restored when its last patch is."""

    def __init__(self, modules: tuple[str, ...]):
        self.modules = modules
        self._active = True

    def restore(self) -> None:
        with _lock:
            if not self._active:
                return
            self._active = False
            for name in self.modules:
                _depth[name] -= 1
                if _depth[name] == 0:
                    importlib.import_module(name).apply_rotary_pos_emb = _originals.pop(name)
                    del _depth[name]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.restore()


def patch_rotary(*models: str) -> RotaryPatch:
    """Replace ``apply_rotary_pos_emb`` in each model's modeling module (default ``"llama"``; a
    short name such as ``"mistral"`` or a full module path). Raises ValueError for a module
    without that function. Returns a ``RotaryPatch`` (a context manager)."""
    names = tuple(_module_name(m) for m in (models or ("llama",)))
    with _lock:
        modules = []
        for name in names:
            try:
                module = importlib.import_module(name)
            except ImportError as exc:
                raise ValueError(f"patch_rotary: cannot import {name!r} ({exc})") from exc
            if not callable(getattr(module, "apply_rotary_pos_emb", None)):
                raise ValueError(f"patch_rotary: {name!r} has no apply_rotary_pos_emb to replace")
            modules.append(module)
        for name, module in zip(names, modules, strict=True):
            if name not in _originals:
                original = module.apply_rotary_pos_emb
                _originals[name] = original
                module.apply_rotary_pos_emb = _make_replacement(original)
            _depth[name] = _depth.get(name, 0) + 1
    return RotaryPatch(names)
