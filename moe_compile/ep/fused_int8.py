"""The "a2a-int8" transport of ``fused_moe_ep``: int8 rows dispatched straight into a8w8-int experts.

Shapes:  T tokens (this rank), K top-k, S = T*K slots, H hidden, F expert FFN width, R ranks,
         ne local experts, N rows this rank receives (expert-major, all sources), B = H + 4.

The a2a transport (``fused_a2a``) with the seed operator's A8W8 path on the wire:
  1. each token quantized once at its source, per token (``quant/common.quantize_per_token_int8``
     by the integer kernel's own quantizer, ``kernels/cpu/qgemm.quantize_rows``): one row
     [q int8 (H bytes) | s fp32 (4 bytes)] = B bytes, a quarter of an fp32 row;
  2. each token's row sent to its K experts' ranks by token index (``a2a_cpu.dispatch_rows``: no
     sorted copy, one copy per slot into a peer's window, one per token into this rank's own);
  3. the codes and scales split out of the window once (the kernel rewrites its codes in place:
     they cannot be read where they lie), and the local experts run on them as they are
     (``qgemm.run_quantized_rows``: int32 accumulation, y = acc * s_x * s_w, SwiGLU in fp32, FC2's
     input re-quantized per row) — the rows are never dequantized; the weights are this layer's
     a8w8-int pack (``kernels/cpu/quant.layer_pack``, made once, kept while the weights stay unchanged);
  4. the fp32 outputs combined back (``a2a_cpu.combine_sum``: own rows never sent), y = sum_k g * row
     at the source.
So the result is the single-device a8w8-int op's (``quant="a8w8-int"``) up to the order of the
K-sum; against the fp32 layer it has a8w8's error (>= 30 dB SQNR at the bench shapes).

Backward: the fp32 a2a backward (``fused_a2a.backward``: the straight-through gradient of the
quantized forward, as for the "symm-int8" transport); the forward keeps no fp32 rows, so it sends
[x | dy | g].
"""

from __future__ import annotations

import torch

from moe_compile.ep import a2a_cpu
from moe_compile.ep.fused_a2a import (TIMEOUT_S, _dispatch, _route, _tiles, backward, combine_to_tokens,
                                      in_place, ranks_and_local_experts, tile_rows)
from moe_compile.ir import ExpertWeights, FFNAttrs
from moe_compile.kernels.reference import compute_dtype

FORMAT = "a8w8-int"
SCALE_BYTES = 4  # the fp32 per-token scale after the H int8 codes of a row


def supports(x, w: ExpertWeights, attrs: FFNAttrs) -> str | None:
    """Why this call cannot take the a2a-int8 transport (None when it can)."""
    from moe_compile.kernels.cpu import qgemm
    from moe_compile.quant.layout import refusal

    if x.device.type != "cpu":
        return "the a2a-int8 transport runs on CPU tensors"
    if attrs.weight_on != "output":
        return f"weight_on={attrs.weight_on!r}: the routing weight is applied at the source (output only)"
    why = refusal(w, attrs) or qgemm.unavailable_reason(FORMAT)
    if why:
        return why
    try:
        qgemm.check_call(torch.empty(0, w.hidden()), _FakeQW(w, 1), _FakeQW(w, 2), attrs)
    except ValueError as e:
        return str(e)
    return None


class _FakeQW:
    """The shape and format ``qgemm.check_call`` reads, without packing the weights."""

    def __init__(self, w: ExpertWeights, fc: int):
        E, H, F = w.num_experts, w.hidden(), w.ffn()
        self.fmt, self.group = FORMAT, 0
        self.shape = (E, 2 * F, H) if fc == 1 else (E, H, F)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [T, H] -> [T, B] uint8: each token's int8 codes and its fp32 scale, side by side."""
    from moe_compile.kernels.cpu import qgemm

    q, s, _ = qgemm.quantize_rows(x)  # [T, H] int8, [T] fp32
    return torch.cat([q.view(torch.uint8), s.view(torch.uint8).reshape(-1, SCALE_BYTES)], dim=1)


