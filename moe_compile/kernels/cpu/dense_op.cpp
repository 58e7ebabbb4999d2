// The CPU kernel of moe_compile::dense_linear in C++: a decode-size call goes from the dispatcher
// straight to its C kernel (skinny.c for fp32 weights, qdecode.c's moe_qdecode_linear for packed
// ones), with no Python in between.
//
// Shapes:  T rows (<= the kernel's max), K input width, N output width.
//          x [..., K] fp32 contiguous, weight [N, K] contiguous, bias [N] fp32 or none -> y [..., N].
//
// Why: a decode step of a 4-layer MoE LM calls 21 dense linears; through the Python kernel each
// costs ~40-60 us beside its weights' read (dispatcher, argument checks, ctypes), ~1 ms a step,
// as much as llama.cpp's whole per-step overhead.  Here the checks read the TensorImpl fields.
//
// Contract: fmt "none" with an fp32 weight and T <= skinny_rows runs skinny.c's GEMM; any other
// fmt runs on the pack Python registered for this very weight (kernels/cpu/dense.py: after the
// pack is made, with a weak reference to the weight, its version and data pointer).  Every other
// call (prefill, another dtype, an updated weight, a training call) goes unchanged to
// moe_compile::dense_linear_general, the Python path.  Both paths call the same C kernels, so
// they give the same bits.
//
// Built on first use by moe_compile/kernels/cpu/dense.py (never at import); loading it registers
// the CPU kernel ahead of the Python one registered for every backend.
#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

using SkinnyRun = void (*)(const int64_t* tasks, int64_t n_tasks, int64_t threads);
using LinearRun = int (*)(const int64_t* plan, int64_t threads);
SkinnyRun skinny_run = nullptr;  // skinny.c's moe_skinny_run_parallel
LinearRun linear_run = nullptr;  // qdecode.c's moe_qdecode_linear
int64_t skinny_rows = 0, linear_rows = 0, isa = 0;
std::atomic<int64_t> fast_calls{0};

struct Pack {
  c10::weak_intrusive_ptr<c10::TensorImpl> weight;
  int64_t version = 0;
  void* data = nullptr;
  std::string fmt;
  std::vector<at::Tensor> keep;  // kept alive here: the fields point into them
  int64_t fields[6] = {};        // qdecode's [data, scale, format code, group, rows16 data, rows16 scale]
};
std::mutex packs_mutex;
std::unordered_map<std::string, Pack> packs;  // by (weight, format, group): pack_key

// One pack per (weight, format, group), the op's own arguments (group 0: the format's default): a
// weight read in two formats or two groups (two compiles, a benchmark) keeps both, and a call
// never runs on a pack of another group.
std::string pack_key(const at::Tensor& weight, c10::string_view fmt, int64_t group) {
  std::string key = std::to_string(reinterpret_cast<uintptr_t>(weight.unsafeGetTensorImpl()));
  key.push_back('\0');
  key.append(fmt.data(), fmt.size());
  key.push_back('\0');
  key.append(std::to_string(group));
  return key;
}

void register_pack(const at::Tensor& weight, c10::string_view fmt, int64_t group, at::TensorList keep,
                   at::IntArrayRef fields) {
  TORCH_CHECK(fields.size() == 6, "dense_register: 6 fields, got ", fields.size());
  Pack p{c10::weak_intrusive_ptr<c10::TensorImpl>(weight.getIntrusivePtr()), weight._version(), weight.data_ptr(),
         std::string(fmt), keep.vec()};
  std::memcpy(p.fields, fields.data(), sizeof(p.fields));
  std::lock_guard<std::mutex> lock(packs_mutex);
  if (packs.size() > 4096)  // weights of dropped models
    for (auto it = packs.begin(); it != packs.end();) it = it->second.weight.expired() ? packs.erase(it) : ++it;
  packs.insert_or_assign(pack_key(weight, fmt, group), std::move(p));
}

void prune_packs() {  // the packs of weights that are gone
  std::lock_guard<std::mutex> lock(packs_mutex);
  for (auto it = packs.begin(); it != packs.end();) it = it->second.weight.expired() ? packs.erase(it) : ++it;
}

void forget_packs() {
  std::lock_guard<std::mutex> lock(packs_mutex);
  packs.clear();
}

