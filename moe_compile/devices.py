"""Which kernel variants each device runs natively, as frozen data (docs/architecture.md#devices-and-variants)."""

from __future__ import annotations

import dataclasses

import torch

from moe_compile.kernels.cpu.isa import cpu_flags  # noqa: F401  (here too: what the device table reads)


@dataclasses.dataclass(frozen=True)
class Variant:
    """One kernel variant a device kind runs: which kernel, and whether it was measured on one."""

    name: str  # "a16w16" or a quant format ("w4-int", "a8w8-int", ...)
    kernel: str  # the file that runs it; "" where none is built
    verified: bool  # tested against quant.reference_moe on such a device (emulated counts, and says so)
    note: str = ""

    def line(self) -> str:
        state = "verified" if self.verified else ("unverified" if self.kernel else "absent")
        where = f" via {self.kernel}" if self.kernel else ""
        return f"{self.name}: {state}{where}" + (f" ({self.note})" if self.note else "")


@dataclasses.dataclass(frozen=True)
class DeviceKind:
    name: str
    features: str  # what selects this row
    variants: tuple[Variant, ...]
    reference_only: bool = False
    note: str = ""  # how "verified" was obtained, or why not  # data from a vendor table: no kernel of this package runs there

    @property
    def kernel(self) -> str:
        return self.variants[0].kernel if self.variants else ""

    def names(self, verified_only: bool = False) -> tuple[str, ...]:
        return tuple(v.name for v in self.variants if v.kernel and (v.verified or not verified_only))


_FP32 = Variant("a16w16", "kernels/cpu/forward.py", True)
_DECODE_PREFILL = "kernels/cpu/qdecode.c (T <= 16) + qgemm.c"
_WEIGHT_ONLY = ("w16", "w8-int", "w4-int", "mxfp4", "mxfp8")


def _cpu_kind(name: str, features: str, isa: str, verified: bool, note: str) -> DeviceKind:
    return DeviceKind(name, features, _cpu_variants(isa, verified), note=note)


def _cpu_variants(isa: str, verified: bool) -> tuple[Variant, ...]:
    rows = [_FP32] + [Variant(f, _DECODE_PREFILL, verified) for f in _WEIGHT_ONLY]
    rows += [Variant(f, f"kernels/cpu/qdecode.c (T <= 16, vpmaddubsw) + qgemm.c ({isa} int8 tile)", verified)
             for f in ("a8w8-int", "a8w4-int")]
    rows.append(Variant("a8w8-fp8", "", False, "no CPU fp8 kernel"))
    return tuple(rows)


_TESTS = "verified: tests/kernels/cpu/test_qdecode.py / test_qgemm.py against quant.reference_moe on Zen 4"
CPU_KINDS = (
    _cpu_kind("cpu-avx2", "AVX2 + FMA + F16C", "AVX2 vpmaddubsw", True,
              _TESTS + ", AVX2 emulated (MOE_COMPILE_FUSED_ISA=avx2)"),
    _cpu_kind("cpu-avx512-vnni", "AVX-512 F/BW + VNNI", "AVX-512 VNNI vpdpbusd", True, _TESTS),
    _cpu_kind("cpu-avx512-bf16", "AVX-512 + VNNI + BF16", "AVX-512 VNNI vpdpbusd", True,
              _TESTS + "; the VNNI tiles run (no bf16 dot kernel)"),
    _cpu_kind("cpu-amx", "AMX tiles", "AVX-512 VNNI vpdpbusd", True,
              "verified: tests/kernels/cpu/test_qdecode.py / test_qgemm.py / test_blocktiles.py on a 2-core "
              "Intel Xeon with AMX (2026-12-06); the AVX-512 VNNI kernels run (AMX tiles not built; the float "
              "formats' prefill on fp32 tiles: vdpbf16ps does not outrun the FMA there)"),
)


_TRITON_QUANT = ("w8-int", "w4-int", "mxfp4", "a8w8-int", "a8w4-int")  # kernels/triton/quant_gemm.py


def _cuda_variants(quant: tuple[str, ...]) -> tuple[Variant, ...]:
    """GPU quantized variants: the Triton GEMMs of quant_gemm.py are interpreter-tested only and not
    dispatched (unverified: never chosen, an explicit request is refused); the rest are absent."""
    rows = [Variant("a16w16", "kernels/triton (bf16/fp16)", True)]
    for f in quant:
        if f in _TRITON_QUANT:
            rows.append(Variant(f, "kernels/triton/quant_gemm.py", False, "TRITON_INTERPRET=1 only, not dispatched"))
        else:
            rows.append(Variant(f, "", False, "Triton variant not built"))
    # the expert-parallel exchange (ep_dispatch / ep_combine) on CUDA: written, never run on a GPU yet
    rows.append(Variant("ep-a2a", "ep/a2a_cuda.py (symm_mem.all_to_all_vdev_2d with NVSHMEM, else rendezvous + "
                        "ep/a2a_triton.py)", False, "TRITON_INTERPRET=1 and Meta tensors only; "
                        "benchmarks/ep_gpu_check.py when a GPU is lent"))
    return tuple(rows)


