"""Schedule rules for the CPU kernels, each acting on one named block.

Shared by the host (AVX2) schedule and the AVX512 one: only the vector length and the knob
values differ between targets.
"""
from __future__ import annotations

from .knobs import Knobs


def vector_width(extent: int, vl: int) -> int:
    """Largest power of two <= vl dividing extent (head dims that are not multiples of 8)."""
    w = vl
    while w > 1 and extent % w:
        w //= 2
    return w


def vectorize_inner(sch, block: str) -> None:
    """Element-wise block: vectorise its innermost loop."""
    sch.vectorize(sch.get_loops(block)[-1])


def vectorize_calls(sch, block: str) -> None:
    """Dropout's factors: a Philox call serves scores 8 apart, so vectors of 8 scores read
    the words of 8 consecutive calls (one load, not a gather)."""
    _, lanes = sch.split(sch.get_loops(block)[-1], [None, 8])
    sch.vectorize(lanes)


def swap_and_vectorize(sch, block: str) -> None:
    """(i, j) -> (j, i), vectorise i: per-query reductions over an S^T tile run along the outer
    axis, and a transposing load writes contiguous vectors."""
    outer, inner = sch.get_loops(block)[-2:]
    sch.reorder(inner, outer)
    sch.vectorize(outer)


def register_tile(sch, block: str, knobs: Knobs, vl: int, rows_default: int = 4,
                  vecs_default: int = 2) -> None:
    """Outer-product micro-kernel for out[r, c] += a[r, k] * b[k, c] with loops (r, c, k):
    a (rows x vecs*vl) accumulator tile lives in registers; a[r, k] is broadcast, b[k, c..]
    loaded as vectors. Knobs: `<block>.rows` (r tile) and `<block>.vecs` (vectors per row)."""
    r, c, k = sch.get_loops(block)[-3:]
    cols = int(sch.get(c).extent)
    vl = vector_width(cols, vl)
    ro, ri = sch.split(r, knobs.tile(f"{block}.rows", r, max_innermost=8, default_inner=rows_default))
    vecs = [n for n in (1, 2, 4) if cols % (n * vl) == 0]
    nv = knobs.categorical(f"{block}.vecs", vecs, vecs_default)
    co, cv, ci = sch.split(c, [None, nv, vl])
    sch.reorder(ro, co, k, ri, cv, ci)
    acc = sch.cache_write(block, 0, "local")
    # preserve_unit_loops: the loop structure must not depend on the decisions, or replaying a
    # mutated trace fails
    sch.reverse_compute_at(acc, co, preserve_unit_loops=True)
    sch.vectorize(ci)
    sch.unroll(cv)
    sch.unroll(ri)
    init = sch.decompose_reduction(block, k)
    vectorize_inner(sch, acc)
    vectorize_inner(sch, init)
