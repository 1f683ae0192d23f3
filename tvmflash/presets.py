"""Model presets: the attention specs (and the variants' values) common models run, so
`tvmflash tune --model-preset llama3-8b` tunes what that model needs; and the compact spec
syntax of the command line (`bf16:d128:causal:window`).

Head counts are the models' published configurations; they do not change the specs (one
module serves every head count) but size the shapes `tvmflash bench` and the examples use.
"""
from __future__ import annotations

from dataclasses import dataclass

from .spec import AttentionSpec

DTYPE_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16",
               "float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}
CAUSAL_NAMES = {"causal": "bottom_right", "causal-bottom-right": "bottom_right", "causal-top-left": "top_left"}
VARIANT_NAMES = ("softcap", "alibi", "window")


@dataclass(frozen=True)
class ModelPreset:
    name: str
    heads: int
    kv_heads: int
    head_dim: int
    window: int | None = None  # sliding window (left) of the windowed layers
    softcap: float = 0.0  # attention logit softcapping
    all_windowed: bool = False  # every layer windowed (else windowed and global layers alternate)

    def specs(self, dtype: str = "bfloat16", decode: bool = True) -> list[AttentionSpec]:
        """The training/prefill specs (causal, with the model's variants) and, with `decode`,
        the KV-cache decode specs."""
        base = ("softcap",) if self.softcap else ()
        layers = [base + ("window",)] if self.all_windowed else [base] + ([base + ("window",)] if self.window else [])
        out = [AttentionSpec(dtype, self.head_dim, "bottom_right", variants=v) for v in layers]
        if decode and dtype != "float32":
            out += [AttentionSpec(dtype, self.head_dim, "bottom_right", variants=v, kv_cache=True) for v in layers]
        return out

    @property
    def values(self) -> dict:
        """The variants' values (window sizes, softcap) to time the specs with."""
        out = {"window": (self.window, 0)} if self.window else {}
        return {**out, "softcap": self.softcap} if self.softcap else out


MODEL_PRESETS = {p.name: p for p in (
    ModelPreset("llama3-8b", 32, 8, 128),
    ModelPreset("llama3-70b", 64, 8, 128),
    ModelPreset("mistral-7b", 32, 8, 128, window=4096, all_windowed=True),  # v0.1's sliding window
    ModelPreset("gemma2-9b", 16, 8, 256, window=4096, softcap=50.0),  # local / global layers alternate
    ModelPreset("gemma2-27b", 32, 16, 128, window=4096, softcap=50.0),
    ModelPreset("qwen2-7b", 28, 4, 128),
    ModelPreset("qwen2-72b", 64, 8, 128),
)}


def parse_spec(text: str) -> AttentionSpec:
    """A spec from `dtype:dN[:causal|causal-top-left][:softcap][:alibi][:window][:kvcache]`
    (e.g. `bf16:d128:causal:window`), or a spec name as `AttentionSpec.name` writes it for the
    plain / causal specs."""
    for spec in _named_specs(text):
        return spec
    parts = text.split(":")
    if len(parts) < 2 or parts[0] not in DTYPE_NAMES or not parts[1].startswith("d") or not parts[1][1:].isdigit():
        raise ValueError(f"spec {text!r}: expected dtype:dN[:causal][:softcap][:alibi][:window][:kvcache], "
                         f"e.g. bf16:d128:causal")
    causal, variants, kv_cache = "none", [], False
    for part in parts[2:]:
        if part in CAUSAL_NAMES:
            causal = CAUSAL_NAMES[part]
        elif part in VARIANT_NAMES:
            variants.append(part)
        elif part == "kvcache":
            kv_cache = True
        else:
            raise ValueError(f"spec {text!r}: unknown part {part!r} (causal, causal-top-left, softcap, alibi, "
                             "window, kvcache)")
    return AttentionSpec(DTYPE_NAMES[parts[0]], int(parts[1][1:]), causal,
                         variants=tuple(v for v in VARIANT_NAMES if v in variants), kv_cache=kv_cache)


def _named_specs(name: str):
    import itertools

    from .spec import CAUSAL_MODES, DTYPES

    for dtype, causal, kv_cache in itertools.product(DTYPES, CAUSAL_MODES, (False, True)):
        prefix = f"{dtype}_d"
        if name.startswith(prefix):
            head = name[len(prefix):].split("_", 1)[0]
            if head.isdigit():
                spec = AttentionSpec(dtype, int(head), causal, kv_cache=kv_cache)
                if spec.name == name:
                    yield spec
