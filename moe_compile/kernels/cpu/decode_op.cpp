// The CPU kernels of moe_compile::fused_moe_infer and fused_moe_quant in C++: a plain decode step
// goes from the dispatcher straight to its C kernel (skinny.c's moe_skinny_decode for fp32,
// qdecode.c's moe_qdecode_run on packed weights), with no Python in between.
//
// Shapes:  T tokens (<= max_rows), H hidden, F expert FFN width, E experts, K experts per token.
//          x [T, H] fp32, ids [T, K] int32/int64, gates [T, K] fp32 -> y [T, H] fp32;
//          every weight role one stacked tensor: fc1 [E, F2, H] (F2 = 2F, or F with fc1_up),
//          fc2 [E, H, F] ([E, in, out] when transposed), biases [E, n].
//
// Why: with the caches cold (a decode step streams tens of MiB of weights through them), the
// Python kernel spends ~60 us asking each tensor for its shape, strides and pointer and the
// dispatcher ~45 us handing it the 15 arguments as Python objects: 10% of a Mixtral-like step
// on a 2-core EPYC, the margin llama.cpp's all-C graph has over us.  Here the same checks read
// the TensorImpl fields directly.
//
// Contract (fused_moe_infer): the checks are decode.decode_args's, one for one; a call they do
// not take (another dtype or layout, per-expert weight lists, a training call, bad input) goes,
// unchanged, to moe_compile::fused_moe_infer_general, the Python path (which raises for bad
// input).  Both paths give the same bits: the fast one is moe_skinny_decode, which decode_args
// also calls.
//
// Contract (fused_moe_quant): packing and quant="auto"'s choice stay in Python (kernels/cpu/
// quant.py).  Once Python has run a layer's decode step in qdecode, it registers the packs here
// under (tag, quant, accuracy_db), with weak references to the model's weight tensors and their
// versions and data pointers.  A later decode call whose weights are those very tensors,
// unchanged, with no biases and fp32 / int64 inputs, runs here; every other call (another T, an
// in-place update, a new model under the same tag, ...) goes to fused_moe_quant_general, which
// packs again and registers anew.
//
// Built on first use by moe_compile/kernels/cpu/decode_op.py (never at import), which hands
// over the address of moe_skinny_decode before the first call: loading this file registers
// the CPU kernel, taking precedence over the Python one registered for every backend.
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
#include <string>
#include <unordered_map>
#include <vector>

