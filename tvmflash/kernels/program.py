"""Traced score/mask programs (tvmflash/flex.py builds them): value kinds, the symbolic
derivative with respect to the score, and a mask's band (`split_band`: the conjuncts that bound
q_idx - kv_idx, which kernels mask with two compares and use to skip tiles). TVM-free: the
tracer imports it too; lowering to TIR is `score_mods.ScoreProgram`.

A node is a tuple: ("score",), ("b",), ("h",), ("q_idx",), ("kv_idx",), ("const", value),
("capture", k, *index nodes) or (op, *argument nodes).
"""
from __future__ import annotations

import math

LEAVES = ("score", "b", "h", "q_idx", "kv_idx")
FLOAT_FUNCS = ("exp", "exp2", "log", "log2", "sqrt", "rsqrt", "sigmoid", "tanh", "sin", "cos")
COMPARE = ("lt", "le", "gt", "ge", "eq", "ne")
LOGIC = ("and", "or", "xor", "not")
ARITH = ("add", "sub", "mul", "div", "floordiv", "mod", "neg", "abs", "min", "max", "pow", "where")
OPS = FLOAT_FUNCS + COMPARE + LOGIC + ARITH

ZERO, ONE = ("const", 0.0), ("const", 1.0)
# band constants beyond this are left to the generic path (programs compute in int32)
BAND_LIMIT = 2**30


def kind_of(node, captures) -> str:
    """The value kind of a node: "f" (float32), "i" (int64) or "b" (bool); `captures` lists
    the captured tensors' (dtype, ndim)."""
    op = node[0]
    if op == "score":
        return "f"
    if op in LEAVES:
        return "i"
    if op == "const":
        return "b" if isinstance(node[1], bool) else "i" if isinstance(node[1], int) else "f"
    if op == "capture":
        dtype = captures[node[1]][0]
        return "b" if dtype == "bool" else "f" if dtype.startswith(("float", "bfloat")) else "i"
    if op in COMPARE or op in LOGIC:
        return "b"
    if op in FLOAT_FUNCS or op == "div":
        return "f"
    if op == "pow":
        return "f" if isinstance(node[2][1], float) else kind_of(node[1], captures)
    kinds = {kind_of(a, captures) for a in (node[2:] if op == "where" else node[1:])}
    return "f" if "f" in kinds else "i" if "i" in kinds else "b"


def _add(a, b):
    if a == ZERO:
        return b
    return a if b == ZERO else ("add", a, b)


def _mul(a, b):
    if ZERO in (a, b):
        return ZERO
    if a == ONE:
        return b
    return a if b == ONE else ("mul", a, b)


def _neg(a):
    return ZERO if a == ZERO else ("neg", a)


def derivative(node, captures) -> tuple:
    """d node / d score, as a node (constant-folded where a factor is 0 or 1)."""
    op = node[0]
    if op == "score":
        return ONE
    if kind_of(node, captures) != "f" or op in LEAVES or op in ("const", "capture"):
        return ZERO
    d = [derivative(a, captures) if isinstance(a, tuple) and a[0] != "const" else ZERO
         for a in node[1:]] if op != "pow" else [derivative(node[1], captures)]
    a = node[1] if len(node) > 1 else None
    if op == "add":
        return _add(d[0], d[1])
    if op == "sub":
        return _add(d[0], _neg(d[1]))
    if op == "mul":
        return _add(_mul(d[0], node[2]), _mul(a, d[1]))
    if op == "div":  # (da b - a db) / b^2
        num = _add(_mul(d[0], node[2]), _neg(_mul(a, d[1])))
        return ZERO if num == ZERO else ("div", num, ("mul", node[2], node[2]))
    if op == "neg":
        return _neg(d[0])
    if op == "abs":
        return ZERO if d[0] == ZERO else ("where", ("ge", a, ZERO), d[0], _neg(d[0]))
    if op in ("min", "max"):
        pick = ("le" if op == "min" else "ge", a, node[2])
        return ZERO if d == [ZERO, ZERO] else ("where", pick, d[0], d[1])
    if op == "where":
        return ZERO if d[1:] == [ZERO, ZERO] else ("where", a, d[1], d[2])
    if op == "pow":
        n = node[2][1]
        return _mul(_mul(("const", float(n)), ("pow", a, ("const", n - 1))), d[0])
    outer = {"exp": node, "exp2": ("mul", node, ("const", math.log(2.0))),
             "log": ("div", ONE, a), "log2": ("div", ("const", 1 / math.log(2.0)), a),
             "sqrt": ("div", ("const", 0.5), node), "rsqrt": ("mul", ("const", -0.5), ("div", node, a)),
             "sigmoid": ("mul", node, ("sub", ONE, node)), "tanh": ("sub", ONE, ("mul", node, node)),
             "sin": ("cos", a), "cos": ("neg", ("sin", a))}[op]
    return _mul(outer, d[0])


