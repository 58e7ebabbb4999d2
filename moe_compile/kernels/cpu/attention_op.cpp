// The CPU kernel of moe_compile::decode_attention in C++: a decode-size call goes from the
// dispatcher straight to attention.c's kernel, with no Python in between.
//
// Shapes:  B batch, H query heads, G key/value heads (H = G R), L query rows, S keys, D head dim.
//          q [B, H, L, D], k/v [B, G, S, D], mask none / bool / fp32 broadcastable to
//          [B, H, L, S] -> out [B, H, L, D] contiguous.
//
// Contract: fp32 q/k/v on the CPU with contiguous last dims, D a multiple of 16, L <= max_rows,
// no gradient asked for, and the kernel armed (attention.py: install): attention.c runs it.
// Every other call, and any the kernel declines (a row with every key masked), goes unchanged to
// moe_compile::decode_attention_general, torch's SDPA.
//
// Built on first use by moe_compile/kernels/cpu/attention.py (never at import); loading it
// registers the CPU kernel ahead of the Python one registered for every backend.
#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>
#include <optional>

namespace {

using AttentionRun = int (*)(const int64_t* plan, double scale, int64_t threads);
AttentionRun attention_run = nullptr;  // attention.c's moe_decode_attention
int64_t max_rows = 0;
std::atomic<int64_t> fast_calls{0};

at::Tensor general(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& mask,
                   double scale) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("moe_compile::decode_attention_general", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const std::optional<at::Tensor>&, double)>();
  return op.call(q, k, v, mask, scale);
}

bool rows_ok(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat && t.device().is_cpu() && t.dim() == 4 && t.stride(3) == 1;
}

// The mask's strides over [B, H, L, S] (0 where it broadcasts) into plan[at..at+3]; false when it
// does not broadcast to that shape or has another dtype.
bool mask_strides(const at::Tensor& mask, const int64_t (&shape)[4], int64_t* out) {
  if (!mask.device().is_cpu() || mask.dim() > 4 || (mask.scalar_type() != at::kBool && mask.scalar_type() != at::kFloat))
    return false;
  int64_t lead = 4 - mask.dim();
  for (int64_t d = 0; d < 4; ++d) {
    int64_t size = d < lead ? 1 : mask.size(d - lead);
    if (size != shape[d] && size != 1) return false;
    out[d] = size == 1 ? 0 : mask.stride(d - lead);
  }
  return true;
}

at::Tensor decode_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const std::optional<at::Tensor>& mask, double scale) {
  bool grad = c10::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad());
  if (grad || attention_run == nullptr || !rows_ok(q) || !rows_ok(k) || !rows_ok(v) || k.sizes() != v.sizes())
    return general(q, k, v, mask, scale);
  int64_t B = q.size(0), H = q.size(1), L = q.size(2), D = q.size(3), G = k.size(1), S = k.size(2);
  if (k.size(0) != B || k.size(3) != D || G == 0 || H % G || L > max_rows || D % 16 || B * H * L * S == 0)
    return general(q, k, v, mask, scale);
  at::Tensor out = at::detail::empty_cpu({B, H, L, D}, at::kFloat, false, c10::nullopt);
  int64_t plan[28] = {reinterpret_cast<int64_t>(q.data_ptr()), reinterpret_cast<int64_t>(k.data_ptr()),
                      reinterpret_cast<int64_t>(v.data_ptr()), 0, reinterpret_cast<int64_t>(out.data_ptr()),
                      B, H, G, L, S, D,
                      q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                      v.stride(0), v.stride(1), v.stride(2), 0, 0, 0, 0, 0, H * L * D, L * D, D};
  if (mask) {
    const int64_t shape[4] = {B, H, L, S};
    if (!mask_strides(*mask, shape, plan + 20)) return general(q, k, v, mask, scale);
    plan[3] = reinterpret_cast<int64_t>(mask->data_ptr());
    plan[24] = mask->scalar_type() == at::kBool ? 1 : 2;
  }
  if (attention_run(plan, scale, at::get_num_threads()) != 0) return general(q, k, v, mask, scale);
  fast_calls.fetch_add(1, std::memory_order_relaxed);
  return out;
}

}  // namespace

extern "C" void moe_attention_op_set_kernel(void* run, int64_t rows) {
  attention_run = reinterpret_cast<AttentionRun>(run), max_rows = rows;
}

extern "C" int64_t moe_attention_op_fast_calls(void) { return fast_calls.load(std::memory_order_relaxed); }

TORCH_LIBRARY_IMPL(moe_compile, CPU, m) { m.impl("decode_attention", TORCH_FN(decode_attention_cpu)); }
