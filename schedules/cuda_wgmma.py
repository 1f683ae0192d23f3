"""Building blocks of the Hopper (sm_90a) kernels: warpgroup tensor-core GEMMs (`wgmma`) on
shared-memory tiles in the 128-byte-swizzled layout wgmma reads, filled by `cp.async`.

Shared-memory tiles (`copy_rows_sw128`): a tile of R rows x W columns (W a multiple of 64
16-bit elements) is stored as W/64 column blocks of R rows x 128 bytes; in each row the 16-byte
chunk c sits at position c ^ (row % 8), the hardware's 128B swizzle, so both the copies and
wgmma's reads are free of bank conflicts. Tiles start at multiples of 1024 bytes.

Matrix descriptors (PTX ISA "matrix descriptor format"): start address, leading and stride byte
offsets (16-byte units), swizzle mode. One base descriptor per layout is encoded for the pool
start; a sub-tile's descriptor is the base plus its byte offset / 16 (the address field is the
low 14 bits and never overflows for shared memory).
- K-major operand (Q or K of S = Q K^T, rows of 64-element column blocks): 8-row groups are
  1024 bytes apart (stride offset); a k16 step moves 32 bytes inside the row, a 64-column step
  moves to the next column block.
- MN-major operand (V of O = P V, read "transposed"): the 64-column blocks are R*128 bytes
  apart (leading offset), 8-row groups 1024 bytes (stride); a k16 step moves 16 rows.

Accumulator fragments (m64nNk16, f32): warp w of the warpgroup holds rows 16w + g and
16w + g + 8 (g = lane/4), columns 8j + 2(lane%4) (+1) at acc[4j .. 4j+3] -- the mma.sync m16n8
layout per warp, so the register softmax of the Ampere kernel applies unchanged, and two n8
tiles of P converted to 16 bits are the A fragment of one k16 step of the register-A form.
"""
from __future__ import annotations

from tvm.backend.cuda.codegen.registry import CODEGEN_REGISTRY, register_codegen
from tvm.script import tirx as T

SWIZZLE_128B = 3  # CUtensorMapSwizzle numbering, as TVM's descriptor encoder takes it
ATOM_BYTES = 1024


@register_codegen("cuda_wgmma_noop_barrier")
def _noop_barrier(reg):
    # TVM 0.27.0.post1's own version reads `reg.dtype`; buffer loads expose `.ty` now
    res = CODEGEN_REGISTRY["tirx.cuda_wgmma_noop_barrier_" + str(reg.ty)]([reg])
    return res[0] if isinstance(res, tuple) else res


def wgmma_op(dtype: str, n: int) -> str:
    ab = {"float16": "f16", "bfloat16": "bf16"}[dtype]
    return f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ab}.{ab}"


@T.inline
def _copy_rows_sw128(pool, base, src, b, head, row0, nrows, limit, width, tid, nthreads, edge):
    for it in T.unroll((nrows * width // 8 + nthreads - 1) // nthreads):
        c = T.meta_var(tid + it * nthreads)
        r = T.meta_var(c // (width // 8))
        cc = T.meta_var(c % (width // 8))
        row = T.meta_var(row0 + r)
        if nrows * width // 8 % nthreads == 0 or c < nrows * width // 8:
            T.ptx["cp.async.cg.shared.global"](
                pool.ptr_to([base + cc // 8 * (nrows * 64) + r * 64 + T.bitwise_xor(cc % 8, r % 8) * 8]),
                src.ptr_to([b, head, T.min(row, limit - 1) if edge else row, cc * 8]),
                16, T.Select(row < limit, T.uint32(16), T.uint32(0)) if edge else 16)


@T.inline
def copy_rows_sw128(pool, base, src, b, head, row0, nrows, limit, width, tid, nthreads):
    """nrows x width elements of src[b, head, row0:, :] into the swizzled tile at element
    offset `base` of the flat pool with `cp.async`; rows at or past `limit` are zero-filled
    (source size 0) with the source address clamped in bounds. Tiles wholly inside take a
    path without the per-row clamp and test (their addresses are one stride apart)."""
    if row0 + nrows <= limit:
        _copy_rows_sw128(pool, base, src, b, head, row0, nrows, limit, width, tid, nthreads, False)
    else:
        _copy_rows_sw128(pool, base, src, b, head, row0, nrows, limit, width, tid, nthreads, True)


@T.inline
def encode_desc(desc, pool, leading_bytes, stride_bytes):
    """desc[0] = the descriptor of the pool's first byte for a 128B-swizzled layout."""
    T.cuda.wgmma.encode_matrix_descriptor(T.address_of(desc[0]), pool.ptr_to([0]), leading_bytes // 16,
                                          stride_bytes // 16, SWIZZLE_128B)


def desc_at(desc, base, offset: int = 0):
    """The descriptor of the tile at `base` + `offset` 16-bit elements into the pool: `base` a
    runtime offset the GEMM's steps share (one 64-bit sum for all of them), `offset` a step's
    constant one."""
    return desc[0] + T.Cast("uint64", base // 8) + T.uint64(offset // 8)


@T.inline
def gemm_ss_kmajor(op, acc, n_acc, desc, a_base, a_rows, b_base, b_rows, width):
    """acc (64 x N, N/2 f32 per thread) = A . B^T over `width` columns, A the 64-row tile at
    a_base of an a_rows-row K-major tile, B the b_rows-row K-major tile at b_base (N = b_rows)."""
    for kk in T.unroll(width // 16):
        T.ptx[op](*[acc[i] for i in range(n_acc)],
                  desc_at(desc, a_base, kk // 4 * (a_rows * 64) + kk % 4 * 16),
                  desc_at(desc, b_base, kk // 4 * (b_rows * 64) + kk % 4 * 16),
                  kk > 0, 1, 1, 0, 0)


@T.inline
def gemm_rs_mnmajor(op, acc, n_acc, a, a0, desc, b_base, k_rows):
    """acc (64 x N) += A . B, A in registers (a[a0 + 4kk ..] per k16 step, k_rows/16 steps),
    B the MN-major tile at b_base (k_rows rows of N columns, read transposed)."""
    for kk in T.unroll(k_rows // 16):
        T.ptx[op](*[acc[i] for i in range(n_acc)],
                  a[a0 + kk * 4], a[a0 + kk * 4 + 1], a[a0 + kk * 4 + 2], a[a0 + kk * 4 + 3],
                  desc_at(desc, b_base, kk * 16 * 64), True, 1, 1, 1)


@T.inline
def fence_registers(acc, n_acc):
    """Keep the compiler from moving accesses of wgmma's registers across its async window."""
    for i in T.unroll(n_acc):
        T.cuda.wgmma.noop_barrier(acc[i])


@T.inline
def gemm_ss_mnmajor(op, acc, acc0, n_acc, desc_a, a_base, desc_b, b_base, k_rows):
    """acc[acc0:] (64 x N) = A . B with both operands MN-major tiles of k_rows rows (A: the tile
    at a_base holds A^T, 64 columns; B: the tile at b_base holds B, N columns)."""
    for kk in T.unroll(k_rows // 16):
        T.ptx[op](*[acc[acc0 + i] for i in range(n_acc)], desc_at(desc_a, a_base, kk * 16 * 64),
                  desc_at(desc_b, b_base, kk * 16 * 64), kk > 0, 1, 1, 1, 1)
