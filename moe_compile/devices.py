"""Which kernel variants each device runs natively, as frozen data (docs/architecture.md#devices-and-variants)."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class DeviceKind:
    name: str
    variants: tuple[str, ...]  # quantized variants with a native kernel (a16w16 always runs)
    kernel: str


CPU_KINDS = (
    DeviceKind("cpu-avx2", ("a16w16",), "kernels/cpu/forward.py (torch GEMMs per expert segment)"),
    DeviceKind("cpu-avx512-vnni", ("a16w16",), "kernels/cpu/forward.py; int8 VNNI kernels not built yet"),
    DeviceKind("cpu-amx", ("a16w16",), "kernels/cpu/forward.py; AMX bf16/int8 kernels not built yet"),
)
CUDA_KINDS = {
    (8, 0): DeviceKind("sm80", ("a16w16",), "kernels/triton (bf16/fp16)"),
    (8, 9): DeviceKind("sm89", ("a16w16",), "kernels/triton (bf16/fp16)"),
    (9, 0): DeviceKind("sm90", ("a16w16",), "kernels/triton (bf16/fp16)"),
    (10, 0): DeviceKind("sm100", ("a16w16",), "kernels/triton (bf16/fp16)"),
}
# The seed operator's Ascend product table (the Ascend ``mega_moe`` operator page: supported products,
# and which Linear data types each runs), kept as data: no Ascend kernel runs here.
ASCEND_VARIANTS = {
    "Ascend 950PR / 950DT": ("a8w8-fp", "a8w4-fp", "a4w4-fp"),
    "Atlas A3 training / inference": ("a16w16", "a8w8-int", "a8w4-int"),
    "Atlas A2 training / inference": ("a16w16", "a8w8-int", "a8w4-int"),
    "Atlas 200I/500 A2 inference": (),
    "Atlas inference series": (),
    "Atlas training series": (),
}


def cpu_kind() -> DeviceKind:
    caps = torch.backends.cpu.get_cpu_capability()
    if "AMX" in caps:
        return CPU_KINDS[2]
    if "AVX512" in caps:
        return CPU_KINDS[1]
    return CPU_KINDS[0]


def _skinny_status() -> str:
    """Whether fp32 decode runs on the skinny kernel (built here on first use) or on MKL, and why."""
    from moe_compile.kernels.cpu import cc as cpu_cc, skinny as cpu_skinny

    if cpu_skinny.available():
        return f"kernels/cpu/skinny.c (fp32, <= {cpu_skinny.MAX_ROWS} rows per expert, or small experts), built in {cpu_cc.cache_dir()}"
    return f"torch GEMMs per expert (skinny kernel unavailable: {cpu_skinny.unavailable_reason()})"


def _prefill_status() -> str:
    """What fp32 prefill runs on (cpu_experts, cpu_onednn, cpu_prepack, cpu_rows), and why."""
    from moe_compile.kernels.cpu import experts as cpu_experts, onednn as cpu_onednn, prepack as cpu_prepack, rows as cpu_rows

    if not cpu_prepack.available():
        return f"per-expert GEMMs (oneDNN, or MKL without it) on the weights as held (packed weights unavailable: {cpu_prepack.unavailable_reason()})"
    packs = f"inference packs expert weights at the second call that sees them unchanged ({cpu_prepack.ENV}=0: off)"
    fused = (f"kernels/cpu/experts.c ({'AVX-512' if cpu_experts.best_isa() == cpu_experts.ISA_AVX512 else 'AVX2'} "
             f"tiles) for SwiGLU experts without biases" if cpu_experts.available()
             else f"no fused experts kernel ({cpu_experts.unavailable_reason()})")
    if not cpu_onednn.available():
        return f"{packs}; {fused}; others per-expert MKL GEMMs (oneDNN unavailable: {cpu_onednn.unavailable_reason()})"
    rows = ("kernels/cpu/rows.c" if cpu_rows.available()
            else f"torch ops (row kernels unavailable: {cpu_rows.unavailable_reason()})")
    return f"{packs}; {fused}; others oneDNN GEMMs per expert with gather, SwiGLU and combine on {rows}"


def describe() -> str:
    lines = [f"cpu: {torch.backends.cpu.get_cpu_capability()} -> {cpu_kind().name}: "
             f"{', '.join(cpu_kind().variants)} via {cpu_kind().kernel}", f"cpu decode: {_skinny_status()}",
             f"cpu prefill: {_prefill_status()}"]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            cap = torch.cuda.get_device_capability(i)
            kind = CUDA_KINDS.get(cap, DeviceKind(f"sm{cap[0]}{cap[1]}", ("a16w16",), "reference (no tuned kernel)"))
            lines.append(f"cuda:{i}: {torch.cuda.get_device_name(i)} {kind.name}: {', '.join(kind.variants)} via "
                         f"{kind.kernel}")
    else:
        lines.append("cuda: not available")
    lines.append("ascend (data only): " + "; ".join(
        f"{k}: {', '.join(v) or 'not supported'}" for k, v in ASCEND_VARIANTS.items()))
    return "\n".join(lines)