namespace {

using DecodeKernel = int (*)(const int64_t* plan, float limit, int64_t threads);
DecodeKernel decode_kernel = nullptr;  // skinny.c's moe_skinny_decode
int64_t max_rows = 0;                  // skinny.MAX_ROWS
std::atomic<int64_t> fast_calls{0};    // calls these kernels ran themselves (tests tell the paths apart)

using QuantKernel = int (*)(const int64_t* plan, float limit, int64_t threads);
QuantKernel quant_kernel = nullptr;  // qdecode.c's moe_qdecode_run
int64_t quant_max_rows = 0;          // qdecode.MAX_ROWS

// The plan of skinny.c's moe_skinny_decode: its P_* fields, then R_* fields per role.
enum { P_X, P_LDX, P_IDS, P_IDS_INT32, P_GATES, P_T, P_K, P_E, P_Y, P_LDY, P_HIDDEN, P_FFN,
       P_UP_SEPARATE, P_TRANSPOSED, P_INTERLEAVED, P_BETWEEN, P_ROLES };
enum { ROLE_FIELDS = 3, ROLES = 6, PLAN_FIELDS = P_ROLES + ROLES * ROLE_FIELDS };

bool fp32_cpu(const at::Tensor& t) { return t.scalar_type() == at::kFloat && t.device().is_cpu(); }

bool needs_grad(const at::Tensor& x, const at::Tensor& gates, std::initializer_list<at::TensorList> roles) {
  if (!c10::GradMode::is_enabled()) return false;
  if (x.requires_grad() || gates.requires_grad()) return true;
  for (auto role : roles)
    for (const auto& t : role)
      if (t.requires_grad()) return true;
  return false;
}

// A role's three plan fields (base pointer, bytes between experts, row stride in elements; 0 for
// a bias), or false when it is not one fp32 CPU tensor of `shape` with a contiguous last dim.
bool role_fields(at::TensorList role, c10::IntArrayRef shape, int64_t* fields) {
  if (role.empty()) {
    fields[0] = fields[1] = fields[2] = 0;
    return true;
  }
  const at::Tensor& t = role[0];
  if (role.size() != 1 || !fp32_cpu(t) || t.sizes() != shape || t.strides().back() != 1) return false;
  fields[0] = reinterpret_cast<int64_t>(t.data_ptr());
  fields[1] = t.strides()[0] * static_cast<int64_t>(sizeof(float));
  fields[2] = shape.size() == 3 ? t.strides()[1] : 0;
  return true;
}

at::Tensor general(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& gates, at::TensorList fc1,
                   at::TensorList fc1_up, at::TensorList fc2, at::TensorList b1, at::TensorList b1_up,
                   at::TensorList b2, c10::string_view gate_up, bool transposed, c10::string_view activation,
                   double limit, double alpha, c10::string_view weight_on) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("moe_compile::fused_moe_infer_general", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::TensorList,
                                         at::TensorList, at::TensorList, at::TensorList, at::TensorList,
                                         at::TensorList, c10::string_view, bool, c10::string_view, double, double,
                                         c10::string_view)>();
  return op.call(x, ids, gates, fc1, fc1_up, fc2, b1, b1_up, b2, gate_up, transposed, activation, limit, alpha,
                 weight_on);
}

// The plan of a call the fast path takes (false otherwise); y's pointer is filled in later.
bool plan_of(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& gates, at::TensorList fc1,
             at::TensorList fc1_up, at::TensorList fc2, at::TensorList b1, at::TensorList b1_up, at::TensorList b2,
             c10::string_view gate_up, bool transposed, c10::string_view activation, double limit,
             c10::string_view weight_on, int64_t* plan) {
  bool separate = gate_up == "separate", interleaved = gate_up == "interleaved";
  if (activation != "silu" || !(separate || interleaved || gate_up == "concat") || !(limit >= 0)) return false;
  if (weight_on != "output" && weight_on != "between") return false;
  if (fc1.size() != 1 || fc2.size() != 1 || fc1_up.size() != (separate ? 1u : 0u) || b1_up.size() > fc1_up.size())
    return false;
  if (!fp32_cpu(x) || x.dim() != 2 || x.stride(1) != 1) return false;
  int64_t T = x.size(0), H = x.size(1);
  if (T <= 0 || T > max_rows) return false;
  if (ids.dim() != 2 || ids.size(0) != T || ids.size(1) == 0 || !ids.device().is_cpu() || !ids.is_contiguous())
    return false;
  if (ids.scalar_type() != at::kLong && ids.scalar_type() != at::kInt) return false;
  if (!fp32_cpu(gates) || gates.sizes() != ids.sizes() || !gates.is_contiguous()) return false;
  const at::Tensor& w2 = fc2[0];
  if (w2.dim() != 3) return false;
  int64_t E = w2.size(0), F = w2.size(transposed ? 1 : 2), n1 = separate ? F : 2 * F;
  const int64_t fc1_shape[3] = {E, transposed ? H : n1, transposed ? n1 : H};
  const int64_t fc2_shape[3] = {E, transposed ? F : H, transposed ? H : F};
  const int64_t b1_shape[2] = {E, n1}, b1_up_shape[2] = {E, F}, b2_shape[2] = {E, H};
  const c10::IntArrayRef shapes[ROLES] = {fc1_shape, fc1_shape, fc2_shape, b1_shape, b1_up_shape, b2_shape};
  const at::TensorList roles[ROLES] = {fc1, fc1_up, fc2, b1, b1_up, b2};
  for (int r = 0; r < ROLES; ++r)
    if (!role_fields(roles[r], shapes[r], plan + P_ROLES + r * ROLE_FIELDS)) return false;
  plan[P_X] = reinterpret_cast<int64_t>(x.data_ptr()), plan[P_LDX] = x.stride(0);
  plan[P_IDS] = reinterpret_cast<int64_t>(ids.data_ptr()), plan[P_IDS_INT32] = ids.scalar_type() == at::kInt;
  plan[P_GATES] = reinterpret_cast<int64_t>(gates.data_ptr()), plan[P_T] = T, plan[P_K] = ids.size(1);
  plan[P_E] = E, plan[P_Y] = 0, plan[P_LDY] = H, plan[P_HIDDEN] = H, plan[P_FFN] = F;
  plan[P_UP_SEPARATE] = separate, plan[P_TRANSPOSED] = transposed, plan[P_INTERLEAVED] = interleaved;
  plan[P_BETWEEN] = weight_on == "between";
  return true;
}

