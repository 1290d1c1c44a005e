// The decoder stack in one call (TORCH_LIBRARY troupe_stack): every layer of a Llama-family model, each
// the same sequence of the cpu set's ops that `troupe.models.llama.DecoderLayer.forward` makes from Python
// (residual add + RMSNorm, qkv projection, rotary + KV write, paged attention, o projection, residual add
// + RMSNorm, gate/up projection, SiLU x up, down projection), called through torch's dispatcher from here.
//
// Why: a decode step of a small model is ~300 op calls; from Python each costs a few microseconds of
// argument parsing and boxing on top of the kernel, a large share of a single-stream step of a small model
// (docs/kernels.md). From C++ the same calls go straight to the unboxed kernels. The kernels, their
// order and their arguments are the Python path's, so the results are the same bit for bit.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/split_with_sizes.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

namespace troupe_stack {
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

struct Ops {
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, int64_t, const OptTensor&, int64_t)> linear;
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, int64_t, const OptTensor&, int64_t)> linear_q8;
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, int64_t, const OptTensor&, int64_t)> linear_bf16;
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, double)> rms_norm;
  c10::TypedOperatorHandle<void(const Tensor&, const Tensor&, const Tensor&, double)> add_rms_norm_;
  c10::TypedOperatorHandle<Tensor(const Tensor&)> silu_and_mul;
  c10::TypedOperatorHandle<void(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                const Tensor&, const Tensor&, const Tensor&)>
      rope_and_cache;
  c10::TypedOperatorHandle<void(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, double,
                                int64_t, int64_t, double)>
      paged_attention;
};

template <typename Sig>
c10::TypedOperatorHandle<Sig> find(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

// Looked up on the first call: the other extensions register their ops when they load (before this one).
const Ops& ops() {
  static const Ops o{
      find<Tensor(const Tensor&, const Tensor&, int64_t, const OptTensor&, int64_t)>("troupe_qmm::linear"),
      find<Tensor(const Tensor&, const Tensor&, int64_t, const OptTensor&, int64_t)>("troupe_qmm::linear_q8"),
      find<Tensor(const Tensor&, const Tensor&, int64_t, const OptTensor&, int64_t)>("troupe_qmm::linear_bf16"),
      find<Tensor(const Tensor&, const Tensor&, double)>("troupe_fused::rms_norm"),
      find<void(const Tensor&, const Tensor&, const Tensor&, double)>("troupe_fused::add_rms_norm_"),
      find<Tensor(const Tensor&)>("troupe_fused::silu_and_mul"),
      find<void(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                const Tensor&, const Tensor&)>("troupe_fused::rope_and_cache"),
      find<void(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                const Tensor&, const Tensor&, const Tensor&, const Tensor&, double, int64_t, int64_t, double)>(
          "troupe_attention::paged_attention"),
  };
  return o;
}

// x (T, hidden) float32, the embedding: runs every layer and returns (the last layer's output, the residual
// stream it is to be added to), as the Python loop over `DecoderLayer.forward` does. Per layer l: weights
// [4l .. 4l + 3] = qkv, o, gate_up, down (GGUF blocks, their `qtypes`, optional `biases`); `mode`: the
// activations, 0 float32 (`linear`), 1 8-bit (`linear_q8`), 2 bfloat16 batches (`linear_bf16`). The attention plan (items .. attn_out, threads) is the step's, built once.
std::tuple<Tensor, Tensor> decoder_stack(
    const Tensor& embedded, const Tensor& positions, const Tensor& rope, at::TensorList k_pools,
    at::TensorList v_pools, const Tensor& slot_mapping, const Tensor& block_tables, const Tensor& seq_lens,
    const Tensor& query_start_loc, const Tensor& items, const Tensor& merges, const Tensor& scratch,
    const Tensor& attn_out, double scale, int64_t threads, at::TensorList input_norms, at::TensorList post_norms,
    at::TensorList weights, at::IntArrayRef qtypes, const c10::List<OptTensor>& biases, int64_t mode, double eps,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
  const int64_t L = static_cast<int64_t>(k_pools.size());
  TORCH_CHECK(embedded.dim() == 2 && embedded.scalar_type() == at::kFloat, "decoder_stack: x must be (T, hidden) float32");
  TORCH_CHECK(static_cast<int64_t>(v_pools.size()) == L && static_cast<int64_t>(input_norms.size()) == L &&
                  static_cast<int64_t>(post_norms.size()) == L,
              "decoder_stack: one K pool, V pool and pair of norms per layer");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == 4 * L && static_cast<int64_t>(qtypes.size()) == 4 * L &&
                  static_cast<int64_t>(biases.size()) == 4 * L,
              "decoder_stack: four projections (qkv, o, gate_up, down) per layer");
  const Ops& o = ops();
  TORCH_CHECK(mode >= 0 && mode <= 2, "decoder_stack: mode must be 0, 1 or 2, got ", mode);
  const auto& lin = mode == 1 ? o.linear_q8 : mode == 2 ? o.linear_bf16 : o.linear;
  const int64_t T = embedded.size(0);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const std::vector<int64_t> split{q_size, kv_size, kv_size};
  auto project = [&](const Tensor& in, int64_t i) {
    const OptTensor bias = biases.get(i);
    return lin.call(in, weights[i], qtypes[i], bias, -1);
  };
  Tensor x = embedded, residual;
  for (int64_t l = 0; l < L; ++l) {
    Tensor h;
    if (!residual.defined()) {
      h = o.rms_norm.call(x, input_norms[l], eps);
      residual = x;
    } else {
      o.add_rms_norm_.call(x, residual, input_norms[l], eps);
      h = x;
    }
    const Tensor qkv = project(h, 4 * l);
    const auto parts = at::split_with_sizes(qkv, split, -1);
    const Tensor q = parts[0].view({T, num_heads, head_dim});
    const Tensor k = parts[1].view({T, num_kv_heads, head_dim});
    const Tensor v = parts[2].reshape({T, num_kv_heads, head_dim});
    o.rope_and_cache.call(positions, q, k, v, rope, k_pools[l], v_pools[l], slot_mapping);
    o.paged_attention.call(q, k_pools[l], v_pools[l], block_tables, seq_lens, query_start_loc, items, merges,
                           scratch, attn_out, scale, threads, /*window=*/0, /*softcap=*/0.0);
    const Tensor attn = project(attn_out.reshape({T, q_size}), 4 * l + 1);
    o.add_rms_norm_.call(attn, residual, post_norms[l], eps);
    x = project(o.silu_and_mul.call(project(attn, 4 * l + 2)), 4 * l + 3);
  }
  return {x, residual};
}

}  // namespace
}  // namespace troupe_stack

TORCH_LIBRARY(troupe_stack, m) {
  m.def(
      "decoder_stack(Tensor x, Tensor positions, Tensor rope, Tensor[] k_pools, Tensor[] v_pools, "
      "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, Tensor items, "
      "Tensor merges, Tensor scratch, Tensor attn_out, float scale, int threads, Tensor[] input_norms, "
      "Tensor[] post_norms, Tensor[] weights, int[] qtypes, Tensor?[] biases, int mode, float eps, int num_heads, "
      "int num_kv_heads, int head_dim) -> (Tensor, Tensor)",
      &troupe_stack::decoder_stack);
}
