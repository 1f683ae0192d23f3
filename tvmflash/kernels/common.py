"""Pieces shared by every attention kernel: symbolic shapes, argument declaration, fast exp.

Kernels are TVMScript functions whose buffers are declared through `KernelArgs`, so that the
argument list can grow with the spec (a mask, later ALiBi slopes or flex captures) without a
second copy of the kernel. Every size is a symbolic int64: one compiled module serves any
batch, head count and sequence lengths, and tensors above 2**31 elements index correctly.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
from dataclasses import dataclass

from tvm import tirx
from tvm.tirx.layout import S, TileLayout
from tvm.script.ir_builder import tirx as irb

F32 = "float32"
I64 = "int64"
LOG2E = 1.4426950408889634
LN2_HI = 0.693359375  # ln 2 split in two so n*LN2_HI is exact (Cody-Waite)
LN2_LO = -2.12194440e-4


def i64(value: int) -> tirx.IntImm:
    return tirx.IntImm(I64, value)


@dataclass(frozen=True)
class Shape:
    """The symbolic sizes every kernel of one spec shares."""

    batch: tirx.Var
    heads: tirx.Var
    heads_k: tirx.Var
    seqlen_q: tirx.Var
    seqlen_k: tirx.Var

    @classmethod
    def fresh(cls) -> "Shape":
        return cls(*(tirx.Var(n, I64) for n in ("batch", "heads", "heads_k", "seqlen_q", "seqlen_k")))


class KernelArgs:
    """Declares kernel arguments while TVMScript parses the kernel body.

    `irb.arg` appends to the function being parsed, so buffers created here become parameters
    in call order, and the parser still sees them (it fills in block read/write regions)."""

    def tensor(self, name: str, shape, dtype: str, unit_last_stride: bool = True) -> tirx.Buffer:
        """A strided tensor argument: all strides symbolic (zero allowed: broadcast views), the
        last one fixed at 1 where the kernel vectorises along it."""
        strides = [tirx.Var(f"{name}_stride{i}", I64) for i in range(len(shape))]
        if unit_last_stride:
            strides[-1] = i64(1)
        shape = [i64(s) if isinstance(s, int) else s for s in shape]
        # TIRx kernels address through the layout (the default one is compact), s_tir ones
        # through the strides: give both the same strides
        layout = TileLayout(S[tuple(shape):tuple(strides)])
        buf = tirx.decl_buffer(shape, dtype, name, strides=strides, layout=layout)
        return irb.arg(name, buf)

    def scalar(self, name: str, dtype: str = F32) -> tirx.Var:
        return irb.arg(name, tirx.Var(name, dtype))


_BIND_ONCE = contextvars.ContextVar("tvmflash_bind_once", default=False)


@contextlib.contextmanager
def long_scores(enabled: bool = True):
    """Kernels generated inside bind values that expressions repeat (`bind_once`): for specs
    whose scores are long expressions (packed sequences look up each row's sequence), where
    fast_exp's ~20 copies of its argument made a compile take minutes (a varlen backward: 80 s,
    2 s bound). Off elsewhere: in TVM 0.27 the bound form gave NaN gradients in the AMX
    backward with an additive mask."""
    token = _BIND_ONCE.set(enabled)
    try:
        yield
    finally:
        _BIND_ONCE.reset(token)


def bind_once(value, body, dtype: str = F32, name: str = "bound"):
    """body(v) for v = value: v is a Let variable under `long_scores`, else `value` itself
    (inlined at each use)."""
    if not _BIND_ONCE.get():
        return body(value)
    var = tirx.Var(name, dtype)
    return tirx.Let(var, value, body(var))


def fast_exp(x):
    """exp(x) for x <= 0 from a degree-6 polynomial and an exponent-bit shift, so loops
    vectorise (LLVM scalarises `exp` into libm calls). x <= -88 (masked scores are -inf)
    gives exactly 0.0: the exponent field becomes 0. NaN stays NaN (the clamps are selects
    that keep it), so a NaN or infinite input reaches the output as in torch's math path.
    Max relative error ~2e-7. The polynomial refers to x some twenty times (see
    `long_scores`)."""
    return bind_once(x, _fast_exp_of, name="exp_arg")


def _fast_exp_of(x):
    low, high = tirx.const(-88.0, F32), tirx.const(88.0, F32)
    x = tirx.Select(x > high, high, tirx.Select(x < low, low, x))
    n = tirx.floor(x * tirx.const(LOG2E, F32) + tirx.const(0.5, F32))
    r = x - n * tirx.const(LN2_HI, F32) - n * tirx.const(LN2_LO, F32)
    p = tirx.const(1.0 / 720, F32)
    for c in (1.0 / 120, 1.0 / 24, 1.0 / 6, 0.5, 1.0, 1.0):
        p = p * r + tirx.const(c, F32)
    two_n = tirx.reinterpret(F32, tirx.shift_left(tirx.Cast("int32", n) + 127, 23))
    return p * two_n


NEG_INF = tirx.const(-math.inf, F32)
POS_INF = tirx.const(math.inf, F32)
