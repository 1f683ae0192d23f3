"""Dropout on the attention probabilities, in the kernels: O = (P * Z) V / l with Z = keep / (1 - p)
and l the row sum of the undropped P (flash-attn's semantics); the backward uses dV = (P Z)^T dO
and dS = P (dP Z - delta), delta = rowsum(dO * O) being unchanged.

The keep decision is `tvmflash.rng`'s Philox function of (seed, offset, b, h, i, j), so forward
and backward (and `rng.keep_mask`) agree without storing a mask. Runtime arguments: `dropout_p`
(fp32) and `dropout_rng`, a (2,) int64 [seed, offset] tensor on the kernel's device (drawn from
torch's generator on that device: no host sync, CUDA-graph safe).

`Dropout` rides in the spec's modifier list, so it declares its arguments like the score
modifiers, but it changes probabilities, not scores: `ScorePipeline.dropout` holds the bound
form, and the kernels call `dropout_tile` (s_tir) or the fragment helpers in
schedules/cuda_mma.py where they have P.
"""
from __future__ import annotations

from dataclasses import dataclass

from tvm import tirx
from tvm.script import tirx as T
from tvm.script.ir_builder import tirx as irb

from .. import rng
from .common import F32, KernelArgs, Shape

U32, U64 = "uint32", "uint64"


def _u32(value: int):
    return tirx.const(value, U32)


def philox_ops(lanes: int = 1) -> rng.Ops:
    """rng.Ops on TIR uint32 values of `lanes` lanes; every round's words are bound once (they
    are used more than once). The wrapping arithmetic goes through 64-bit values cast back to
    32 bits, which cannot overflow: TVM's LLVM codegen marks uint32 multiplies and adds
    no-unsigned-wrap, and LLVM miscompiled the 16-lane Philox from that promise (from its
    third round). The low word is the product masked (binding the product instead let TVM's
    IntSetAnalyzer cast the product's range to uint32 and fail, on CUDA); there the product is
    one mul.wide.u32, both words."""
    u32, u64 = (U32, U64) if lanes == 1 else (f"{U32}x{lanes}", f"{U64}x{lanes}")

    def const(value: int):
        c = tirx.const(value, U64)
        return c if lanes == 1 else tirx.Broadcast(c, lanes)

    def mulhilo(a, m):
        prod = tirx.Cast(u64, a) * const(m)
        return tirx.Cast(u32, prod >> const(32)), tirx.Cast(u32, prod & const(rng.MASK32))

    return rng.Ops(mulhilo=mulhilo, add=lambda a, m: tirx.Cast(u32, tirx.Cast(u64, a) + const(m)), bind=irb.bind)


TIR_OPS = philox_ops()


@dataclass(frozen=True)
class Dropout:
    """Spec entry of the dropout variant (frozen: part of the hashable spec)."""

    arg_names = ("dropout_p", "dropout_rng")
    is_mask = False
    unit_grad = True

    def bind(self, args: KernelArgs, shape: Shape) -> "BoundDropout":
        return BoundDropout(args.scalar("dropout_p"), args.tensor("dropout_rng", (2,), "int64"), shape)