at::Tensor fused_moe_infer_cpu(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& gates,
                               at::TensorList fc1, at::TensorList fc1_up, at::TensorList fc2, at::TensorList b1,
                               at::TensorList b1_up, at::TensorList b2, c10::string_view gate_up, bool transposed,
                               c10::string_view activation, double limit, double alpha, c10::string_view weight_on) {
  int64_t plan[PLAN_FIELDS];
  if (decode_kernel == nullptr || needs_grad(x, gates, {fc1, fc1_up, fc2, b1, b1_up, b2}) ||
      !plan_of(x, ids, gates, fc1, fc1_up, fc2, b1, b1_up, b2, gate_up, transposed, activation, limit, weight_on,
               plan))
    return general(x, ids, gates, fc1, fc1_up, fc2, b1, b1_up, b2, gate_up, transposed, activation, limit, alpha,
                   weight_on);
  at::Tensor y = at::detail::empty_cpu({x.size(0), x.size(1)}, at::kFloat, false, c10::nullopt);  // zeroed by the kernel
  plan[P_Y] = reinterpret_cast<int64_t>(y.data_ptr());
  if (decode_kernel(plan, static_cast<float>(limit), at::get_num_threads()) != 0)
    TORCH_CHECK_WITH(OutOfMemoryError, false, "skinny decode kernel: could not allocate its scratch");
  fast_calls.fetch_add(1, std::memory_order_relaxed);
  return y;
}


// ---- fused_moe_quant ----

// One registered layer: the model tensors its packs were made from (weakly held: the model owns
// them) with their versions and data pointers then, the packs (held: the kernel reads them), and
// qdecode's role fields [data, scale, format, group] of FC1 then FC2, then their rows16 panels.
struct QuantEntry {
  std::vector<c10::weak_intrusive_ptr<c10::TensorImpl>> weights;  // fc1, fc1_up (if any), fc2
  std::vector<int64_t> versions;
  std::vector<void*> data;
  std::vector<at::Tensor> packs;
  std::string gate_up;
  bool transposed = false;
  double accuracy_db = 0;
  int64_t fields[12] = {};  // qdecode.c's role fields of FC1 and FC2, then their rows16 panels
  int64_t isa = 0, experts = 0, hidden = 0, ffn = 0;
};

std::mutex quant_mutex;
std::unordered_map<std::string, QuantEntry> quant_entries;  // by tag + '\0' + quant

std::string quant_key(c10::string_view tag, c10::string_view quant) {
  std::string key(tag);
  key.push_back('\0');
  key.append(quant.data(), quant.size());
  return key;
}