CUDA_KINDS = {
    (8, 0): DeviceKind("sm80", "compute capability 8.0", _cuda_variants(("a8w8-int", "w4-int", "mxfp4"))),
    (8, 9): DeviceKind("sm89", "compute capability 8.9", _cuda_variants(("a8w8-int", "a8w8-fp8", "w4-int", "mxfp4"))),
    (9, 0): DeviceKind("sm90", "compute capability 9.0", _cuda_variants(("a8w8-int", "a8w8-fp8", "w4-int", "mxfp4"))),
    (10, 0): DeviceKind("sm100", "compute capability 10.0",
                        _cuda_variants(("a8w8-int", "a8w8-fp8", "w4-int", "mxfp4", "mxfp8"))),
}
# The seed operator's Ascend product table (its supported products, and which Linear data types
# each runs), kept as reference data: no Ascend kernel runs here.
ASCEND_VARIANTS = {
    "Ascend 950PR / 950DT": ("a8w8-fp", "a8w4-fp", "a4w4-fp"),
    "Atlas A3 training / inference": ("a16w16", "a8w8-int", "a8w4-int"),
    "Atlas A2 training / inference": ("a16w16", "a8w8-int", "a8w4-int"),
    "Atlas 200I/500 A2 inference": (),
    "Atlas inference series": (),
    "Atlas training series": (),
}
ASCEND_KINDS = tuple(
    DeviceKind(product, "Ascend mega_moe product table", tuple(Variant(v, "", False, "no kernel here") for v in vs),
               reference_only=True, note="the seed operator's product table")
    for product, vs in ASCEND_VARIANTS.items()
)


def cpu_kind() -> DeviceKind:
    """This CPU's row, and the features that chose it (``cpu_kind_reason``)."""
    return _cpu_kind_and_reason()[0]


def cpu_kind_reason() -> str:
    return _cpu_kind_and_reason()[1]


def _cpu_kind_and_reason():
    flags = cpu_flags()
    if "amx_tile" in flags or "amx" in flags:
        return CPU_KINDS[3], "flags amx_tile"
    if {"avx512f", "avx512bw", "avx512_vnni"} <= flags:
        if "avx512_bf16" in flags:
            return CPU_KINDS[2], "flags avx512f, avx512bw, avx512_vnni, avx512_bf16"
        return CPU_KINDS[1], "flags avx512f, avx512bw, avx512_vnni"
    if "avx512" in flags:  # torch's capability string only
        return CPU_KINDS[1], "torch reports AVX512"
    return CPU_KINDS[0], "no AVX-512 VNNI: AVX2"


def _native_here() -> list[str]:
    """Per quant format, what this machine's checkout runs natively (a Mixtral-like shape), with
    the whole reason of each one it does not (wrapped, never cut)."""
    from moe_compile.kernels.cpu import quant as cpu_quant

    native, _ = cpu_quant.native_formats(*_SHAPE)
    lines = [f"  {f}: decode on {regs['decode'] or '-'}, prefill on {regs['prefill'] or '-'}"
             for f, regs in native.items()]
    for fmt in (f for f in cpu_quant.FORMATS if f not in native):
        lines.append(f"  {fmt}: not native here:")
        lines += [_wrapped(f"{reg}: {why}", "    ") for reg, why in _refusals(fmt).items()]
    return lines


_SHAPE = (8, 1024, 2048)  # E, H, F of the question asked of the kernels (Mixtral-like)


def _refusals(fmt: str) -> dict[str, str]:
    """{regime: why no kernel runs fmt there}, each kernel's reason once (``qdecode: ...``)."""
    from moe_compile.kernels.cpu import quant as cpu_quant

    out = {}
    for reg in cpu_quant.KERNELS:
        mod, why = cpu_quant.kernel_for(fmt, reg, *_SHAPE)
        if mod is None:
            # a kernel's own reason may start with its name ("qdecode: qdecode serves ..."): say it once
            parts = [part.split(": ", 1) for part in why.split("; ")]
            out[reg] = "; ".join(p[1] if len(p) == 2 and p[1].startswith(p[0]) else ": ".join(p) for p in parts)
    return out


def _wrapped(text: str, indent: str) -> str:
    import textwrap

    return textwrap.fill(text, width=100, initial_indent=indent, subsequent_indent=indent + "  ",
                         break_long_words=False, break_on_hyphens=False)


