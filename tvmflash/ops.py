"""The torch operators: `tvmflash::attention_forward` / `attention_backward`, registered with
torch.library (fake impls for torch.compile, autograd through our backward kernels).

Layout here is (batch, heads, seqlen, head_dim) with any strides (head dim unit-stride); the
public functions in `interface.py` validate inputs and present the flash-attn / SDPA layouts
as views, so q/k/v are never copied. Tensors go to the TVM functions directly (DLPack).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import threading
from collections import Counter
from typing import Optional

import torch

from .spec import (BLOCK_MASK_ARGS, DECODE_ROWS, ROTARY_HALVES, ROTARY_INTERLEAVED, ROTARY_NONE, VARIANT_ARGS,
                   AttentionSpec)

_TORCH_TO_TVM = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


_FLEX_PROGRAMS: dict = {}  # key -> AttentionSpec.flex entries ((role, program, block), ...)


_FLEX_KEYS: dict = {}  # programs -> key (hashing the programs costs a call less than printing them)


def register_flex(programs: tuple) -> str:
    """A string key for traced flex programs (a plain argument of `attention`)."""
    key = _FLEX_KEYS.get(programs)
    if key is None:
        import hashlib

        key = _FLEX_KEYS[programs] = hashlib.sha256(repr(programs).encode()).hexdigest()[:16]
        _FLEX_PROGRAMS[key] = programs
    return key


def _variant_names(window: tuple, softcap: bool, alibi: bool, dropout: bool, packed: bool) -> tuple:
    """The built-in variants a call uses, in the spec's order."""
    return tuple(name for name, on in (("softcap", softcap), ("alibi", alibi), ("window", tuple(window) != (-1, -1)),
                                       ("dropout", dropout), ("varlen", packed)) if on)


def spec_for(q: torch.Tensor, mask: Optional[torch.Tensor], causal: str, window: tuple = (-1, -1),
             softcap: float = 0.0, alibi_slopes: Optional[torch.Tensor] = None,
             dropout_p: float = 0.0, flex: str = "", packed: bool = False) -> AttentionSpec:
    """The spec of a call: dtype, head dim, causal mode, mask kind and which variants it uses
    (their values are kernel arguments, `_mod_args`)."""
    variants = _variant_names(window, softcap > 0, alibi_slopes is not None, dropout_p > 0, packed)
    if mask is None:
        kind, mask_dtype = "none", None
    elif mask.dtype == torch.bool:
        kind, mask_dtype = "bool", None
    else:
        kind, mask_dtype = "additive", _TORCH_TO_TVM[mask.dtype]
        mask_dtype = None if mask_dtype == _TORCH_TO_TVM[q.dtype] else mask_dtype
    return _spec(_TORCH_TO_TVM[q.dtype], q.shape[-1], causal, kind, mask_dtype, variants, flex)


@functools.lru_cache(maxsize=256)
def _spec(dtype: str, head_dim: int, causal: str, mask: str, mask_dtype, variants: tuple, flex: str) -> AttentionSpec:
    """One AttentionSpec per call signature (building and validating one each call, then
    hashing it to find its kernels, cost a small call ~10% of its time)."""
    return AttentionSpec(dtype=dtype, head_dim=head_dim, causal=causal, mask=mask, mask_dtype=mask_dtype,
                         variants=variants, flex=_FLEX_PROGRAMS[flex] if flex else ())


@functools.lru_cache(maxsize=256)
def _arg_names(spec: AttentionSpec) -> tuple:
    return spec.kernel_arg_names()


_loaded: dict = {}  # (spec, device, CPU target choice) -> kernels: the per-call fast path


def _kernels(spec: AttentionSpec, device: torch.device) -> dict:
    # the CPU target is chosen per call (TVMFLASH_CPU_TARGET may change between calls)
    choice = os.environ.get("TVMFLASH_CPU_TARGET", "auto") if device.type == "cpu" else None
    kernels = _loaded.get((spec, device, choice))
    if kernels is None:
        from . import build

        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            kernels = build.load_cached(spec, build.cuda_target_for_device(index))
        else:
            kernels = build.load_cached(spec, build.cpu_target())
        _loaded[(spec, device, choice)] = kernels
    return kernels


_NO_SCOPE = contextlib.nullcontext()


def _on_stream(device: torch.device):
    """Scope for TVM kernel launches: on CUDA they go to torch's current stream of `device`.
    Torch's default stream on the current device is TVM's default too, and needs no scope
    (entering one costs microseconds, the budget of a whole call is tens)."""
    if device.type != "cuda":
        return _NO_SCOPE
    current = torch._C._cuda_getDevice()
    index = device.index if device.index is not None else current
    handle = torch._C._cuda_getCurrentRawStream(index)  # (torch.cuda.current_stream builds an object)
    if index == current and handle == 0:
        return _NO_SCOPE
    return _stream_scope(index, handle, index == current)


@contextlib.contextmanager
def _stream_scope(index: int, handle: int, current: bool):
    import tvm_ffi

    stream = tvm_ffi.use_raw_stream(tvm_ffi.device("cuda", index), handle)
    if current:
        with stream:
            yield
    else:
        with torch.cuda.device(index), stream:
            yield