void quant_register(c10::string_view tag, c10::string_view quant, double accuracy_db, at::TensorList weights,
                    at::TensorList packs, at::IntArrayRef fields, c10::string_view gate_up, bool transposed,
                    int64_t isa, int64_t experts, int64_t hidden, int64_t ffn) {
  TORCH_CHECK(fields.size() == 12 && (weights.size() == 2 || weights.size() == 3),
              "quant_decode_register: 12 fields and 2 or 3 weights, got ", fields.size(), " and ", weights.size());
  QuantEntry e;
  for (const auto& t : weights) {
    e.weights.emplace_back(t.getIntrusivePtr());
    e.versions.push_back(t._version());
    e.data.push_back(t.data_ptr());
  }
  e.packs.assign(packs.begin(), packs.end());
  e.gate_up = std::string(gate_up), e.transposed = transposed, e.accuracy_db = accuracy_db;
  std::memcpy(e.fields, fields.data(), sizeof(e.fields));
  e.isa = isa, e.experts = experts, e.hidden = hidden, e.ffn = ffn;
  std::lock_guard<std::mutex> lock(quant_mutex);
  quant_entries[quant_key(tag, quant)] = std::move(e);
}

void quant_forget() {
  std::lock_guard<std::mutex> lock(quant_mutex);
  quant_entries.clear();
}

// Whether t is the registered tensor i of e, unchanged since.
bool same_weight(const QuantEntry& e, size_t i, const at::Tensor& t) {
  return e.weights[i].lock().get() == t.unsafeGetTensorImpl() && t._version() == e.versions[i] &&
         t.data_ptr() == e.data[i];
}

// qdecode's plan of a call the fast path takes (false otherwise); y's pointer is filled in later.
bool quant_plan_of(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& gates, at::TensorList fc1,
                   at::TensorList fc1_up, at::TensorList fc2, at::TensorList b1, at::TensorList b1_up,
                   at::TensorList b2, c10::string_view gate_up, bool transposed, c10::string_view activation,
                   double limit, c10::string_view weight_on, c10::string_view quant, double accuracy_db,
                   c10::string_view tag, int64_t* plan) {
  if (activation != "silu" || !(limit >= 0) || (weight_on != "output" && weight_on != "between")) return false;
  if (!b1.empty() || !b1_up.empty() || !b2.empty() || fc1.size() != 1 || fc2.size() != 1 || fc1_up.size() > 1)
    return false;
  if (!fp32_cpu(x) || x.dim() != 2 || !x.is_contiguous()) return false;
  int64_t T = x.size(0);
  if (T <= 0 || T > quant_max_rows) return false;
  if (ids.dim() != 2 || ids.size(0) != T || ids.size(1) == 0 || ids.scalar_type() != at::kLong ||
      !ids.device().is_cpu() || !ids.is_contiguous())
    return false;
  if (!fp32_cpu(gates) || gates.sizes() != ids.sizes() || !gates.is_contiguous()) return false;
  std::lock_guard<std::mutex> lock(quant_mutex);
  auto found = quant_entries.find(quant_key(tag, quant));
  if (found == quant_entries.end()) return false;
  const QuantEntry& e = found->second;
  if (e.gate_up != gate_up || e.transposed != transposed || e.accuracy_db != accuracy_db) return false;
  if (e.weights.size() != 2 + fc1_up.size() || x.size(1) != e.hidden) return false;
  if (!same_weight(e, 0, fc1[0]) || (!fc1_up.empty() && !same_weight(e, 1, fc1_up[0])) ||
      !same_weight(e, e.weights.size() - 1, fc2[0]))
    return false;
  // qdecode.c's P_* fields, then its two roles' fields and their rows16 panels (P_FIELDS in all)
  const int64_t head[11] = {reinterpret_cast<int64_t>(x.data_ptr()), T, e.hidden, e.ffn,
                            reinterpret_cast<int64_t>(ids.data_ptr()), ids.size(1), e.experts,
                            reinterpret_cast<int64_t>(gates.data_ptr()), 0, weight_on == "between", e.isa};
  std::memcpy(plan, head, sizeof(head));
  std::memcpy(plan + 11, e.fields, sizeof(e.fields));
  return true;
}

