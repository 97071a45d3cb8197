"""Stochastic rounding of float32 classifier rows to bfloat16, with random bits keyed by what is rounded.

A bfloat16 row updated by SGD without an fp32 master copy loses every update smaller than half a unit in the
last place (about 0.4% of the value): rounding to nearest maps x + tiny back to x, so rows that receive many
small updates stop moving. Stochastic rounding rounds x up with probability (x - round_down(x)) / ulp and down
otherwise, so E[round(x)] = x and small updates survive in expectation: the approach of "ELMO: Efficiency via
Low-precision and Peak Memory Optimization in Large Output Spaces" (ICML 2025), which trains classifier rows in
bfloat16 alone.

The random bits are a pure function of (seed, global label id, column, global step), a counter-based hash
rather than a generator advanced per call: the same row at the same step rounds the same way whichever rank or
shard holds it, and a resumed run rounds as the uninterrupted one did.
"""

from __future__ import annotations

import functools

import torch

_MASK64 = (1 << 64) - 1
# splitmix64's constants (Steele, Lea and Flood, "Fast splittable pseudorandom number generators", 2014)
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_COLUMN = 0xD1B54A32D192ED03  # an odd multiplier of its own for the column, so (label, col) pairs do not collide
_ELEMENT = 0x9E3779B1  # an odd 32-bit multiplier (the golden ratio's), for the per-element step
_LOW16 = (1 << 16) - 1


def _signed(value: int, bits: int = 64) -> int:
    """A `bits`-bit pattern as the signed integer torch stores it (two's complement)."""
    value &= (1 << bits) - 1
    return value - (1 << bits) if value >= 1 << (bits - 1) else value


def _mix_int(z: int) -> int:
    """splitmix64's finaliser on a Python int (the per-call scalar part of the key)."""
    z &= _MASK64
    z = (z ^ (z >> 30)) * _MIX1 & _MASK64
    z = (z ^ (z >> 27)) * _MIX2 & _MASK64
    return z ^ (z >> 31)


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 patterns: torch's >> is arithmetic, so the sign bits are masked off."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors; products wrap modulo 2^64 as the hash needs."""
    z = (z ^ _shr(z, 30)) * _signed(_MIX1)
    z = (z ^ _shr(z, 27)) * _signed(_MIX2)
    return z ^ _shr(z, 31)


@functools.lru_cache(maxsize=16)
def _column_keys(dim: int, device: torch.device) -> torch.Tensor:
    """(dim,) int32: a well-mixed 32-bit key per column, the same for every row and step."""
    keys = [_signed(_mix_int(col * _COLUMN + _GOLDEN) >> 32, 32) for col in range(dim)]
    return torch.tensor(keys, dtype=torch.int32, device=device)


def rounding_bits(seed: int, label_ids: torch.Tensor, step: int, dim: int) -> torch.Tensor:
    """(U, dim) int32 in [0, 2^16): 16 uniform random bits for each element of rows `label_ids` (U,) (global
    label ids, int64) at optimiser step `step`; a pure function of (seed, label id, column, step).

    The full 64-bit hash runs once per row, on (seed, step, label); an element's bits are the top 16 of
    (row key ^ column key) x an odd constant, in 32 bits: four cheap passes over the (U, d) block, where hashing
    every element in 64 bits took ten times the row update itself."""
    base = _signed(_mix_int(seed * _GOLDEN + step * _MIX1 + _GOLDEN))
    rows = _mix(label_ids.to(torch.int64) * _signed(_GOLDEN) + base)  # (U,) int64
    row_keys = (rows >> 32).to(torch.int32)  # the top 32 bits (an arithmetic shift keeps them in int32's range)
    bits = row_keys.unsqueeze(1) ^ _column_keys(dim, label_ids.device)
    bits *= _signed(_ELEMENT, 32)  # wraps modulo 2^32: the top bits depend on every bit of the key
    bits >>= 16
    return bits.bitwise_and_(_LOW16)


def stochastic_round_bf16(values: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """values (U, d) float32 -> (U, d) bfloat16, each element its round-down or round-up in magnitude, up with
    probability (the dropped 16 low bits) / 2^16 when `bits` (U, d) int32 are uniform in [0, 2^16): unbiased.

    float32's pattern is sign | exponent | 23 mantissa bits and bfloat16 keeps the top 16; adding the random bits
    to the pattern carries into the kept part exactly when they exceed 2^16 minus the dropped bits. The sign bit
    is above every carry, so the magnitude rounds the same way for either sign. Infinities keep their pattern (no
    dropped bits to carry) and the largest finite values may round up to inf, as rounding up should; NaN, whose
    payload could carry into the sign, is passed through. `bits` is overwritten."""
    rounded = bits.add_(values.contiguous().view(torch.int32)).bitwise_and_(-(1 << 16)).view(torch.float32)
    return torch.where(torch.isnan(values), values, rounded).to(torch.bfloat16)


def round_rows(values: torch.Tensor, dtype: torch.dtype, stochastic: bool, seed: int, label_ids: torch.Tensor,
               step: int) -> torch.Tensor:
    """values (U, d) float32 rows of global labels `label_ids` (U,) stored as `dtype`: stochastically rounded
    (bfloat16 only) keyed by (seed, label, column, step), else to nearest."""
    if not stochastic or dtype == torch.float32:
        return values.to(dtype)
    if dtype != torch.bfloat16:
        raise ValueError(f"stochastic rounding is implemented for bfloat16 rows, not {dtype}")
    return stochastic_round_bf16(values, rounding_bits(seed, label_ids, step, values.shape[1]))