@dataclass(frozen=True)
class BoundDropout(Dropout):
    p: tirx.Var
    seed: tirx.Buffer
    shape: Shape

    @property
    def scale(self):
        """1 / (1 - p): the factor of kept probabilities."""
        return tirx.const(1.0, F32) / (tirx.const(1.0, F32) - self.p)

    def threshold(self):
        """16-bit uniforms below this are kept (rng.keep_threshold in TIR)."""
        keep = (tirx.const(1.0, F32) - self.p) * tirx.const(float(1 << rng.UNIFORM_BITS), F32)
        return tirx.Cast(U32, tirx.round(keep))

    def words(self, b, h, i, j) -> list:
        """The four words of the Philox call of score (i, j) of (b, h); emits their bindings
        into the statement being built (call from kernel code: a macro or a block body)."""
        I, J, _ = rng.call_of(i, j)
        seed = self.seed[tirx.const(0, "int64")]
        counter = [tirx.Cast(U32, J), tirx.Cast(U32, I), tirx.Cast(U32, b * self.shape.heads + h),
                   tirx.Cast(U32, self.seed[tirx.const(1, "int64")])]
        key = [tirx.Cast(U32, seed), tirx.Cast(U32, seed >> tirx.const(32, "int64"))]
        return rng.philox(counter, key, TIR_OPS)

    def factor(self, words, slot):
        """Z of the score whose uniform is `slot` (int or expression) of `words`."""
        word = tirx.Select(slot // 2 < 2, tirx.Select(slot // 2 == 0, words[0], words[1]),
                           tirx.Select(slot // 2 == 2, words[2], words[3]))
        return self.word_factor(word, slot % 2)

    def word_factor(self, word, half):
        """Z of the score whose uniform is half `half` (0: low 16 bits) of `word`: 1 / (1 - p)
        if kept, else 0."""
        uniform = (word >> (tirx.Cast(U32, half) * _u32(rng.UNIFORM_BITS))) & _u32((1 << rng.UNIFORM_BITS) - 1)
        return tirx.Select(uniform < self.threshold(), self.scale, tirx.const(0.0, F32))


def check_dropout_blocks(spec, block_q: int, block_k: int) -> None:
    """The Philox grouping (rng.call_of) needs query blocks of a multiple of 16 rows, key
    blocks of 32."""
    if "dropout" in spec.variants and (block_q % 16 or block_k % 32):
        raise ValueError(f"dropout needs query blocks that are multiples of 16 and key blocks of 32, "
                         f"got {block_q} x {block_k}")


def dropout_buffers(spec, block_q: int, block_k: int, transposed: bool):
    """Shapes of a tile's dropout scratch: the Philox words (4, calls along the tile's outer
    axis, calls along its inner axis) and a tile of factors; 1-element stand-ins without dropout."""
    if "dropout" not in spec.variants:
        return (1, 1, 1), (1, 1)
    calls = (block_k // 4, block_q // 2) if transposed else (block_q // 2, block_k // 4)
    return (4, *calls), ((block_k, block_q) if transposed else (block_q, block_k))


@T.inline
def dropout_tile(drop, words, dst, src, b, h, q0, k0, block_q, block_k, transposed):
    """Dropout factors Z of the block_q x block_k scores from (q0, k0) (multiples of 16 and
    32) into `dst` (S^T, [key][query], if `transposed`, else [query][key]), or `src` * Z where
    `src` is a tile (never in place: s_tir schedules need blocks free of write-after-read).
    First one "philox" block instance per call (its four words into `words`, shaped by
    `dropout_buffers`), then an element-wise "dropout" block picks each score's uniform."""
    n_i, n_j = T.meta_var((block_q // 2, block_k // 4))  # calls along queries, keys
    for c_out, c_in in T.grid(n_j if transposed else n_i, n_i if transposed else n_j):
        with T.sblock("philox"):
            vo, vn = T.axis.remap("SS", [c_out, c_in])
            ci, cj = T.meta_var((vn, vo) if transposed else (vo, vn))
            w = T.meta_var(drop.words(b, h, q0 + ci // 8 * 16 + ci % 8, k0 + cj // 8 * 32 + cj % 8))
            words[0, vo, vn] = w[0]
            words[1, vo, vn] = w[1]
            words[2, vo, vn] = w[2]
            words[3, vo, vn] = w[3]
    for r, c in T.grid(block_k if transposed else block_q, block_q if transposed else block_k):
        with T.sblock("dropout"):
            vr, vc = T.axis.remap("SS", [r, c])
            i, j = T.meta_var((vc, vr) if transposed else (vr, vc))
            ci, cj, slot = T.meta_var(rng.call_of(i, j))  # q0, k0 are multiples of 16, 32
            word = T.meta_var(words[slot // 2, cj, ci] if transposed else words[slot // 2, ci, cj])
            if src is None:
                dst[vr, vc] = drop.word_factor(word, slot % 2)
            else:
                dst[vr, vc] = src[vr, vc] * drop.word_factor(word, slot % 2)