at::Tensor quant_general(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& gates, at::TensorList fc1,
                         at::TensorList fc1_up, at::TensorList fc2, at::TensorList b1, at::TensorList b1_up,
                         at::TensorList b2, c10::string_view gate_up, bool transposed, c10::string_view activation,
                         double limit, double alpha, c10::string_view weight_on, c10::string_view quant,
                         double accuracy_db, c10::string_view tag) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("moe_compile::fused_moe_quant_general", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::TensorList,
                                         at::TensorList, at::TensorList, at::TensorList, at::TensorList,
                                         at::TensorList, c10::string_view, bool, c10::string_view, double, double,
                                         c10::string_view, c10::string_view, double, c10::string_view)>();
  return op.call(x, ids, gates, fc1, fc1_up, fc2, b1, b1_up, b2, gate_up, transposed, activation, limit, alpha,
                 weight_on, quant, accuracy_db, tag);
}

at::Tensor fused_moe_quant_cpu(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& gates,
                               at::TensorList fc1, at::TensorList fc1_up, at::TensorList fc2, at::TensorList b1,
                               at::TensorList b1_up, at::TensorList b2, c10::string_view gate_up, bool transposed,
                               c10::string_view activation, double limit, double alpha, c10::string_view weight_on,
                               c10::string_view quant, double accuracy_db, c10::string_view tag) {
  int64_t plan[23];
  if (quant_kernel == nullptr || needs_grad(x, gates, {fc1, fc1_up, fc2, b1, b1_up, b2}) ||
      !quant_plan_of(x, ids, gates, fc1, fc1_up, fc2, b1, b1_up, b2, gate_up, transposed, activation, limit,
                     weight_on, quant, accuracy_db, tag, plan))
    return quant_general(x, ids, gates, fc1, fc1_up, fc2, b1, b1_up, b2, gate_up, transposed, activation, limit,
                         alpha, weight_on, quant, accuracy_db, tag);
  at::Tensor y = at::detail::empty_cpu({x.size(0), x.size(1)}, at::kFloat, false, c10::nullopt);
  std::memset(y.data_ptr(), 0, static_cast<size_t>(y.numel()) * sizeof(float));  // the kernel adds into y
  plan[8] = reinterpret_cast<int64_t>(y.data_ptr());
  int status = quant_kernel(plan, static_cast<float>(limit), at::get_num_threads());
  TORCH_CHECK_WITH(OutOfMemoryError, status != -1, "qdecode: could not allocate its scratch");
  if (status != 0)  // a format / ISA the kernel refuses: the Python path says why
    return quant_general(x, ids, gates, fc1, fc1_up, fc2, b1, b1_up, b2, gate_up, transposed, activation, limit,
                         alpha, weight_on, quant, accuracy_db, tag);
  fast_calls.fetch_add(1, std::memory_order_relaxed);
  return y;
}

}  // namespace

// decode_op.py: the decode kernel's address and the rows it takes, before the first call.
extern "C" void moe_decode_op_set_kernel(void* kernel, int64_t rows) {
  decode_kernel = reinterpret_cast<DecodeKernel>(kernel);
  max_rows = rows;
}

extern "C" void moe_decode_op_set_quant_kernel(void* kernel, int64_t rows) {
  quant_kernel = reinterpret_cast<QuantKernel>(kernel);
  quant_max_rows = rows;
}

extern "C" int64_t moe_decode_op_fast_calls(void) { return fast_calls.load(std::memory_order_relaxed); }

TORCH_LIBRARY_FRAGMENT(moe_compile, m) {
  m.def("quant_decode_register(str tag, str quant, float accuracy_db, Tensor[] weights, Tensor[] packs, "
        "int[] fields, str gate_up, bool transposed, int isa, int experts, int hidden, int ffn) -> ()",
        TORCH_FN(quant_register));
  m.def("quant_decode_forget() -> ()", TORCH_FN(quant_forget));
}

TORCH_LIBRARY_IMPL(moe_compile, CPU, m) {
  m.impl("fused_moe_infer", TORCH_FN(fused_moe_infer_cpu));
  m.impl("fused_moe_quant", TORCH_FN(fused_moe_quant_cpu));
}
