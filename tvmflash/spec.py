"""AttentionSpec: the hashable description of *what* a kernel computes.

One spec -> one compiled module (forward + backward functions) that serves every batch size,
head count (MHA, GQA and MQA alike: the kv-head count is a runtime size), sequence length and
stride pattern. Nothing here imports TVM, so building a spec is free.
"""
from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field

DTYPES = ("float32", "float16", "bfloat16")
CAUSAL_MODES = ("none", "top_left", "bottom_right")
MASK_KINDS = ("none", "bool", "additive")
MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class AttentionSpec:
    dtype: str = "float32"
    head_dim: int = 64
    causal: str = "none"
    mask: str = "none"
    mask_dtype: str | None = None  # element type of an additive mask; None: same as dtype
    # Variants (window, ALiBi, softcap; later dropout, flex score_mod) as ScoreMod objects from
    # tvmflash.kernels.score_mods; their runtime values are kernel arguments, not part of the spec
    score_mods: tuple = field(default=())

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not (isinstance(self.head_dim, int) and 0 < self.head_dim <= MAX_HEAD_DIM):
            raise ValueError(f"head_dim must be an int in [1, {MAX_HEAD_DIM}], got {self.head_dim!r}")
        if self.causal not in CAUSAL_MODES:
            raise ValueError(f"causal must be one of {CAUSAL_MODES}, got {self.causal!r}")
        if self.mask not in MASK_KINDS:
            raise ValueError(f"mask must be one of {MASK_KINDS}, got {self.mask!r}")
        if self.mask_dtype is not None and (self.mask != "additive" or self.mask_dtype not in DTYPES):
            raise ValueError(f"mask_dtype {self.mask_dtype!r} needs mask='additive' and one of {DTYPES}")

    def modifiers(self) -> list:
        """The ScoreMods this spec applies, in order (imports TVM): those that change values
        (softcap, then ALiBi: flash-attn's order) before every mask, so a mask's -inf is final."""
        from .kernels.score_mods import Causal, Mask

        mods = [m for m in self.score_mods if not m.is_mask]
        if self.causal != "none":
            mods.append(Causal(self.causal))
        if self.mask != "none":
            mods.append(Mask(self.mask, self.mask_dtype or self.dtype))
        return mods + [m for m in self.score_mods if m.is_mask]

    @property
    def name(self) -> str:
        """Readable and unique: used for cache file names and function names."""
        text = f"{self.dtype}_d{self.head_dim}_causal-{self.causal}_mask-{self.mask}"
        if self.mask_dtype not in (None, self.dtype):
            text += f"-{self.mask_dtype}"
        if self.score_mods:
            text += "_" + hashlib.sha256(repr(self.score_mods).encode()).hexdigest()[:12]
        return text

    def to_dict(self) -> dict:
        return asdict(self)