// The registered pack's fields for this very weight in fmt and group, unchanged since; false otherwise.
bool pack_fields(const at::Tensor& weight, c10::string_view fmt, int64_t group, int64_t* fields) {
  std::lock_guard<std::mutex> lock(packs_mutex);
  auto found = packs.find(pack_key(weight, fmt, group));
  if (found == packs.end()) return false;
  const Pack& p = found->second;
  if (p.fmt != fmt || p.weight.lock().get() != weight.unsafeGetTensorImpl() || p.version != weight._version() ||
      p.data != weight.data_ptr())
    return false;
  std::memcpy(fields, p.fields, sizeof(p.fields));
  return true;
}

at::Tensor general(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                   c10::string_view fmt, int64_t group) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("moe_compile::dense_linear_general", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                         c10::string_view, int64_t)>();
  return op.call(x, weight, bias, fmt, group);
}

bool plain(const at::Tensor& t, at::ScalarType dtype) {
  return t.scalar_type() == dtype && t.device().is_cpu() && t.is_contiguous();
}

at::Tensor dense_linear_cpu(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                            c10::string_view fmt, int64_t group) {
  bool grad = c10::GradMode::is_enabled() &&
              (x.requires_grad() || weight.requires_grad() || (bias && bias->requires_grad()));
  if (grad || x.dim() < 1 || weight.dim() != 2 || !plain(x, at::kFloat) || x.size(-1) != weight.size(1) ||
      (bias && !(plain(*bias, at::kFloat) && bias->dim() == 1 && bias->size(0) == weight.size(0))))
    return general(x, weight, bias, fmt, group);
  int64_t K = weight.size(1), N = weight.size(0), T = K ? x.numel() / K : 0;
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  bool fp32 = fmt == "none" && plain(weight, at::kFloat);
  int64_t fields[6];
  if (T <= 0 || K == 0) return general(x, weight, bias, fmt, group);
  if (fp32 && skinny_run != nullptr && T <= skinny_rows) {
    at::Tensor y = at::detail::empty_cpu(out_shape, at::kFloat, false, c10::nullopt);
    // skinny.c's task fields: w, x, y, bias, rows, k, n_out, ldw, ldx, ldy, transposed, xidx, yidx, scale
    const int64_t task[14] = {reinterpret_cast<int64_t>(weight.data_ptr()), reinterpret_cast<int64_t>(x.data_ptr()),
                              reinterpret_cast<int64_t>(y.data_ptr()),
                              bias ? reinterpret_cast<int64_t>(bias->data_ptr()) : 0, T, K, N, K, K, N, 0, 0, 0, 0};
    skinny_run(task, 1, at::get_num_threads());
    fast_calls.fetch_add(1, std::memory_order_relaxed);
    return y;
  }
  if (fp32 || linear_run == nullptr || T > linear_rows || !pack_fields(weight, fmt, group, fields))
    return general(x, weight, bias, fmt, group);
  at::Tensor y = at::detail::empty_cpu(out_shape, at::kFloat, false, c10::nullopt);
  const int64_t plan[12] = {reinterpret_cast<int64_t>(x.data_ptr()), T, K, N, reinterpret_cast<int64_t>(y.data_ptr()),
                            isa, fields[0], fields[1], fields[2], fields[3], fields[4], fields[5]};
  if (linear_run(plan, at::get_num_threads()) != 0) return general(x, weight, bias, fmt, group);
  if (bias) {
    float* out = y.data_ptr<float>();
    const float* b = bias->data_ptr<float>();
    for (int64_t t = 0; t < T; ++t)
      for (int64_t n = 0; n < N; ++n) out[t * N + n] += b[n];
  }
  fast_calls.fetch_add(1, std::memory_order_relaxed);
  return y;
}

}  // namespace

extern "C" void moe_dense_op_set_kernels(void* skinny, int64_t s_rows, void* linear, int64_t l_rows, int64_t l_isa) {
  skinny_run = reinterpret_cast<SkinnyRun>(skinny), skinny_rows = s_rows;
  linear_run = reinterpret_cast<LinearRun>(linear), linear_rows = l_rows, isa = l_isa;
}

extern "C" int64_t moe_dense_op_fast_calls(void) { return fast_calls.load(std::memory_order_relaxed); }

TORCH_LIBRARY_FRAGMENT(moe_compile, m) {
  m.def("dense_register(Tensor weight, str fmt, int group, Tensor[] keep, int[] fields) -> ()",
        TORCH_FN(register_pack));
  m.def("dense_forget() -> ()", TORCH_FN(forget_packs));
  m.def("dense_prune() -> ()", TORCH_FN(prune_packs));
}

TORCH_LIBRARY_IMPL(moe_compile, CPU, m) { m.impl("dense_linear", TORCH_FN(dense_linear_cpu)); }