def _mod_args(spec: AttentionSpec, shape, mask, window, softcap, alibi_slopes, dropout_p=0.0,
              dropout_rng=None, flex_captures=None, seqlens=None) -> tuple:
    """The score modifiers' kernel arguments, in the order the kernels declare them: the mask
    as a (B, H, Lq, Lk) view (broadcast through zero strides, bool as uint8), the window's sizes
    (an unbounded side as Lq + Lk), the softcap, ALiBi slopes as a (B, H) view, dropout's p
    and [seed, offset], packed sequences' row tables (kernels/score_mods.py's Varlen; ALiBi
    slopes then come with a row per sequence)."""
    names = _arg_names(spec)
    if not names:
        return ()
    B, H, Lq, Lk = shape
    values = {}
    if mask is not None:
        mask = mask.expand(shape)
        values["mask"] = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
    values["window_left"], values["window_right"] = (w if w >= 0 else Lq + Lk for w in window)
    values["softcap"] = float(softcap)
    if alibi_slopes is not None:
        values["alibi_slopes"] = alibi_slopes if seqlens else alibi_slopes.expand(B, H)
    values["dropout_p"], values["dropout_rng"] = float(dropout_p), dropout_rng
    values.update(zip(VARIANT_ARGS["varlen"], seqlens or ()))
    captures = iter(flex_captures or ())
    for role, program, block in spec.flex:
        for k in range(len(program.captures)):
            t = next(captures)
            values[f"{role}_capture{k}"] = t.view(torch.uint8) if t.dtype == torch.bool else t
        if block:  # the block mask's tile map and kv-block lists (B, H, ...) follow the captures
            values.update((name, next(captures)) for name in BLOCK_MASK_ARGS)
    return tuple(values[name] for name in names)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], scale: float,
              causal: str, deterministic: bool = False, window_left: int = -1, window_right: int = -1,
              softcap: float = 0.0, alibi_slopes: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
              dropout_rng: Optional[torch.Tensor] = None, seqlens: Optional[list] = None, flex: str = "",
              flex_captures: Optional[list] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention output and lse, differentiable. Under torch.compile this is the
    `tvmflash::attention_forward` operator (traceable, fake impls); in eager mode the same
    kernels run through a plain autograd.Function, which costs a fraction of the custom op's
    per-call dispatch (tens of microseconds, the whole runtime of a small attention call)."""
    variant = (window_left, window_right, softcap, alibi_slopes, dropout_p, dropout_rng, seqlens, flex, flex_captures)
    if torch.compiler.is_compiling():
        if flex:
            raise NotImplementedError("tvmflash.flex_attention under torch.compile is not supported yet")
        return attention_forward(q, k, v, mask, scale, causal, deterministic, *variant[:-3], *(seqlens or _NO_SEQLENS))
    if not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)):
        # nothing to differentiate (the caller checked mask, slopes and captures): no graph node
        return _forward(q, k, v, mask, scale, causal, (window_left, window_right), softcap, alibi_slopes, dropout_p,
                        dropout_rng, seqlens, flex, flex_captures)
    return _EagerAttention.apply(q, k, v, mask, scale, causal, deterministic, *variant)


@torch.library.custom_op("tvmflash::attention_forward", mutates_args=())
def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                      scale: float, causal: str, deterministic: bool = False, window_left: int = -1,
                      window_right: int = -1, softcap: float = 0.0, alibi_slopes: Optional[torch.Tensor] = None,
                      dropout_p: float = 0.0, dropout_rng: Optional[torch.Tensor] = None,
                      varlen_q_rows: Optional[torch.Tensor] = None, varlen_k_rows: Optional[torch.Tensor] = None,
                      varlen_seqs: Optional[torch.Tensor] = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention output and lse. `deterministic` only concerns the backward on CUDA (where dQ
    is otherwise accumulated with atomics); the CPU backward is always deterministic. The
    variants (window, softcap, ALiBi, dropout) have flash-attn's semantics, interface.py
    validates them; `dropout_rng` is the (2,) int64 [seed, offset] on q's device (rng.py).
    varlen_q_rows / varlen_k_rows pack sequences into the one batch of q/k/v (each row's
    sequence, kernels/score_mods.py's Varlen; interface.py builds them from checked offsets)."""
    if q.is_cuda:  # traced callers checked all but the addresses, which exist only now
        check_cuda_addresses(("q", "k", "v"), (q, k, v))
    return _forward(q, k, v, mask, scale, causal, (window_left, window_right), softcap, alibi_slopes, dropout_p,
                    dropout_rng, _seqlens((varlen_q_rows, varlen_k_rows, varlen_seqs)))


def check_cuda_addresses(names, tensors) -> None:
    """The tensor-core kernels load 16-byte rows with cp.async: CUDA tensors must start
    16-byte aligned with strides that are multiples of 8 elements. Under torch.compile the
    traced call checks the strides and the operator the addresses (Dynamo cannot trace them)."""
    for name, x in zip(names, tensors):
        if not _loads_in_16_byte_rows(x, address=not torch.compiler.is_compiling()):
            raise ValueError(f"{name} must be 16-byte aligned with strides that are multiples of 8 "
                             f"elements on CUDA, got strides {x.stride()}")


def _loads_in_16_byte_rows(x: torch.Tensor, address: bool = True) -> bool:
    """Whether the CUDA kernels' 16-byte row loads can read `x` in place: strides that are
    multiples of 8 elements and (where `address`) a 16-byte aligned start."""
    return not (address and x.data_ptr() % 16) and not any(s % 8 for s in x.stride()[:-1])


