"""The dropout RNG: Philox4x32 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3"),
a pure function of (seed, offset, batch, head, query, key), so the backward regenerates the
forward's keep mask instead of storing it.

One generator serves every backend: `philox` is written over a small set of integer operations
(`Ops`), which the kernels supply as TIR expressions (kernels/dropout.py) and `keep_mask` as
torch int64 tensors. Here is what both compute:

- One Philox call yields four 32-bit words = eight 16-bit uniforms, for the eight scores
  (i + 8a, j + 8t), a < 2, t < 4, of query block i // 16 and key block j // 32 that share i % 8
  and j % 8. That grouping matches the tensor cores' register fragments (a thread holds rows
  g, g + 8 and columns c + 8n of S): in the forward and the dQ kernel a thread uses all eight
  uniforms of each call it makes, in the dK/dV kernel (S^T: two keys a thread) four.
- counter = (key call J, query call I, batch * heads + head, offset), key = the seed's two words.
- A score is kept when its 16-bit uniform is below round((1 - p) * 2^16); kept probabilities
  are scaled by 1 / (1 - p) (flash-attn and torch do the same).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

ROUNDS = 7  # Philox4x32-7: the fewest rounds that pass the Crush battery (Random123), as flash-attn
M0, M1 = 0xD2511F53, 0xCD9E8D57  # round multipliers
W0, W1 = 0x9E3779B9, 0xBB67AE85  # key schedule (Weyl) increments
MASK32 = 0xFFFFFFFF
UNIFORM_BITS = 16


@dataclass(frozen=True)
class Ops:
    """32-bit integer operations of one backend."""

    mulhilo: Callable  # (a, constant) -> (high word, low word) of the 64-bit product
    add: Callable      # (a, constant) -> (a + constant) mod 2^32
    bind: Callable     # value -> the same value, computed once (a TIR binding; identity in torch)


def philox(counter, key, ops: Ops, rounds: int = ROUNDS) -> list:
    """Philox4x32-`rounds` of four counter words under two key words: four random words."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(rounds):
        if r:
            k0, k1 = ops.bind(ops.add(k0, W0)), ops.bind(ops.add(k1, W1))
        hi0, lo0 = ops.mulhilo(c0, M0)
        hi1, lo1 = ops.mulhilo(c2, M1)
        c0, c1, c2, c3 = (ops.bind(x) for x in (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0))
    return [c0, c1, c2, c3]


def call_of(i, j):
    """(I, J, slot): the Philox call of score (query i, key j) and which of its eight 16-bit
    uniforms is the score's (works on ints and on integer expressions alike)."""
    return (i // 16 * 8 + i % 8, j // 32 * 8 + j % 8, i // 8 % 2 * 4 + j // 8 % 4)


def keep_threshold(dropout_p: float) -> int:
    """16-bit uniforms below this are kept (2^16 keeps everything)."""
    return round((1.0 - dropout_p) * (1 << UNIFORM_BITS))


# ----------------------------------------------------------------------------- torch side
def _torch_ops():
    def mulhilo(a, m):
        prod = a * m  # int64 wraps mod 2^64: its low 64 bits are the exact product
        return (prod >> 32) & MASK32, prod & MASK32

    return Ops(mulhilo=mulhilo, add=lambda a, m: (a + m) & MASK32, bind=lambda x: x)


def seed_words(rng) -> tuple:
    """(key0, key1, offset) from the (2,) int64 [seed, offset] the kernels take."""
    seed, offset = (int(x) for x in rng.tolist())
    return seed & MASK32, (seed >> 32) & MASK32, offset & MASK32


def keep_mask(batch: int, heads: int, seqlen_q: int, seqlen_k: int, dropout_p: float, rng, device=None):
    """The (B, H, Lq, Lk) boolean keep mask the kernels apply for [seed, offset] = `rng`
    (computed with torch, one Philox call per score: for tests and `return_attn_probs`)."""
    import torch

    device = device if device is not None else rng.device
    k0, k1, offset = seed_words(rng)
    i = torch.arange(seqlen_q, device=device, dtype=torch.int64)[:, None]
    j = torch.arange(seqlen_k, device=device, dtype=torch.int64)[None, :]
    I, J, slot = call_of(i, j)
    bh = torch.arange(batch * heads, device=device, dtype=torch.int64)[:, None, None]
    shape = (batch * heads, seqlen_q, seqlen_k)
    counter = [J.expand(shape), I.expand(shape), bh.expand(shape), torch.full(shape, offset, device=device)]
    key = [torch.tensor(k0, device=device), torch.tensor(k1, device=device)]
    words = torch.stack(philox(counter, key, _torch_ops()), 0)
    slot = slot.expand(shape)
    word = words.gather(0, (slot // 2)[None]).squeeze(0)
    uniform = (word >> (UNIFORM_BITS * (slot % 2))) & ((1 << UNIFORM_BITS) - 1)
    return (uniform < keep_threshold(dropout_p)).view(batch, heads, seqlen_q, seqlen_k)


def draw_seed(device):
    """A fresh [seed, offset] (int64, on `device`) from torch's generator of that device, so
    `torch.manual_seed` makes dropout reproducible; drawn on the device, it needs no host sync
    and is captured by CUDA graphs like torch's own random ops."""
    import torch

    return torch.randint(0, 2 ** 62, (2,), dtype=torch.int64, device=device)