def _linear(node):
    """An int node as {"q_idx": a, "kv_idx": c, "const": k} (a, c, k ints) where it is a sum of
    integer multiples of q_idx, kv_idx and integer constants; None otherwise."""
    op = node[0]
    if op in ("q_idx", "kv_idx"):
        return {op: 1}
    if op == "const":
        return {"const": node[1]} if type(node[1]) is int else None
    if op in ("add", "sub"):
        a, b = _linear(node[1]), _linear(node[2])
        if a is None or b is None:
            return None
        sign = 1 if op == "add" else -1
        return {k: a.get(k, 0) + sign * b.get(k, 0) for k in {*a, *b}}
    if op == "neg":
        a = _linear(node[1])
        return None if a is None else {k: -v for k, v in a.items()}
    if op == "mul":
        a, b = _linear(node[1]), _linear(node[2])
        if a is None or b is None:
            return None
        if set(a) <= {"const"}:
            a, b = b, a
        if not set(b) <= {"const"}:
            return None
        return {k: v * b.get("const", 0) for k, v in a.items()}
    return None


_FLIPPED = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le", "eq": "eq"}  # a OP b == b FLIPPED[OP] a
_NEGATED = {"lt": "ge", "le": "gt", "gt": "le", "ge": "lt"}  # not (a OP b) on integers


def _difference(node):
    """(s, c) with node == s (q_idx - kv_idx) + c, s = +-1, c an integer; None otherwise."""
    lin = _linear(node)
    if lin is None:
        return None
    s, c = lin.get("q_idx", 0), lin.get("const", 0)
    if s not in (1, -1) or lin.get("kv_idx", 0) != -s or abs(c) > BAND_LIMIT:
        return None
    return s, c


def _difference_bounds(node):
    """(lo, hi) with the comparison `node` true exactly when lo <= q_idx - kv_idx <= hi (None:
    unbounded; lo > hi: never), for comparisons of integer sums of q_idx, kv_idx and constants
    whose difference is +-(q_idx - kv_idx) + c (`q >= kv`, `q - kv < W`), their negations, and
    |+-(q_idx - kv_idx) + c| below a constant (symmetric windows); None for other nodes."""
    op = node[0]
    if op == "not" and node[1][0] in _NEGATED:
        return _difference_bounds((_NEGATED[node[1][0]], *node[1][1:]))
    if op not in _FLIPPED:
        return None
    left, right = node[1], node[2]
    if right[0] == "abs":  # C OP |x|: |x| FLIPPED[OP] C
        left, right, op = right, left, _FLIPPED[op]
    if left[0] == "abs":  # |s d + c| < C or <= C: -C <= s d + c <= C
        inner, bound = _difference(left[1]), _linear(right)
        if op not in ("lt", "le") or inner is None or bound is None or set(bound) - {"const"}:
            return None
        (s, c), top = inner, bound.get("const", 0) - (op == "lt")
        if abs(top) > BAND_LIMIT:
            return None
        return (-top - c, top - c) if s == 1 else (c - top, c + top)
    diff = _difference(("sub", left, right))  # node: s d + c OP 0, d = q_idx - kv_idx
    if diff is None:
        return None
    s, c = diff
    if op == "eq":
        return -c * s, -c * s
    strict = op in ("lt", "gt")
    upper = (op in ("lt", "le")) == (s == 1)  # s d OP -c bounds d from above
    bound = -c * s
    if upper:
        return None, bound - (1 if strict else 0)
    return bound + (1 if strict else 0), None


def _conjuncts(node):
    return _conjuncts(node[1]) + _conjuncts(node[2]) if node[0] == "and" else [node]


def split_band(node):
    """A mask node as (band, rest): band = (lo, hi), the mask's conjuncts that bound
    d = q_idx - kv_idx (causal masks, sliding windows; each end an int or None, unbounded), or
    None where there are none; rest: the other conjuncts (one node) or None where the band is
    the whole mask. Kernels mask a band with two compares of small offsets a score."""
    bands, rest = [], []
    for c in _conjuncts(node):
        bounds = _difference_bounds(c)
        if bounds is None:
            rest.append(c)
        else:
            bands.append(bounds)
    if not bands:
        return None, node
    los, his = ([b[end] for b in bands if b[end] is not None] for end in (0, 1))
    lo, hi = max(los) if los else None, min(his) if his else None
    rest_node = None
    for c in rest:
        rest_node = c if rest_node is None else ("and", rest_node, c)
    return (lo, hi), rest_node