def _forward(q, k, v, mask, scale, causal, window=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0,
             dropout_rng=None, seqlens=None, flex="", flex_captures=None):
    """The forward; `flex` names traced score/mask programs (register_flex, eager mode only),
    `flex_captures` are their captured tensors."""
    B, H, Lq, _ = q.shape
    Lk = k.shape[2]
    out = torch.empty_like(q)
    lse = torch.empty((B, H, Lq), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        lse.fill_(float("-inf"))
        return out, lse
    if Lk == 0:  # no keys: every query is fully masked
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    spec = spec_for(q, mask, causal, window, softcap, alibi_slopes, dropout_p, flex, seqlens is not None)
    kern = _kernels(spec, q.device)
    mod_args = _mod_args(spec, (B, H, Lq, Lk), mask, window, softcap, alibi_slopes, dropout_p, dropout_rng,
                         flex_captures, seqlens)
    from .schedules.host import SPLIT_MAX_Q

    if "forward_split" in kern and Lq <= SPLIT_MAX_Q:
        _forward_split(kern, q, k, v, out, lse, scale, mod_args)
        return out, lse
    with _on_stream(q.device):
        if _takes_bf16x3(kern, q):
            name = _forward_kernel_name(kern, q, k, family="forward_bf16x3")
            kern[name](q, k, v, out, lse, scale, *mod_args, *_bf16x3_packs(kern, k, v))
        else:
            name = _forward_kernel_name(kern, q, k, window, causal != "none")
            kern[name](q, k, v, out, lse, scale, *mod_args, *_forward_tail_args(kern, q, k, v))
    return out, lse


def _forward_tail_args(kern: dict, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
    """The forward kernels' arguments after the modifiers': on CUDA the SM count (the CTAs a
    persistent forward launches) and the counter its CTAs draw items from
    (schedules/cuda_mma.declare_scheduling_args), on the CPU the AMX forward's packed K and V^T
    where it has them."""
    return (_sm_count(q.device), _item_counter(q.device)) if q.is_cuda else _amx_packs(kern, k, v)


_item_counters: dict = {}
_allocation_streams: dict = {}  # device index -> the stream _item_counter allocates on


def _item_counter(device: torch.device) -> torch.Tensor:
    """A zeroed int32 for the CUDA forward on torch's current stream of `device`: the kernel's
    last CTA to draw from it zeroes it again, and kernels on one stream run in order, so one
    counter a stream is kept (two streams' kernels may run at once). A stream being captured
    into a CUDA graph gets one of its own (its zeroing then replays with the graph)."""
    current = torch._C._cuda_getDevice()
    index = device.index if device.index is not None else current
    with contextlib.nullcontext() if index == current else torch.cuda.device(index):
        capturing = torch.cuda.is_current_stream_capturing()  # (asks of the current device's stream)
    if capturing:
        return torch.zeros(1, dtype=torch.int32, device=device)
    key = (index, torch._C._cuda_getCurrentRawStream(index))
    counter = _item_counters.get(key)
    if counter is None:
        # allocated on a stream of its own: torch.compile's CUDA graph trees route the current
        # stream's allocations into the graphs' pool during their warm-up runs, and a tensor
        # kept there that is no graph output fails the recording ("Detected 1 tensor(s) in the
        # cudagraph pool not tracked as outputs")
        side = _allocation_streams.get(index)
        if side is None:
            side = _allocation_streams[index] = torch.cuda.Stream(device=index)
        with torch.cuda.stream(side):
            counter = _item_counters[key] = torch.zeros(1, dtype=torch.int32, device=device)
        torch.cuda.current_stream(index).wait_stream(side)
    return counter


def _takes_bf16x3(kern: dict, q: torch.Tensor) -> bool:
    """Whether an fp32 forward or backward runs as bf16x3 (schedules/amx_forward.py,
    amx_backward.py: each fp32 operand as two bf16, three products a product, ~17 mantissa
    bits): where the module has those kernels (AMX CPUs) and torch's float32 matmul precision
    is "high" or "medium"
    (torch.set_float32_matmul_precision: "high" allows "the sum of two bfloat16 numbers"; the
    default "highest" keeps the fp32 FMA kernels)."""
    return q.dtype == torch.float32 and "forward_bf16x3" in kern and torch.get_float32_matmul_precision() != "highest"


def _forward_kernel_name(kern: dict, q: torch.Tensor, k: torch.Tensor, window: tuple = (-1, -1),
                         causal: bool = False, family: str = "forward") -> str:
    """CUDA: "forward_short" for short sliding windows where the module has it
    (schedules/cuda_kernels.py). CPU: "<family>_long" (AMX: taller q-blocks) where a kv-head's
    packed K and V^T outgrow a core's L2 (`family` "forward_bf16x3": from AMX_BF16X3_LONG_KEYS
    keys) and there are queries enough to fill its q-blocks. Else `family`."""
    if "forward_short" in kern:
        return _cuda_forward_name(window, causal)
    if f"{family}_long" not in kern:
        return family
    from .schedules.avx512 import AMX_BF16X3_LONG_KEYS, AMX_KV_PAD, AMX_LONG_KV_BYTES, AMX_LONG_MIN_QUERIES

    keys = _amx_padded(k.shape[2], AMX_KV_PAD)
    if family == "forward_bf16x3":
        long_keys = keys >= AMX_BF16X3_LONG_KEYS
    else:
        long_keys = 2 * keys * k.shape[3] * k.element_size() >= AMX_LONG_KV_BYTES
    return f"{family}_long" if long_keys and q.shape[2] >= AMX_LONG_MIN_QUERIES else family


# A sliding window whose q-blocks see at most this many keys on both sides together (left +
# right) walks a few K/V tiles a q-block: the lockstep wgmma forward ("forward_short", in
# windowed modules beside the warp-specialized one) runs it, its CTAs start sooner (no mbarrier
# rings, no register hand-over). Crossovers measured on the H200 (scripts/variants_bench.py's
# "window walks", bf16 D=128, 16k; since masked tiles take their band in two compares a score,
# `cuda_mma.band_offsets`; benchmarks/results/cuda-h200-variants.json): windows (w, w) lockstep
# 1.04-1.06x faster at 128 and 256 keys, 1.00x at 512, 0.96x at 768, 0.90x at 1536; causal
# windows (w, 0) 1.11x at 128, 1.06x at 256, 1.03x at 384, 1.00x at 512, 0.91x at 2048.
# (Before the band: lockstep ahead up to 1536 keys.)
SHORT_WALK_KEYS = 512
SHORT_CAUSAL_WALK_KEYS = 384


def _cuda_forward_name(window: tuple, causal: bool) -> str:
    """"forward_short" for a short window (left, right) (-1: unbounded; a causal call's right
    side ends at the diagonal), else "forward"."""
    left, right = window
    if causal and right < 0:
        right = 0
    limit = SHORT_CAUSAL_WALK_KEYS if causal else SHORT_WALK_KEYS
    return "forward_short" if 0 <= left and 0 <= right and left + right <= limit else "forward"


# Tasks of several kv-heads on dense K/V (the KV cache's always may: they share its page lookups).
# Off: one kv-head a task streams its rows faster (Xeon, bf16 B = 16, H = 32, Hk = 8, Lq = 1,
# same process, three runs, benchmarks/results/cpu-xeon-16core-dense-decode-kv-heads.jsonl: SDPA's
# (B, Hk, L, D) 1.10-1.24x faster at 1k and 4k than tasks of 8; flash-attn's (B, L, Hk, D)
# 0.87-1.10x, no side clear of the noise).
DENSE_KV_HEAD_GROUPS = False


_split_plans: dict = {}


def _forward_split(kern: dict, q, k, v, out, lse, scale, mod_args) -> None:
    """Decode-like calls (few queries) on the CPU: a kv-head's query rows share a task, the keys
    are cut into splits (_cpu_splits) that the threads stream, then the partial results are
    merged (a single split writes out and lse itself). The kernel and the splits depend on the
    shape (`_cpu_split_plan`): looked up once per module, shape and thread count; the partials
    are kept scratch (`_scratch`: made fresh, after the previous call's kernel emptied the
    caches, plan and partials cost a few percent: sdpa B=1 H=16 Lq=1 4k keys, dev box, same
    process, 1.00-1.03x over two runs)."""
    B, H, Lq, D = q.shape
    key = (id(kern), q.shape, k.shape[1], k.shape[2], torch.get_num_threads(), DENSE_KV_HEAD_GROUPS)
    plan = _split_plans.get(key)
    if plan is None or plan[0] is not kern:
        if len(_split_plans) > 32:
            _split_plans.clear()
        split, kv_heads, splits = _cpu_split_plan(kern, "forward_split", B, H, k.shape[1], Lq, k.shape[2],
                                                  kv_head_groups=DENSE_KV_HEAD_GROUPS)
        plan = _split_plans[key] = (kern, split, kv_heads, splits, kern["forward_split_combine"] if splits > 1 else None)
    _, split, kv_heads, splits, combine = plan
    o_part = _scratch("split_o", (B, H, splits, Lq, D), torch.float32)
    lse_part = _scratch("split_lse", (B, H, splits, Lq), torch.float32)
    split(q, k, v, o_part, lse_part, out, lse, scale, *mod_args, kv_heads)
    if combine is not None:
        combine(o_part, lse_part, out, lse)


# CTAs per SM the automatic num_splits of decode_kv_cache aims at, per decode phase (a tuning
# record's <phase>_ctas_per_sm overrides it): one CTA an SM on long pages (no splits at B x Hk
# >= SMs), several on short ones (schedules/cuda_decode.py)
DECODE_CTAS_PER_SM = {"decode": 4, "decode_long": 1}
DECODE_LONG_PAGE = 128  # pages of this many keys or more take the decode_long kernel


def decode_phase(page_size: int) -> str:
    """The CUDA decode kernel (tuning.DECODE_PHASES) for a cache in pages of `page_size` keys (a
    contiguous cache: its capacity)."""
    return "decode_long" if page_size >= DECODE_LONG_PAGE else "decode"


@functools.lru_cache(maxsize=None)
def _decode_spec(dtype, head_dim: int, causal: bool, window: tuple, softcap: bool, alibi: bool) -> tuple:
    """The kv_cache spec of a decode call and its CTAs per SM by decode phase."""
    from .tuning import tuned_knobs

    variants = _variant_names(window, softcap, alibi, False, False)
    spec = AttentionSpec(_TORCH_TO_TVM[dtype], head_dim, "bottom_right" if causal else "none", variants=variants,
                         kv_cache=True)
    knobs = tuned_knobs("cuda", spec)
    return spec, {phase: knobs.get(f"{phase}_ctas_per_sm", n) for phase, n in DECODE_CTAS_PER_SM.items()}


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def cuda_decode_splits(device: torch.device, row_blocks: int, capacity: int, per_sm: int, num_splits: int = 0) -> int:
    """The CUDA decode kernel's splits of a call with `row_blocks` CTAs a split and keys up to
    `capacity`: `num_splits`, or (0) waves of `per_sm` CTAs per SM, the last one full; a split
    has a 16-key tile at least, and there are 256 at most."""
    if num_splits <= 0:
        num_splits = max(1, per_sm * _sm_count(device) // row_blocks)
    return max(1, min(num_splits, -(-capacity // 16), 256))


@dataclasses.dataclass
class DecodePlan:
    """What a decode call's shape fixes. `make_scratch` makes the kernel's scratch arguments
    (split partials; on CUDA also the counters with which the kernel merges its splits, zero
    between launches); `scratch` is the one eager calls keep (None until one makes it), per
    device, stream and shape (CPU: per calling thread): calls on one stream run in order, so
    reuse is safe. `combine`: the CPU's merge of several splits (None: CUDA's kernel merges its
    own, and one split writes the outputs itself); `tail`: the kernel's arguments after the
    modifiers' (on CPUs its kv-heads a task); `check`: the CPU module's index check
    (kernels/decode.cache_check_kernel), its result tensor and a numpy view of that; `append`:
    the module's append kernels by the rotary tables' dtype, with (CPU) the same pair for their
    checks' result (CUDA's kernel does not check: None, None)."""

    spec: AttentionSpec
    kernel: object
    make_scratch: object
    combine: object
    tail: tuple
    scratch: Optional[tuple] = None
    check: Optional[tuple] = None
    append: Optional[tuple] = None


@dataclasses.dataclass
class CacheStep:
    """What a decode step writes before it attends (flash_attn_with_kvcache's k, v and
    rotary): the new tokens `k`, `v` (B, N, Hk, D) or None, the rotary tables `cos`, `sin`
    (Lro, rotary_dim / 2) or None, `interleaved` pairs (else halves), `q_steps` (the queries at
    consecutive positions, else all at the first new one)."""

    k: Optional[torch.Tensor]
    v: Optional[torch.Tensor]
    cos: Optional[torch.Tensor]
    sin: Optional[torch.Tensor]
    interleaved: bool
    q_steps: bool


def _decode_plan(q: torch.Tensor, heads_k: int, page_size: int, capacity: int, causal: bool, window: tuple,
                 softcap: bool, alibi: bool, num_splits: int) -> DecodePlan:
    """The DecodePlan of a call's shape."""
    B, H, Lq, D = q.shape
    spec, per_sm = _decode_spec(q.dtype, D, causal, window, softcap, alibi)
    row_blocks = B * heads_k * -(-(H // heads_k) * Lq // DECODE_ROWS)  # CUDA: a split's CTAs
    phase = decode_phase(page_size) if q.is_cuda else None
    kern = _kernels(spec, q.device)
    if q.is_cuda:
        splits = cuda_decode_splits(q.device, row_blocks, capacity, per_sm[phase], num_splits)
    else:
        split, kv_heads, splits = _cpu_split_plan(kern, "decode", B, H, heads_k, Lq, capacity, num_splits)
    def scratch():
        partials = (torch.empty((B, H, splits, Lq, D), dtype=torch.float32, device=q.device),
                    torch.empty((B, H, splits, Lq), dtype=torch.float32, device=q.device))
        counters = (torch.zeros(row_blocks, dtype=torch.int32, device=q.device),) if q.is_cuda else ()
        return (*partials, *counters)
    appends = {q.dtype: kern["decode_append"], torch.float32: kern.get("decode_append_f32", kern["decode_append"])}
    if q.is_cuda:  # (its append kernel does not check; the plan holds no CUDA tensor: plans made
        # in torch.compile's CUDA graph warm-up would keep allocations of the graphs' pool alive)
        return DecodePlan(spec, kern[phase], scratch, None, (), append=(appends, None, None))
    result, written = torch.empty(2, dtype=torch.int32), torch.empty(3, dtype=torch.int32)
    return DecodePlan(spec, split, scratch, kern["decode_combine"] if splits > 1 else None, (kv_heads,),
                      check=(kern["decode_check"], result, result.numpy()), append=(appends, written, written.numpy()))


_decode_plans: dict = {}


def decode_kv_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    cache_seqlens: torch.Tensor, cache_leftpad: torch.Tensor, new_keys: int, scale: float,
                    causal: bool, window: tuple, softcap: float, alibi_slopes: Optional[torch.Tensor],
                    num_splits: int, check_indices: bool = False, step: Optional[CacheStep] = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-KV decode reading the cache in place (the kv_cache spec's kernels: on CUDA
    schedules/cuda_decode.py, on CPUs kernels/decode.py's split forward): q (B, H, Lq, D) view;
    caches (pages, page_size, Hk, D); block_table (B, max_pages), cache_seqlens and
    cache_leftpad (B,) int32 (views; zero strides broadcast): batch entry b's keys are cache
    positions [cache_leftpad[b], cache_seqlens[b] + new_keys). `num_splits` 0 picks the splits
    from the shape and the device. Returns out (B, Lq, H, D) and lse (B, H, Lq).
    `check_indices` (CPU, eager, block_table's rows contiguous, q not empty): first check the
    tables and lengths in the module's native check (`CacheIndexError` if bad). A `step` (eager,
    the same tables, q not empty): the module's `decode_append` first writes the step's new
    tokens into the cache (`new_keys` counts them) and rotates them and q (`_append_step`; on
    the CPU after the same checks).

    Under torch.compile this is the `tvmflash::decode_kv_cache` operator (fake impl: a
    fullgraph decode step, CUDA graphs); in eager mode the same function without the
    operator's dispatch, which would be a sizeable part of a decode step's host time."""
    args = (q, k_cache, v_cache, block_table, cache_seqlens, cache_leftpad, new_keys, scale, causal, *window,
            softcap, alibi_slopes, num_splits)
    if torch.compiler.is_compiling():
        return decode_kv_cache_op(*args)
    return _decode_kv_cache(*args, kept_scratch=True, check_indices=check_indices, step=step)


class CacheIndexError(ValueError):
    """decode_kv_cache's native check found a bad block table entry or sequence bounds (the
    caller's own check says which)."""


@torch.library.custom_op("tvmflash::decode_kv_cache", mutates_args=())
def decode_kv_cache_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                       cache_seqlens: torch.Tensor, cache_leftpad: torch.Tensor, new_keys: int, scale: float,
                       causal: bool, window_left: int, window_right: int, softcap: float,
                       alibi_slopes: Optional[torch.Tensor], num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`decode_kv_cache` as an operator (its window as two ints). Its scratch is made per call:
    a CUDA graph tree (torch.compile's mode="reduce-overhead") must own every allocation that
    outlives a captured call, and kept scratch would."""
    return _decode_kv_cache(q, k_cache, v_cache, block_table, cache_seqlens, cache_leftpad, new_keys, scale, causal,
                            window_left, window_right, softcap, alibi_slopes, num_splits, kept_scratch=False)


@decode_kv_cache_op.register_fake
def _(q, k_cache, v_cache, block_table, cache_seqlens, cache_leftpad, new_keys, scale, causal, window_left,
      window_right, softcap, alibi_slopes, num_splits):
    B, H, Lq, D = q.shape
    return q.new_empty((B, Lq, H, D)), q.new_empty((B, H, Lq), dtype=torch.float32)


def _decode_kv_cache(q, k_cache, v_cache, block_table, cache_seqlens, cache_leftpad, new_keys, scale, causal,
                     window_left, window_right, softcap, alibi_slopes, num_splits, kept_scratch, check_indices=False,
                     step=None):
    """decode_kv_cache's work. A decode step costs the GPU tens of microseconds, so the host
    path is kept short: what the shape fixes is looked up once per shape and stream
    (`_decode_plan`), with its scratch where `kept_scratch`, else the scratch is made now."""
    window = (window_left, window_right)
    B, H, Lq, D = q.shape
    device = q.device
    cuda = device.type == "cuda"
    out = torch.empty((B, Lq, H, D), dtype=q.dtype, device=device)
    lse = torch.empty((B, H, Lq), dtype=torch.float32, device=device)
    if out.numel() == 0:  # no rows: nothing to launch (an empty CUDA grid is an error)
        return out, lse
    # the raw handle of torch's current stream (torch.cuda.current_stream builds an object: 3 us)
    stream = torch._C._cuda_getCurrentRawStream(device.index) if cuda else threading.get_ident()
    capacity = block_table.shape[1] * k_cache.shape[1]  # keys of the longest possible sequence
    key = (q.shape, q.dtype, device, k_cache.shape[1:3], capacity, causal, window, softcap > 0,
           alibi_slopes is not None, num_splits, stream)
    plan = _decode_plans.get(key)
    if plan is None:
        if len(_decode_plans) > 32:  # (each holds its split partials: a few MB at most)
            _decode_plans.clear()
        plan = _decode_plans[key] = _decode_plan(q, k_cache.shape[2], k_cache.shape[1], capacity, causal, window,
                                                 softcap > 0, alibi_slopes is not None, num_splits)
    if step is not None:
        q = _append_step(plan, step, q, k_cache, v_cache, block_table, cache_seqlens, cache_leftpad, new_keys, capacity)
    elif check_indices:
        check, result, seen = plan.check
        check(block_table, cache_seqlens, cache_leftpad, new_keys, capacity, k_cache.shape[0], result)
        if seen[0] >= 0 or seen[1]:
            raise CacheIndexError("bad cache indices")
    if not kept_scratch:
        scratch = plan.make_scratch()
    elif plan.scratch is None:
        scratch = plan.scratch = plan.make_scratch()
    else:
        scratch = plan.scratch
    spec, decode, combine, tail = plan.spec, plan.kernel, plan.combine, plan.tail
    mod_args = _mod_args(spec, (B, H, Lq, capacity), None, window, softcap, alibi_slopes) if spec.variants else ()
    with _on_stream(device):
        # on CUDA one launch: the kernel merges its splits (o_part, lse_part, counters) into out, lse
        out_bhld = out.transpose(1, 2)
        decode(q, k_cache, v_cache, block_table, cache_seqlens, cache_leftpad, new_keys, scratch[0], scratch[1],
               out_bhld, lse, *scratch[2:], scale, *mod_args, *tail)
        if combine is not None:
            combine(*scratch[:2], out_bhld, lse)
    return out, lse


def _append_step(plan: DecodePlan, step: CacheStep, q, k_cache, v_cache, block_table, cache_seqlens, cache_leftpad,
                 new_keys: int, capacity: int) -> torch.Tensor:
    """A decode step's writes in one native call (kernels/decode.py's `decode_append` on CPUs:
    the checks, then the writes; schedules/cuda_decode.py's on CUDA): the new tokens into the
    cache, rotated where the step has rotary tables; returns q (B, H, Lq, D) as the step attends
    with it (rotated: a new tensor)."""
    appends, result, seen = plan.append
    B, H, Lq, D = q.shape
    queries = q.transpose(1, 2)  # (B, Lq, H, D), as the caller gave it
    k, v = (step.k, step.v) if step.k is not None else (_no_tokens(B, k_cache.shape[2], D, q.dtype, q.device),) * 2
    if step.cos is None:
        rotary, rotated = ROTARY_NONE, queries
        cos = sin = _no_rotary_table(q.device)
    else:
        rotary = ROTARY_INTERLEAVED if step.interleaved else ROTARY_HALVES
        rotated = torch.empty_like(queries, memory_format=torch.contiguous_format)
        cos, sin = step.cos, step.sin
        if cos.dtype not in appends or sin.dtype != cos.dtype:
            cos, sin = cos.float(), sin.float()
        cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (cos, sin))
    if result is None:
        result = _unread_result(q.device)
    with _on_stream(q.device):
        appends[cos.dtype](block_table, cache_seqlens, cache_leftpad, new_keys - k.shape[1], capacity, k_cache.shape[0],
                           result, k, v, k_cache, v_cache, queries, rotated, cos, sin, rotary, int(step.q_steps))
    if seen is not None and (seen[0] >= 0 or seen[1] or seen[2]):
        raise CacheIndexError("bad cache indices")
    return rotated.transpose(1, 2)


@functools.lru_cache(maxsize=16)
def _no_tokens(batch: int, heads_k: int, head_dim: int, dtype, device) -> torch.Tensor:
    """An empty (batch, 0, heads_k, head_dim) tensor: the new tokens of a step with none."""
    return torch.empty((batch, 0, heads_k, head_dim), dtype=dtype, device=device)


@functools.lru_cache(maxsize=4)
def _unread_result(device) -> torch.Tensor:
    """The CUDA append kernel's `result` argument, which it never writes."""
    return torch.empty(3, dtype=torch.int32, device=device)


@functools.lru_cache(maxsize=4)
def _no_rotary_table(device) -> torch.Tensor:
    """A (1, 1) float32 table: the rotary tables of a step without rotary (never read)."""
    return torch.zeros((1, 1), dtype=torch.float32, device=device)


def _split_kernel(kern: dict, name: str, rows_per_kv_head: int) -> tuple:
    """(kernel, query rows a task, the most kv-heads a task) of the split-KV forward `name` for
    `rows_per_kv_head` query rows (a kv-head's heads x queries): its one-row variant (`name`_row,
    CPU modules) for one row (MHA decode), its AMX variant (`name`_tiles, bf16 on AMX CPUs:
    SPLIT_AMX_ROWS rows of one kv-head a task) for more than SPLIT_BLOCK_ROWS, else `name` (zmm
    FMAs, SPLIT_BLOCK_ROWS rows of up to SPLIT_MAX_KV_HEADS kv-heads a task).
    Xeon, bf16 B = 16, H = 32, Hk = 8, D = 128, same process: 4 rows (Lq = 1) 1.09-1.20x faster
    on FMAs than on tiles; 16 rows (Lq = 4) 2.6-3.2x faster on tiles, 64 rows (Lq = 16)
    2.8-3.2x (benchmarks/results/cpu-xeon-16core-decode-tiles.jsonl)."""
    from .schedules.host import SPLIT_AMX_ROWS, SPLIT_BLOCK_ROWS, SPLIT_MAX_KV_HEADS

    if rows_per_kv_head == 1:
        return kern.get(f"{name}_row", kern[name]), SPLIT_BLOCK_ROWS, SPLIT_MAX_KV_HEADS
    if rows_per_kv_head > SPLIT_BLOCK_ROWS and f"{name}_tiles" in kern:
        return kern[f"{name}_tiles"], SPLIT_AMX_ROWS, 1
    return kern[name], SPLIT_BLOCK_ROWS, SPLIT_MAX_KV_HEADS


def _cpu_split_plan(kern: dict, name: str, B: int, H: int, Hk: int, Lq: int, keys: int, requested: int = 0,
                    kv_head_groups: bool = True) -> tuple:
    """(kernel, kv-heads a task, splits) of a CPU split-KV call of `name`: `_split_kernel`,
    `_task_kv_heads` (one without `kv_head_groups`), `_cpu_splits` (`requested` splits, 0:
    automatic)."""
    split, rows, most_kv_heads = _split_kernel(kern, name, H // Hk * Lq)
    kv_heads = _task_kv_heads(B, H, Hk, Lq, rows, most_kv_heads) if kv_head_groups else 1
    return split, kv_heads, _cpu_splits(B, H, Hk, Lq, keys, requested, rows, kv_heads)


def _split_tasks(B: int, H: int, Hk: int, Lq: int, task_rows: int, task_kv_heads: int) -> int:
    """Tasks of the CPU split-KV forward before the keys are split: (batch, group of
    `task_kv_heads` kv-heads, block of `task_rows` of each kv-head's query rows)."""
    return B * -(-Hk // task_kv_heads) * -(-(H // Hk) * Lq // task_rows)


def _task_kv_heads(B: int, H: int, Hk: int, Lq: int, task_rows: int, most: int) -> int:
    """kv-heads a task of the CPU split-KV forward takes: the most (a power of two up to `most`)
    with which the tasks still fill the threads before the keys are split, else 1. Whole token
    rows read faster, but fewer tasks mean more splits of fewer keys, each with its own first
    block, read without prefetch (Xeon, bf16 D = 128, Lq = 1, same process,
    benchmarks/results/cpu-xeon-16core-decode-kv-heads.jsonl: B = 16, Hk = 8, tasks of 8
    kv-heads 1.04-1.09x faster at 4k-16k; B = 1, 1 / 2 tasks of 8: 0.77-0.89x at 4k)."""
    threads = torch.get_num_threads()
    heads = most
    while heads > 1 and _split_tasks(B, H, Hk, Lq, task_rows, heads) < threads:
        heads //= 2
    return heads


def _cpu_splits(B: int, H: int, Hk: int, Lq: int, keys: int, requested: int = 0, task_rows: int = 4,
                task_kv_heads: int = 1) -> int:
    """Key splits of the CPU split-KV forward: `requested`, or (0) enough for a task per thread
    (a task: `task_rows` of the query rows of each of `task_kv_heads` kv-heads, `_split_kernel`)
    and at most SPLIT_TASK_KEYS keys a task; at most one split per kv-block of `keys`. (Xeon,
    bf16 D = 128, Lq = 1, same process: B = 16, 16 tasks of 8 kv-heads, one split at 1k 1.04-1.07x
    faster than two, 4 splits 0.96-0.97x; B = 1, 8 tasks: 2 splits as fast as 4 at 1k, 1.00-1.06x
    at 4k; cpu-xeon-16core-decode-kv-heads.jsonl.)"""
    from .schedules.host import SPLIT_BLOCK_K, SPLIT_TASK_KEYS

    if requested <= 0:
        tasks = _split_tasks(B, H, Hk, Lq, task_rows, task_kv_heads)
        requested = max(-(-torch.get_num_threads() // tasks), -(-keys // SPLIT_TASK_KEYS))
    return max(1, min(requested, -(-keys // SPLIT_BLOCK_K)))


def _amx_padded(length: int, pad: int) -> int:
    """Rows of an AMX operand pack: `length` rounded up to a multiple of `pad` (AMX_KV_PAD)."""
    return -(-length // pad) * pad


def _amx_packs(kern: dict, k: torch.Tensor, v: torch.Tensor) -> tuple:
    """The AMX forward's operands: K (zero-padded keys) and V^T packed once per call. K needs
    no copy when its keys fill whole padded lengths and its rows do not crowd an L1 set
    (`_rows_crowd_an_l1_set`): the tile loads take its row stride."""
    if "forward_pack" not in kern:
        return ()
    from .schedules.avx512 import AMX_KV_PAD as pad

    B, Hk, Lk, D = k.shape
    Lp = _amx_padded(Lk, pad)
    vt = _scratch("vt", (B, Hk, D, Lp), v.dtype, tile_rows=True)
    if Lp == Lk and "forward_pack_vt" in kern and not _rows_crowd_an_l1_set(k.stride(2) * k.element_size()):
        kern["forward_pack_vt"](v, vt)
        return k, vt
    kp = _scratch("kp", (B, Hk, Lp, D), k.dtype)
    kern["forward_pack"](k, v, kp, vt)
    return kp, vt


def _bf16x3_packs(kern: dict, k: torch.Tensor, v: torch.Tensor) -> tuple:
    """The bf16x3 forward's operands from fp32 K and V (amx_forward.forward_amx_pack_kernel):
    K's rows as [hi | hi | lo], V^T's rows as each kv block's [hi | hi | lo]."""
    from .schedules.avx512 import AMX_KV_PAD as pad
    from .schedules.avx512 import SPLIT_SEGMENTS as S

    B, Hk, Lk, D = k.shape
    Lp = _amx_padded(Lk, pad)
    kp = _scratch("kp_bf16x3", (B, Hk, Lp, S * D), torch.bfloat16)
    vt = _scratch("vt_bf16x3", (B, Hk, D, S * Lp), torch.bfloat16, tile_rows=True)
    kern["forward_pack_bf16x3"](k, v, kp, vt)
    return kp, vt


@functools.lru_cache(maxsize=64)
def _rows_crowd_an_l1_set(row_bytes: int, rows: int = 16) -> bool:
    """Whether more than half of `rows` rows `row_bytes` apart (a tile load's) fall into one L1
    set (x86 L1D: 64 sets of 64-byte lines, 12 ways on Sapphire Rapids). flash_attn_func's
    (B, L, H, D) layout puts a head's keys H x D x 2 bytes apart: at H = 16, D = 128 (4 KB)
    all 16 rows of a K tile share a set. Xeon (16 threads, bf16 H = 16, L = 1024 / 4096,
    flash_attn_func): K read in place 2.80 / 35.5 ms, copied into the pack 2.61 / 32.1 ms;
    at D = 64 (two sets of 8 rows) 1.55 against 1.54 ms: kept in place."""
    sets = Counter(row * row_bytes // 64 % 64 for row in range(rows))
    return max(sets.values()) > rows // 2


_scratch_buffers = threading.local()


def _scratch(name: str, shape: tuple, dtype, tile_rows: bool = False) -> torch.Tensor:
    """A CPU scratch tensor that lives only during one call (AMX operand packs, dQ^T), kept per
    thread and reused while the shape stays: fresh tens of MB a call cost more in page faults
    than the packing itself (about 25 ms a forward on the Xeon VM at L=4096, H=16). One
    buffer per name and thread: memory stays bounded by the last call's sizes. `tile_rows`:
    rows (a tile operand's, read 16 at a time) 64 bytes longer than `shape` says, since rows a
    power of two of bytes apart would all fall into one L1 cache set."""
    buffers = _scratch_buffers.__dict__
    extra = 64 // torch.empty((), dtype=dtype).element_size() if tile_rows else 0
    full = shape[:-1] + (shape[-1] + extra,)
    buf = buffers.get(name)
    if buf is None or buf.shape != full or buf.dtype != dtype:
        buf = buffers[name] = torch.empty(full, dtype=dtype)
    return buf[..., :shape[-1]] if extra else buf


@attention_forward.register_fake
def _(q, k, v, mask, scale, causal, deterministic=False, window_left=-1, window_right=-1, softcap=0.0,
      alibi_slopes=None, dropout_p=0.0, dropout_rng=None, *seqlens):
    B, H, Lq, _ = q.shape
    return torch.empty_like(q), q.new_empty((B, H, Lq), dtype=torch.float32)


def backward_plan(batch: int, heads_k: int) -> str:
    """"fused" (one task per (batch, kv-head), 5 matmuls) when those tasks fill the threads
    evenly, else "split" (kv-block tasks + q-block tasks, 7 matmuls, always parallel enough).
    TVMFLASH_BACKWARD=fused|split overrides (benchmarks, tests)."""
    forced = os.environ.get("TVMFLASH_BACKWARD", "auto")
    if forced in ("fused", "split"):
        return forced
    tasks, threads = batch * heads_k, torch.get_num_threads()
    return "fused" if tasks >= threads and (tasks % threads == 0 or tasks >= 4 * threads) else "split"


@torch.library.custom_op("tvmflash::attention_backward", mutates_args=())
def attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, dlse: Optional[torch.Tensor],
                       mask: Optional[torch.Tensor], scale: float, causal: str,
                       deterministic: bool = False, window_left: int = -1, window_right: int = -1,
                       softcap: float = 0.0, alibi_slopes: Optional[torch.Tensor] = None,
                       dropout_p: float = 0.0, dropout_rng: Optional[torch.Tensor] = None,
                       varlen_q_rows: Optional[torch.Tensor] = None, varlen_k_rows: Optional[torch.Tensor] = None,
                       varlen_seqs: Optional[torch.Tensor] = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of q, k, v. `dlse` (a gradient flowing into the returned lse) enters through
    dS = P * (dP - delta + dlse): it is folded into delta."""
    return _backward(dout, q, k, v, out, lse, dlse, mask, scale, causal, deterministic,
                     (window_left, window_right), softcap, alibi_slopes, dropout_p, dropout_rng,
                     _seqlens((varlen_q_rows, varlen_k_rows, varlen_seqs)))


def _backward(dout, q, k, v, out, lse, dlse, mask, scale, causal, deterministic, window=(-1, -1), softcap=0.0,
              alibi_slopes=None, dropout_p=0.0, dropout_rng=None, seqlens=None, flex="", flex_captures=None):
    B, H, Lq, _ = q.shape
    Lk = k.shape[2]
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if Lq == 0 or Lk == 0 or q.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    # fresh copies where the kernels cannot read them in place (CUDA: they load 16-byte rows, as
    # of q, k, v; contiguous() would return a contiguous but misaligned view as it is). `out` is
    # the forward's own unless the operator was called directly
    dout, out = (x if x.stride(-1) == 1 and (not x.is_cuda or _loads_in_16_byte_rows(x))
                 else x.clone(memory_format=torch.contiguous_format) for x in (dout, out))
    spec = spec_for(q, mask, causal, window, softcap, alibi_slopes, dropout_p, flex, seqlens is not None)
    kern = _kernels(spec, q.device)
    mod_args = _mod_args(spec, (B, H, Lq, Lk), mask, window, softcap, alibi_slopes, dropout_p, dropout_rng,
                         flex_captures, seqlens)
    if q.device.type == "cuda":
        _backward_cuda(kern, dout, q, k, v, out, lse, dlse, mod_args, scale, deterministic, dq, dk, dv)
        return dq, dk, dv
    _backward_cpu(kern, dout, q, k, v, out, lse, dlse, mod_args, scale, dq, dk, dv)
    return dq, dk, dv


def _backward_cpu(kern, dout, q, k, v, out, lse, dlse, mod_args, scale, dq, dk, dv):
    """delta; then the fused or the split plan (backward_plan), on AMX packs where the module
    has them."""
    B, H, Lq, _ = q.shape
    delta = torch.empty((B, H, Lq), dtype=torch.float32, device=q.device)
    kern["backward_delta"](out, dout, delta)
    if dlse is not None:
        delta.sub_(dlse)
    inputs = (q, k, v, dout, lse, delta)
    family = "backward_bf16x3" if _takes_bf16x3(kern, q) else "backward"
    packs = _amx_backward_packs(kern, q, k, v, dout, family)
    if backward_plan(B, k.shape[1]) == "fused":
        # fp32 dQ scratch: (B, H, D, Lq padded) = dQ^T on the AMX path, else dQ's shape
        dq_acc = _scratch("dq_acc", (B, H, q.shape[3], packs[3].shape[3]), torch.float32, tile_rows=True) if packs \
            else _scratch("dq_acc", tuple(q.shape), torch.float32)
        kern[f"{family}_fused"](*inputs, dk, dv, dq, dq_acc, scale, *mod_args, *packs)
    else:
        kern[f"{family}_dkdv"](*inputs, dk, dv, scale, *mod_args, *packs)
        kern[f"{family}_dq"](*inputs, dq, scale, *mod_args, *packs)


def _amx_backward_packs(kern: dict, q, k, v, dout, family: str = "backward") -> tuple:
    """The AMX backward's operands (schedules/amx_backward.py): K, V, K^T rows and Q, dO as
    VNNI pairs over the head dim and over queries, zero-padded; built once per call. `family`
    "backward_bf16x3": fp32 inputs' bf16x3 packs, each SPLIT_SEGMENTS times as long along its
    GEMM's contraction (amx_backward.Packs)."""
    pack = "backward_pack_bf16x3" if family == "backward_bf16x3" else "backward_pack"
    if pack not in kern:
        return ()
    from .schedules.avx512 import AMX_KV_PAD as pad
    from .schedules.avx512 import SPLIT_SEGMENTS

    S = SPLIT_SEGMENTS if family == "backward_bf16x3" else 1
    B, H, Lq, D = q.shape
    Hk, Lk = k.shape[1], k.shape[2]
    Lqp, Lkp = _amx_padded(Lq, pad), _amx_padded(Lk, pad)
    rows = [_scratch(f"bwd_rows{i}", (B, Hk, Lkp, S * D), torch.bfloat16) for i in range(2)]
    kt = _scratch("bwd_kt", (B, Hk, D, S * Lkp), torch.bfloat16, tile_rows=True)
    over_d = [_scratch(f"bwd_over_d{i}", (B, H, S * D // 2, Lqp), torch.uint32, tile_rows=True) for i in range(2)]
    over_q = [_scratch(f"bwd_over_q{i}", (B, H, S * Lqp // 2, D), torch.uint32) for i in range(2)]
    packs = (*rows, kt, *over_d, *over_q)
    kern[pack](q, k, v, dout, *packs)
    return packs


def _backward_cuda(kern, dout, q, k, v, out, lse, dlse, mod_args, scale, deterministic, dq, dk, dv):
    """delta and lse * log2(e) per query; then dK/dV with dQ accumulated by fp32 atomics and
    converted, or (deterministic) dK/dV and a separate dQ kernel without atomics."""
    delta, lse2 = torch.empty_like(lse), torch.empty_like(lse)
    dq_acc = None if deterministic else torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    with _on_stream(q.device):
        kern["backward_prep"](out, dout, lse, delta, lse2)
        if dlse is not None:
            delta.sub_(dlse)
        if deterministic:
            kern["backward_dkdv"](q, k, v, dout, lse2, delta, dk, dv, scale, *mod_args)
            kern["backward_dq"](q, k, v, dout, lse2, delta, dq, scale, *mod_args)
        else:
            kern["backward_dkdv_dq"](q, k, v, dout, lse2, delta, dk, dv, dq_acc, scale, *mod_args)
            kern["backward_dq_convert"](dq_acc, dq, scale)


@attention_backward.register_fake
def _(dout, q, k, v, out, lse, dlse, mask, scale, causal, deterministic=False, window_left=-1, window_right=-1,
      softcap=0.0, alibi_slopes=None, dropout_p=0.0, dropout_rng=None, *seqlens):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


# window_left, window_right, softcap, alibi_slopes, dropout_p, dropout_rng, seqlens, flex, flex_captures
_NO_VARIANT = (-1, -1, 0.0, None, 0.0, None, None, "", None)
_NO_SEQLENS = (None,) * 3  # varlen_q_rows, varlen_k_rows, varlen_seqs: the operators' arguments
_NO_GRADS = (None,) * (4 + len(_NO_VARIANT))  # mask, scale, causal, deterministic, variants


def _setup_context(ctx, inputs, output, flex="", flex_captures=None):
    """Saves what the backward needs; `inputs` are attention_forward's (flex is eager only)."""
    q, k, v, mask, scale, causal, deterministic, window_left, window_right, softcap, alibi_slopes, dropout_p, \
        dropout_rng, *seqlens = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, mask, alibi_slopes, dropout_rng, *seqlens, *(flex_captures or ()))
    ctx.scale, ctx.causal, ctx.deterministic = scale, causal, deterministic
    ctx.window, ctx.softcap, ctx.dropout_p, ctx.flex = (window_left, window_right), softcap, dropout_p, flex


def _saved(ctx):
    """(q, k, v, out, lse, mask, alibi_slopes, dropout_rng, seqlens or None, flex captures)."""
    *saved, = ctx.saved_tensors
    n = 8 + len(_NO_SEQLENS)
    return (*saved[:8], _seqlens(saved[8:n]), saved[n:])


def _gradients(ctx, dout, dlse):
    q, k, v, out, lse, mask, alibi_slopes, dropout_rng, seqlens, _ = _saved(ctx)
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, dlse, mask, ctx.scale, ctx.causal,
                                    ctx.deterministic, *ctx.window, ctx.softcap, alibi_slopes, ctx.dropout_p,
                                    dropout_rng, *(seqlens or _NO_SEQLENS))
    # the operator has no seqlens-list / flex / flex_captures arguments (the eager path's last
    # three): its tables come as the _NO_SEQLENS tensors instead
    return dq, dk, dv, *_NO_GRADS[:-3], *_NO_SEQLENS


def _seqlens(saved) -> Optional[list]:
    """The packed-sequence tensors as `seqlens` (None when there are none)."""
    return None if saved[0] is None else list(saved)


attention_forward.register_autograd(_gradients, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """The eager-mode path of `attention`: the operators' implementations without their dispatch."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scale, causal, deterministic, *variant):
        window_left, window_right, softcap, alibi_slopes, dropout_p, dropout_rng, seqlens, flex, flex_captures = variant
        out, lse = _forward(q, k, v, mask, scale, causal, (window_left, window_right), softcap, alibi_slopes,
                            dropout_p, dropout_rng, seqlens, flex, flex_captures)
        _setup_context(ctx, (q, k, v, mask, scale, causal, deterministic, *variant[:6], *(seqlens or _NO_SEQLENS)),
                       (out, lse), flex, flex_captures)
        ctx.set_materialize_grads(False)  # no zero dlse to fold into delta when lse is unused
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, mask, alibi_slopes, dropout_rng, seqlens, flex_captures = _saved(ctx)
        if dout is None:  # only lse was used
            dout = torch.zeros_like(out)
        dq, dk, dv = _backward(dout, q, k, v, out, lse, dlse, mask, ctx.scale, ctx.causal, ctx.deterministic,
                               ctx.window, ctx.softcap, alibi_slopes, ctx.dropout_p, dropout_rng, seqlens, ctx.flex,
                               flex_captures)
        return dq, dk, dv, *_NO_GRADS
