"""What every quantized format shares: the packed weight, the per-token int8 activation quantizer,
the 4-bit nibble order and the group check.

Shapes:  E experts, N output rows of one role, K reduction (input) width, G group (elements of K
sharing one scale), T rows of activations.

A packed weight holds one role (FC1 or FC2) of all E experts.  Expert e maps x [T, K] to
y = x @ W_e^T with W_e [N, K], K contiguous (the ``nn.Linear`` convention).  FC1 is canonicalised
to N = 2F rows, gate rows 0..F-1 then up rows F..2F-1, whatever the model's layout; FC2 has N = H,
K = F.

| fmt      | data                         | scale                 | group | element (e, n, k)                  |
|----------|------------------------------|-----------------------|-------|------------------------------------|
| w16      | bf16 / fp16 [E, N, K]        | empty                 | K     | data                               |
| w8-int   | int8 [E, N, K]               | fp16 [E, N, K/G]      | G     | q * s                              |
| w4-int   | uint8 [E, N, K/2]            | fp16 [E, N, K/G]      | G     | (nibble - 8) * s                   |
| mxfp4    | uint8 [E, N, K/2] e2m1 codes | uint8 e8m0 [E,N,K/32] | 32    | e2m1(code) * 2^(scale - 127)       |
| mxfp8    | uint8 [E, N, K] e4m3fn bits  | uint8 e8m0 [E,N,K/32] | 32    | e4m3(code) * 2^(scale - 127)       |
| a8w8-int | int8 [E, N, K]               | fp16 [E, N, K/G]      | G     | q * s  (group-wise, G = 32)        |
| a8w8-int | int8 [E, N, K]               | fp32 [E, N, 1]        | K     | q * s  (per channel)               |
| a8w4-int | uint8 [E, N, K/2]            | fp16 [E, N, K/G]      | G     | (nibble - 8) * s  (default, G = 32) |
| a8w4-int | uint8 [E, N, K/2]            | fp32 [E, N, 1]        | K     | per channel (MSD): bias = 8 sum_k q |
| a8w8-fp8 | uint8 [E, N, K] e4m3fn bits  | fp32 [E, N, 1]        | K     | e4m3(code) * s                     |

Each format's module (``w16.py``, ``wint.py``, ``mx.py``, ``a8w8_int.py``, ``a8w4_int.py``,
``fp8.py``) states how the scales are chosen and gives pack, dequantize and a reference matmul.
a8w4-int and a8w8-int have two forms each, told apart by the scale's dtype: group-wise (fp16 group
scales, no bias; activations quantized per token in blocks of ``ACT_BLOCK``, torchao's "8da4w",
ggml's q4_0 / q8_0 x q8_0) and the seed's per-channel form (fp32 scale per row; a8w4-int's MSD
form with an int32 bias).

Nibble order (every 4-bit format): byte j of a row holds element 2j in its low nibble and element
2j + 1 in its high nibble (the GPT-OSS / OCP MX order).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FORMATS = ("w16", "w8-int", "w4-int", "mxfp4", "mxfp8", "a8w8-int", "a8w4-int", "a8w8-fp8")
# Formats whose activations are quantized too (the rest read fp32 activations).
ACTIVATION_QUANTIZED = ("a8w8-int", "a8w4-int", "a8w8-fp8")
FOUR_BIT = ("w4-int", "mxfp4", "a8w4-int")
MX_GROUP = 32  # OCP MX v1.0 block size
INT8_QMAX = 127.0
ACT_BLOCK = 32  # grouped a8w4-int / a8w8-int: activations get one int8 scale per token per 32 elements of K
GROUPED_A8 = ("a8w8-int", "a8w4-int")  # the a8 formats with a group-wise form (fp16 group scales)


def a8_group_tiles(group: int) -> bool:
    """Whether the group-wise a8 kernels tile a weight group: whole activation blocks the vectors
    step, 32, 64 or a multiple of 128."""
    return group in (32, 64) or (group > 0 and group % 128 == 0)


def grouped_a8(w, K: int) -> bool:
    """Group-wise a8w4-int / a8w8-int: a QuantWeight says so (``grouped_activations``); a bare
    shape (``fmt``, ``group``: the kernels' checks) by its group, a8w4 one other than K, a8w8 one in
    (0, K) (0 or K: its per-channel form)."""
    if w.fmt not in GROUPED_A8:
        return False
    bare = w.group != K if w.fmt == "a8w4-int" else 0 < w.group < K
    return getattr(w, "grouped_activations", bare)


class QuantRefusal(ValueError):
    """A weight a format cannot hold (K not a multiple of the group, odd K for 4 bits, ...)."""


def _data_spec(fmt: str) -> tuple[tuple[torch.dtype, ...], int]:
    """(allowed dtypes of data, elements per byte along K) of one format."""
    if fmt == "w16":
        return (torch.bfloat16, torch.float16), 1
    if fmt in ("w8-int", "a8w8-int"):
        return (torch.int8,), 1
    if fmt in FOUR_BIT:
        return (torch.uint8,), 2
    return (torch.uint8,), 1  # mxfp8, a8w8-fp8: e4m3fn bit patterns


def _scale_spec(fmt: str, shape: tuple[int, int, int], group: int, grouped: bool = False) -> tuple[torch.dtype | None, tuple]:
    E, N, K = shape
    if fmt == "w16":
        return None, (0,)
    if fmt in ("w8-int", "w4-int") or grouped:
        return torch.float16, (E, N, K // group)
    if fmt in ("mxfp4", "mxfp8"):
        return torch.uint8, (E, N, K // group)
    return torch.float32, (E, N, 1)


def check_a8_group(K: int, group: int, fmt: str) -> None:
    """Group-wise a8w4-int / a8w8-int: G a group the kernels tile (``a8_group_tiles``) dividing K."""
    if not a8_group_tiles(group):
        raise QuantRefusal(f"{fmt}: group_size must be 32, 64 or a multiple of 128, got {group}")
    check_group(K, group, fmt)


def check_group(K: int, group: int, fmt: str) -> None:
    """Refuse (clearly) a reduction width the format cannot hold."""
    if group <= 0:
        raise QuantRefusal(f"{fmt}: group must be positive, got {group}")
    if K % group:
        raise QuantRefusal(
            f"{fmt}: the reduction width K={K} is not a multiple of the group {group}; "
            f"use a group that divides K (or quant='none')"
        )
    if fmt in FOUR_BIT and K % 2:
        raise QuantRefusal(f"{fmt}: 4-bit formats pack two elements per byte and need an even K, got K={K}")


@dataclass(frozen=True)
class QuantWeight:
    """One role (FC1 or FC2) of all E experts in one packed format; see the module table."""

    fmt: str
    data: torch.Tensor  # [E, N, K'] contiguous, K' = K or K/2
    scale: torch.Tensor  # contiguous, shape per format
    group: int  # elements of K sharing one scale (K for per-channel formats)
    shape: tuple[int, int, int]  # logical (E, N, K)
    bias: torch.Tensor | None = None  # a8w4-int only: int32 [E, N] = 8 * sum_k q[e, n, k]

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ValueError(f"QuantWeight.fmt must be one of {FORMATS}, got {self.fmt!r}")
        if len(self.shape) != 3 or any(int(d) < 0 for d in self.shape):
            raise ValueError(f"QuantWeight.shape must be (E, N, K), got {self.shape}")
        E, N, K = self.shape
        check_group(K, self.group, self.fmt)
        dtypes, per_byte = _data_spec(self.fmt)
        if self.data.dtype not in dtypes or tuple(self.data.shape) != (E, N, K // per_byte):
            raise ValueError(
                f"{self.fmt}: data must be {dtypes} of shape {(E, N, K // per_byte)}, "
                f"got {self.data.dtype} {tuple(self.data.shape)}"
            )
        scale_dtype, scale_shape = _scale_spec(self.fmt, self.shape, self.group, self.grouped_activations)
        if scale_dtype is not None and (self.scale.dtype != scale_dtype or tuple(self.scale.shape) != scale_shape):
            raise ValueError(
                f"{self.fmt}: scale must be {scale_dtype} of shape {scale_shape}, "
                f"got {self.scale.dtype} {tuple(self.scale.shape)}"
            )
        if not (self.data.is_contiguous() and self.scale.is_contiguous()):
            raise ValueError(f"{self.fmt}: data and scale must be contiguous")
        self._check_bias()

    def _check_bias(self) -> None:
        E, N, _ = self.shape
        if self.fmt != "a8w4-int" or self.grouped_activations:
            if self.bias is not None:
                raise ValueError(f"{self.fmt}: only per-channel a8w4-int (fp32 scales) carries a bias")
            return
        if self.bias is None or self.bias.dtype != torch.int32 or tuple(self.bias.shape) != (E, N):
            raise ValueError(f"a8w4-int: bias must be int32 [{E}, {N}] (8 * sum_k q)")

    @property
    def grouped_activations(self) -> bool:
        """Group-wise a8w4-int / a8w8-int (fp16 group scales): activations quantized per
        ``ACT_BLOCK`` elements.  Their per-channel forms hold fp32 scales [E, N, 1]."""
        return self.fmt in GROUPED_A8 and self.scale.dtype == torch.float16

    @property
    def num_experts(self) -> int:
        return self.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes this packed weight holds (data + scales + bias)."""
        extra = self.bias.numel() * self.bias.element_size() if self.bias is not None else 0
        return self.data.numel() * self.data.element_size() + self.scale.numel() * self.scale.element_size() + extra


def quantize_per_token_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] float -> (q int8 [T, K], s fp32 [T, 1]).

    s = max_k |x| / 127 (s = 1 where the row is all zero, so it dequantizes exactly);
    q = clamp(round_half_even(x / s), -127, 127) (``torch.round`` rounds half to even).
    """
    xf = x.float()
    s = xf.abs().amax(dim=-1, keepdim=True) / INT8_QMAX  # [T, 1]
    s = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.round(xf / s).clamp_(-INT8_QMAX, INT8_QMAX).to(torch.int8)  # [T, K]
    return q, s


def quantize_per_block_int8(x: torch.Tensor, block: int = ACT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] float (K a multiple of ``block``) -> (q int8 [T, K], s fp32 [T, K / block]).

    Per token and block of ``block`` elements along K: s = max|x| / 127 (1 where that is 0;
    a NaN or inf in the block makes s non-finite, so the output is too), q = clamp(
    round_half_even(x / s), -127, 127) (0 where x / s is NaN).
    """
    xf = x.float()
    T, K = xf.shape
    xb = xf.reshape(T, K // block, block)
    amax = xb.abs().amax(dim=-1)  # [T, B]; NaN propagates
    s = amax / INT8_QMAX
    s = torch.where(s == 0, torch.ones_like(s), s)  # zero (or subnormal) blocks: 1, so q = 0
    q = torch.nan_to_num(torch.round(xb / s[..., None]), nan=0.0).clamp_(-INT8_QMAX, INT8_QMAX)
    return q.to(torch.int8).reshape(T, K), s


def dequantized_blocks(x: torch.Tensor, block: int = ACT_BLOCK) -> torch.Tensor:
    """x [T, K] quantized per token and block (``quantize_per_block_int8``) and dequantized, q * s in
    fp32: the activations a group-wise a8 format's float panels multiply."""
    q, s = quantize_per_block_int8(x, block)
    T, K = q.shape
    return (q.float().reshape(T, K // block, block) * s[..., None]).reshape(T, K)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """q [..., K] integers in [0, 15] -> uint8 [..., K/2]: element 2j low nibble, 2j + 1 high."""
    u = q.to(torch.uint8)
    return (u[..., 0::2] | (u[..., 1::2] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> uint8 [..., K] nibble values in [0, 15], in element order."""
    lo = packed & 0xF
    hi = packed >> 4
    return torch.stack([lo, hi], dim=-1).flatten(-2)


# Divisors tried per group by ``search_scales``: s = amax / d, d = QMAX + j / 4 for j < SEARCH_STEPS.
# d = QMAX keeps every element in range; larger d clip the few largest elements to buy a finer step
# for the rest.  Up to 12 for int4: on Gaussian rows of 1024 (per channel) the search gains 2.4 dB
# over d = 7, on groups of 32 about 1 dB (the optimum there is d ~ 7.5-8).
SEARCH_STEPS = 21


def search_scales(wg: torch.Tensor, qmin: int, qmax: int) -> torch.Tensor:
    """wg [..., G] fp32 groups -> fp32 scales [..., 1]: per group, the s = amax / d (d = QMAX,
    QMAX + 1/4, ..) whose q = clamp(round(w / s), qmin, qmax) has the least squared error —
    the kind of search llama.cpp runs for its k-quants.  All-zero groups get s = 1."""
    amax = wg.abs().amax(dim=-1, keepdim=True)  # [..., 1]
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    best_s, best_err = safe / qmax, None
    for d in (qmax + j / 4 for j in range(SEARCH_STEPS)):
        s = safe / d
        err = (wg - torch.round(wg / s).clamp_(qmin, qmax) * s).pow_(2).sum(dim=-1, keepdim=True)
        if best_err is None:
            best_err = err
            continue
        better = err < best_err
        best_s, best_err = torch.where(better, s, best_s), torch.where(better, err, best_err)
    return torch.where(amax > 0, best_s, torch.ones_like(amax))


def group_view(w: torch.Tensor, group: int) -> torch.Tensor:
    """[..., K] -> [..., K/group, group] (the caller has checked the group divides K)."""
    return w.reshape(*w.shape[:-1], w.shape[-1] // group, group)


# The integer block arithmetic of the int8-activation formats (a8w8-int and a8w4-int): the
# references both formats' kernels are checked against.

MAX_K = 1 << 17  # 127 * 127 * K must fit int32
REFERENCE_ROWS = 64  # the grouped reference works on this many rows of x at a time ([rows, N, B] sums)


def int_matmul(qx: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """int8 [T, K] x int [N, K] -> exact int32 [T, N] (int64 inside, then checked narrowing)."""
    acc = qx.long() @ q.long().t()
    return acc.to(torch.int32)


def block_sums(qx: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """int8 [T, K] x int [N, K] -> acc [T, N, B] fp32: each 32-block's integer dot product, exact
    (every partial sum is an integer below 32 * 127 * 8 < 2^24, so fp32 holds it in any order)."""
    T, K = qx.shape
    N, B = q.shape[0], K // ACT_BLOCK
    a = qx.float().reshape(T, B, ACT_BLOCK).transpose(0, 1)  # [B, T, 32]
    w = q.float().reshape(N, B, ACT_BLOCK).permute(1, 2, 0)  # [B, 32, N]
    return torch.bmm(a, w).permute(1, 2, 0)  # [T, N, B]


def block_scales(qw: QuantWeight, e: int) -> torch.Tensor:
    """Expert e's weight scale of each activation block: fp32 [N, B] (s_w of the group holding it)."""
    return qw.scale[e].float().repeat_interleave(qw.group // ACT_BLOCK, dim=-1)


def grouped_int_matmul(x: torch.Tensor, q: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
    """x [T, K] float, q [N, K] integer weights, sw [N, B] fp32 block scales -> [T, N] fp32:
    activations per block of 32, int32 block sums, each scaled once: y = sum_b (acc_b * s_x_b) * s_w."""
    out = []
    for t0 in range(0, x.shape[0], REFERENCE_ROWS):
        qx, sx = quantize_per_block_int8(x[t0: t0 + REFERENCE_ROWS])  # [t, K], [t, B]
        out.append(((block_sums(qx, q) * sx[:, None, :]) * sw[None]).sum(-1))
    return torch.cat(out) if out else x.new_zeros(0, q.shape[0], dtype=torch.float32)
