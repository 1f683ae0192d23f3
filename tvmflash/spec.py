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
# Built-in variants (flash-attn's), in the order the kernels apply them: the value-changing ones
# (softcap, then ALiBi) before every mask, so a mask's -inf is final. Each maps to the kernel
# arguments that carry its runtime values (kernels/score_mods.py declares them in this order).
VARIANT_ARGS = {"softcap": ("softcap",), "alibi": ("alibi_slopes",), "window": ("window_left", "window_right"),
                "dropout": ("dropout_p", "dropout_rng"),
                # packed sequences (flash_attn_varlen_func): kernels/score_mods.py's Varlen
                "varlen": ("varlen_q_rows", "varlen_k_rows", "varlen_seqs")}
VALUE_VARIANTS = ("softcap", "alibi")
# a flex block mask's kernel arguments (after its mask_mod's captures): the tile map, then the
# partial and full kv-block counts and lists per query block (torch's BlockMask fields)
# a kv_cache spec's decode kernel takes a kv-head's query rows (its heads x queries) in blocks
# of this many (one tensor-core m16 tile; schedules/cuda_decode.py)
DECODE_ROWS = 16
# how a CPU decode step's append kernel rotates (kernels/decode.py's decode_append `rotary`):
# not, pairs (2i, 2i + 1) (GPT-J, flash-attn's rotary_interleaved) or halves (GPT-NeoX)
ROTARY_NONE, ROTARY_INTERLEAVED, ROTARY_HALVES = 0, 1, 2
BLOCK_MASK_ARGS = ("mask_block_map", "mask_kv_num", "mask_kv_indices", "mask_full_kv_num", "mask_full_kv_indices")


@dataclass(frozen=True)
class AttentionSpec:
    dtype: str = "float32"
    head_dim: int = 64
    causal: str = "none"
    mask: str = "none"
    mask_dtype: str | None = None  # element type of an additive mask; None: same as dtype
    # which built-in variants (VARIANT_ARGS) the kernels apply; their values (window sizes, the
    # cap, slopes) are kernel arguments, so one module serves every value
    variants: tuple = field(default=())
    # flex_attention: ((role, flex.Program, block), ...), role "score" (score_mod) then "mask"
    # (mask_mod; block: the (query, key) block size of its block map, or None); captured
    # tensors are kernel arguments `<role>_capture<k>`, the block mask's are BLOCK_MASK_ARGS
    flex: tuple = field(default=())
    # keys and values read in place from a KV cache (flash_attn_with_kvcache's decode): the
    # module holds the split-KV decode kernels only (inference; CUDA)
    kv_cache: bool = False

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
        if tuple(self.variants) != tuple(v for v in VARIANT_ARGS if v in self.variants):
            raise ValueError(f"variants must be distinct names from {tuple(VARIANT_ARGS)} in that order, "
                             f"got {self.variants!r}")
        roles = tuple(role for role, *_ in self.flex)
        if roles not in ((), ("score",), ("mask",), ("score", "mask")):
            raise ValueError(f"flex must hold a score program, a mask program or both (in that order), got {roles}")
        if "varlen" in self.variants and (self.mask != "none" or self.flex):
            raise ValueError("packed sequences (varlen) take no attention mask and no flex programs")
        if self.kv_cache and (self.mask != "none" or self.flex or not set(self.variants) <= set(VALUE_VARIANTS + ("window",))):
            raise ValueError("a kv_cache spec takes causal, window, softcap and ALiBi only")

    def _modifier_names(self) -> list:
        names = [v for v in self.variants if v in VALUE_VARIANTS] + [f"flex_{r}" for r, *_ in self.flex if r == "score"]
        names += ["causal"] * (self.causal != "none") + ["mask"] * (self.mask != "none")
        names += [f"flex_{r}" for r, *_ in self.flex if r == "mask"]
        return names + [v for v in self.variants if v not in VALUE_VARIANTS]

    def modifiers(self) -> list:
        """The ScoreMods this spec applies, in order (imports TVM's compiler)."""
        from .kernels import score_mods as sm
        from .kernels.dropout import Dropout

        make = {"causal": lambda: sm.Causal(self.causal), "mask": lambda: sm.Mask(self.mask, self.mask_dtype or self.dtype),
                "softcap": sm.Softcap, "alibi": sm.Alibi, "window": sm.Window, "dropout": Dropout,
                "varlen": sm.Varlen}
        make.update((f"flex_{role}", (lambda r, p, b: lambda: sm.ScoreProgram(r, p, b))(role, program, block))
                    for role, program, block in self.flex)
        return [make[name]() for name in self._modifier_names()]

    @property
    def block_sparse(self) -> bool:
        """Whether a flex block mask's tile map is a kernel argument (kernels skip empty tiles)."""
        return any(block for _, _, block in self.flex)

    def kernel_arg_names(self) -> tuple:
        """The modifiers' kernel arguments in call order (after the scale); pure Python, so the
        runtime-only deployment can call the kernels."""
        args = {"causal": (), "mask": ("mask",), **VARIANT_ARGS}
        args.update((f"flex_{role}", tuple(f"{role}_capture{k}" for k in range(len(program.captures)))
                     + (BLOCK_MASK_ARGS if block else ())) for role, program, block in self.flex)
        return tuple(a for name in self._modifier_names() for a in args[name])

    @property
    def name(self) -> str:
        """Readable and unique: used for cache file names and function names."""
        text = f"{self.dtype}_d{self.head_dim}_causal-{self.causal}_mask-{self.mask}"
        if self.mask_dtype not in (None, self.dtype):
            text += f"-{self.mask_dtype}"
        if self.variants:
            text += "_" + "-".join(self.variants)
        if self.flex:  # programs are long: a digest names them
            digest = hashlib.sha256(repr(self.flex).encode()).hexdigest()[:12]
            text += "_flex-" + "-".join(role for role, *_ in self.flex) + f"-{digest}"
        if self.kv_cache:
            text += "_kvcache"
        return text

    def to_dict(self) -> dict:
        return asdict(self)