def _skinny_status() -> str:
    """Whether fp32 decode runs on the skinny kernel (built here on first use) or on MKL, and why."""
    from moe_compile.kernels.cpu import cc as cpu_cc, skinny as cpu_skinny

    if cpu_skinny.available():
        from moe_compile.kernels.cpu import decode_op

        entry = ("the op's C++ CPU kernel (kernels/cpu/decode_op.cpp) calls it directly" if decode_op.install()
                 else f"entered from Python (decode_op.cpp: {decode_op.unavailable_reason()})")
        return (f"kernels/cpu/skinny.c (fp32, <= {cpu_skinny.MAX_ROWS} rows per expert, or small experts), built in "
                f"{cpu_cc.cache_dir()}; {entry}")
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


def describe(verbose: bool = False) -> str:
    """``moe-compile devices``: a short table of what this machine runs; ``verbose``: every kernel's
    state and why, the capability table's row, then the reference data (rows no kernel here runs)."""
    return _describe_verbose() if verbose else _describe_short()


def _describe_short() -> str:
    """One line per variant: whether this machine runs it, on which kernels, and the table's word."""
    from moe_compile.kernels.cpu import quant as cpu_quant

    kind = cpu_kind()
    native, _ = cpu_quant.native_formats(*_SHAPE)
    state = {v.name: v for v in kind.variants}
    rows = [("variant", "runs here", "decode (T <= 16)", "prefill", "tested on this CPU kind")]
    rows.append(("a16w16", "yes", *_fp32_kernels(), _verified(state.get("a16w16"))))
    for fmt in cpu_quant.FORMATS:
        regs = native.get(fmt)
        if regs and all(regs.values()):
            rows.append((fmt, "yes", f"{regs['decode']}.c", f"{regs['prefill']}.c", _verified(state.get(fmt))))
        else:
            why = state[fmt].note if fmt in state and state[fmt].note else "no kernel for this shape here"
            rows.append((fmt, "no", "-", "-", f"({why})"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    table = ["  " + "  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4] for r in rows]
    cuda = (", ".join(f"cuda:{i} {torch.cuda.get_device_name(i)}" for i in range(torch.cuda.device_count()))
            if torch.cuda.is_available() else "none")
    return "\n".join([
        f"CPU: {kind.name} ({cpu_kind_reason()}); GPU: {cuda}",
        *table,
        *([f"{kind.name}: {kind.note}"] if any(not v.verified for v in kind.variants if v.kernel) else []),
        "quant='auto' chooses among the variants that run here; an explicit quant= that does not is an error.",
        "On CUDA the op runs a16w16 (Triton); the GPU quantized kernels are not dispatched yet.",
        "moe-compile devices --verbose: each kernel's state and why, the capability table, GPU and Ascend rows.",
    ])


def _fp32_kernels() -> tuple[str, str]:
    """(decode, prefill) kernels of the unquantized op here, in a word each."""
    from moe_compile.kernels.cpu import experts as cpu_experts, onednn as cpu_onednn, skinny as cpu_skinny

    decode = "skinny.c" if cpu_skinny.available() else "torch GEMMs"
    gemms = "oneDNN" if cpu_onednn.available() else "torch GEMMs"
    return decode, f"experts.c, {gemms}" if cpu_experts.available() else gemms


def _verified(variant: Variant | None) -> str:
    if variant is None:
        return ""
    return "yes" if variant.verified else "no"


def _describe_verbose() -> str:
    """This machine's rows and why, then the reference data (rows no kernel here runs)."""
    kind = cpu_kind()
    lines = ["this machine:",
             f"cpu: {torch.backends.cpu.get_cpu_capability()} -> {kind.name} ({cpu_kind_reason()})",
             _wrapped(f"cpu decode: {_skinny_status()}", ""), _wrapped(f"cpu prefill: {_prefill_status()}", ""),
             f"cpu variants of {kind.name} (table; {kind.note}):"] + [f"  {v.line()}" for v in kind.variants]
    lines += ["cpu quantized variants this checkout runs (quant='auto' chooses among them):"] + _native_here()
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            cap = torch.cuda.get_device_capability(i)
            ck = CUDA_KINDS.get(cap, DeviceKind(f"sm{cap[0]}{cap[1]}", "unknown", (Variant("a16w16", "reference", False),)))
            lines.append(f"cuda:{i}: {torch.cuda.get_device_name(i)} -> {ck.name}:")
            lines += [f"  {v.line()}" for v in ck.variants]
    else:
        lines.append("cuda: not available")
    lines.append("")
    lines.append("reference data (no kernel here):")
    for ck in CUDA_KINDS.values():
        lines.append(f"  cuda {ck.name}:")
        lines += [f"    {v.line()}" for v in ck.variants]
    for ak in ASCEND_KINDS:
        lines.append(f"  ascend {ak.name}: {', '.join(ak.names() or (v.name for v in ak.variants)) or 'not supported'}")
    return "\n".join(lines)