def _codes_and_scales(rows: list[torch.Tensor], H: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [N, H] int8, s [N] fp32) copied out of byte rows [n_i, H + 4] (the kernel rewrites its
    codes in place, so they cannot be read where they lie)."""
    q = torch.cat([r[:, :H] for r in rows]).view(torch.int8)
    s = torch.cat([r[:, H:] for r in rows]).view(torch.float32).reshape(-1)
    return q, s


def _run_experts(q, s, rows, scale, bounds, w: ExpertWeights, attrs: FFNAttrs) -> torch.Tensor:
    """The layer's a8w8-int experts on int8 rows (``rows`` expert-major, ``bounds`` per expert)."""
    from moe_compile.kernels.cpu import qgemm, quant as cpu_quant

    p = cpu_quant.layer_pack(w, attrs, FORMAT)
    return qgemm.run_quantized_rows(q, s, rows, scale, bounds, p.w1, p.w2, attrs, p.kernel_cache)


def _experts(window: torch.Tensor, tiles: list, w: ExpertWeights, attrs: FFNAttrs) -> torch.Tensor:
    """[N, H] fp32 outputs of every tile's expert on its received int8 rows (zero elsewhere)."""
    q, s = _codes_and_scales([window], window.shape[1] - SCALE_BYTES)
    tokens, bounds = tile_rows(tiles)
    return _run_experts(q, s, tokens, torch.ones(tokens.shape[0]), bounds, w, attrs)


def forward(x, topk_ids, topk_weights, w: ExpertWeights, attrs: FFNAttrs, group_name: str, num_experts: int,
            timeout_s: float = TIMEOUT_S) -> torch.Tensor:
    """y [T, H] = sum_k g_{t,k} FFN^{a8w8}_{e_{t,k}}(x_t) over the experts of every rank."""
    R, ne = ranks_and_local_experts(group_name, w, num_experts)
    T = x.shape[0]
    cdt = compute_dtype(x.dtype)
    route = _route(topk_ids, topk_weights, num_experts, cdt)
    rows = _rows(x.float())  # [T, B] byte rows: a token quantized once, sent K times
    if not in_place(cdt):  # no C copy kernel: the sorted copy, the compact window, the combine's copies
        window, oso, oso_np, handle = _dispatch(route, rows, group_name, timeout_s)
        out = _experts(window, _tiles(oso_np, R, ne), w, attrs)  # [N, H] fp32
        return combine_to_tokens(out, route, oso, handle, group_name, T, cdt, timeout_s).to(x.dtype)
    # sent by token index (no sorted copy); the codes and scales split out of the window once
    rcv = a2a_cpu.dispatch_rows(rows, route.tokens, route.in_splits, group_name, timeout_s, packed=True,
                                gates=route.gates)
    out = _experts_received(rcv, w, attrs)  # [L, H] fp32, rows packed region after region
    return a2a_cpu.combine_sum(out, rcv, route.tokens, route.gates, T, group_name, timeout_s).to(x.dtype)


def _experts_received(rcv, w: ExpertWeights, attrs: FFNAttrs) -> torch.Tensor:
    """[L, H] fp32 outputs of the received int8 rows times ``rcv.scale``, in ``rcv``'s packed layout
    (region after region; this rank's own: its T tokens, their local outputs weighted and summed):
    the codes and scales copied out of the window's slabs once (the kernel rewrites its codes in
    place, so they cannot stay in the window), the experts' rows by ``rcv.idx``."""
    slabs = [rcv.source_rows(s) for s in range(len(rcv.region))]  # [n_s, B] views of the window
    q, s = _codes_and_scales(slabs, w.hidden())  # [N, H], [N]
    return _run_experts(q, s, rcv.idx, rcv.scale, rcv.bounds, w, attrs)


__all__ = ["FORMAT", "backward", "forward", "supports"]
