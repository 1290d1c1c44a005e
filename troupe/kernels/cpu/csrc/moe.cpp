// The routed experts of one MoE layer in one call (TORCH_LIBRARY troupe_moe):
//
//   moe(x (T, h), ids (T, k), weights (T, k), gate[E] (f, h), up[E] (f, h), down[E] (h, f)) -> (T, h)
//   out[t] = sum_j weights[t, j] * down[e](silu(gate[e] x[t]) * up[e] x[t]),  e = ids[t, j]
//
// Every expert's weights are one format's raw blocks (quant.h; dense weights come as F32 / F16 / BF16
// "blocks"; gate and up in one format), each matrix where it is (a GGUF's: the file's mapped pages, so
// the weights are only read, never written, and start wherever the file puts them: nothing here assumes
// an alignment). The (token, slot) pairs are grouped by expert (a counting sort, token order within an
// expert) and each expert's rows of x gathered once.
//
// Experts with at most FUSED_MAX_M tokens (decode: T = 1, k = 2 gives two experts of one token) run fused,
// on the float rows kernel of the projections (qmatmul_rows.h, in passes of 4 rows):
// - pass 1: work items are (expert, run of gate rows), the runs sized for about ITEMS_PER_THREAD items per
//   thread over all fused experts (item_rows: long runs stream best); one item computes its gate rows and the
//   matching up rows for the expert's tokens and writes silu(gate) * up straight into the expert's
//   activation rows. One parallel region over all active experts' items: a decode step with two active
//   experts spreads them over every thread, where one projection call per expert would split each
//   expert's rows over the threads with a barrier between calls (and a third call for SiLU x up);
// - pass 2: the same over (expert, run of down rows), into each pair's output row;
// - the weighted sum: each token's rows added in expert order (transformers' order), out written once.
// Experts with more tokens (prefill) run one projection call each through the dispatcher
// (troupe_qmm::linear / linear_q8: the by-M choice, the panel GEMM or the integer GEMM), SiLU x up
// between them, into the same pair rows before the weighted sum.
//
// 8-bit activations (`q8`): an expert is fused where troupe_qmm::q8_path picks the output-exact float path
// for its token count in both projections (every Intel and AVX-512 build at <= 4 rows); otherwise it takes
// linear_q8 per projection, as the unfused op does. Results are those of the projection kernels: the
// fused float path sums each output as qmatmul's rows path does (exact up to summation order).
//
// bfloat16 batches (`bf16`, the "gguf-bf16" mode): experts with more tokens than linear_bf16's rows limit
// (bf16_rows_max_m) take linear_bf16 (the bf16 panel GEMM); fused experts in a format the 16-bit rows path
// decodes (rows_i16.h: K-quants) take that path, on x's rows and then the activations' rows quantized to int16 once per call; others the float
// rows kernel, as without `bf16`.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#pragma GCC optimize("fp-contract=off")
#include "qmatmul_rows.h"
#include "quant.h"
#include "rows_i16.h"
#include "vec_attn.h"

namespace troupe_moe_silu {

using namespace troupe_vec;

// silu(g[j]) * u[j] for j < n, into o
inline void silu_mul(const float* g, const float* u, int64_t n, float* o) {
  const vf one = vset1(1.0f), zero = vzero();
  int64_t j = 0;
  for (; j + W <= n; j += W) {
    const vf gv = vload(g + j);
    vstore(o + j, vmul(vmul(gv, vdiv(one, vadd(one, vexp(vsub(zero, gv))))), vload(u + j)));
  }
  for (; j < n; ++j) o[j] = g[j] / (1.0f + std::exp(-g[j])) * u[j];
}

}  // namespace troupe_moe_silu

namespace troupe_moe {
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;
using namespace troupe_quant;

// Work items hold multiples of CHUNK weight rows: whole rows-kernel groups (R = 2 or 4); h and f are
// multiples of 32 (the blocks' K), so every item is whole.
constexpr int64_t CHUNK = 32;
constexpr int64_t ITEMS_PER_THREAD = 8;
// Tokens up to which an expert runs fused: qmatmul.cpp's ROWS_PATH_MAX_M (the rows path's measured reach).
#if defined(__AVX512F__)
constexpr int64_t FUSED_MAX_M = 12;
#else
constexpr int64_t FUSED_MAX_M = 4;
#endif

using LinearSig = Tensor(const Tensor&, const Tensor&, int64_t, const OptTensor&, int64_t);
struct Ops {
  c10::TypedOperatorHandle<LinearSig> linear;
  c10::TypedOperatorHandle<LinearSig> linear_q8;
  c10::TypedOperatorHandle<LinearSig> linear_bf16;
  c10::TypedOperatorHandle<int64_t(int64_t, int64_t)> q8_path;
  c10::TypedOperatorHandle<int64_t()> bf16_rows_max_m;
};

template <typename Sig>
c10::TypedOperatorHandle<Sig> find(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

const Ops& ops() {  // looked up on the first call (troupe_qmm and troupe_fused load before this library)
  static const Ops o{find<LinearSig>("troupe_qmm::linear"), find<LinearSig>("troupe_qmm::linear_q8"),
                     find<LinearSig>("troupe_qmm::linear_bf16"), find<int64_t(int64_t, int64_t)>("troupe_qmm::q8_path"),
                     find<int64_t()>("troupe_qmm::bf16_rows_max_m")};
  return o;
}

int64_t format_bytes(int64_t qtype, int64_t K) {  // bytes of one row of K values; 0: unknown format
  int64_t bytes = 0;
  dispatch(qtype, [&](auto q) {
    using F = Fmt<decltype(q)::value>;
    bytes = K % F::QK == 0 ? K / F::QK * F::BYTES : -1;
  });
  return bytes;
}

void check_experts(const std::vector<Tensor>& ws, int64_t qtype, int64_t N, int64_t K, const char* what) {
  const int64_t rb = format_bytes(qtype, K);
  TORCH_CHECK(rb != 0, "troupe_moe: unknown ", what, " format ", qtype);
  TORCH_CHECK(rb > 0 && K % 32 == 0, "troupe_moe: ", what, " rows of ", K, " values are not whole blocks");
  for (const Tensor& w : ws)
    TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous() && w.size(0) == N && w.size(1) == rb,
                "troupe_moe: every ", what, " must be (", N, ", ", rb, ") contiguous uint8 blocks");
}

// rows [n0, n1) of x (M, K) @ W^T into out (M, N) at column n0, in passes of rows::MAX_MB rows; n0 and n1
// are multiples of CHUNK (whole rows-kernel groups)
template <int Q>
void chunk_rows(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t rb, int64_t N, int64_t n0, int64_t n1,
                float* out) {
  rows::passes(M, [&](int64_t m0, auto mb) {
    constexpr int MB = decltype(mb)::value, R = rows::group_rows<MB>();
    rows::range<Q, MB>(x + m0 * K, K, w, rb, N, n0 / R, n1 / R, out + m0 * N, nullptr);
  });
}

// Rows per work item over `rows` rows of each of `experts` experts: about ITEMS_PER_THREAD items per thread
// in all (long runs stream the weights best; enough items spread the experts over every thread), a
// multiple of CHUNK
inline int64_t item_rows(int64_t rows, int64_t experts) {
  const int64_t items = ITEMS_PER_THREAD * at::get_num_threads();
  const int64_t per = (rows * experts + items - 1) / items;
  return std::min(rows, std::max<int64_t>(CHUNK, (per + CHUNK - 1) / CHUNK * CHUNK));
}

// body(i) for every item i < n, the items split into one contiguous run per thread of about equal total
// cost(i) (experts of different token counts cost differently), on as many threads as have at least
// `min_cost` each
template <class Cost, class Body>
void balanced_for(int64_t n, int64_t min_cost, const Cost& cost, const Body& body) {
  std::vector<int64_t> prefix(n + 1, 0);
  for (int64_t i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + cost(i);
  const int64_t total = prefix[n];
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>({at::get_num_threads(), n, total / std::max<int64_t>(1, min_cost)}));
  auto first = [&](int64_t t) {  // the first item of run t: its start is at or past t / nt of the total
    return t >= nt ? n : std::lower_bound(prefix.begin(), prefix.begin() + n, total * t / nt) - prefix.begin();
  };
  at::parallel_for(0, nt, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t i = first(t), end = first(t + 1); i < end; ++i) body(i);
  });
}

struct Expert {
  int64_t e;      // expert index
  int64_t start;  // first of its pairs in the sorted order
  int64_t n;      // its tokens
};

Tensor moe(const Tensor& x_in, const Tensor& ids_in, const Tensor& weights_in, const std::vector<Tensor>& gate,
           const std::vector<Tensor>& up, const std::vector<Tensor>& down, int64_t qtype_gate_up, int64_t qtype_down,
           bool q8, bool bf16, int64_t fused_max_m, int64_t min_blocks) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.dim() == 2, "troupe_moe: x must be (T, h) float32");
  TORCH_CHECK(ids_in.scalar_type() == at::kLong && ids_in.dim() == 2 && ids_in.size(0) == x_in.size(0),
              "troupe_moe: ids must be (T, k) int64");
  TORCH_CHECK(weights_in.scalar_type() == at::kFloat && weights_in.sizes() == ids_in.sizes(),
              "troupe_moe: weights must be (T, k) float32, like ids");
  const int64_t E = static_cast<int64_t>(gate.size());
  TORCH_CHECK(E > 0 && static_cast<int64_t>(up.size()) == E && static_cast<int64_t>(down.size()) == E,
              "troupe_moe: gate, up and down must list the same experts");
  const int64_t T = x_in.size(0), h = x_in.size(1), k = ids_in.size(1), f = gate[0].size(0);
  check_experts(gate, qtype_gate_up, f, h, "gate");
  check_experts(up, qtype_gate_up, f, h, "up");
  check_experts(down, qtype_down, h, f, "down");
  const Tensor x = x_in.contiguous(), ids_t = ids_in.contiguous(), wt = weights_in.contiguous();
  const int64_t* ids = ids_t.data_ptr<int64_t>();
  const float* rw = wt.data_ptr<float>();
  const int64_t P = T * k;  // (token, slot) pairs
  for (int64_t p = 0; p < P; ++p)
    TORCH_CHECK(ids[p] >= 0 && ids[p] < E, "troupe_moe: expert id ", ids[p], " out of range [0, ", E, ")");
  Tensor out = at::empty({T, h}, x.options());
  if (P == 0) return out;
  if (fused_max_m < 0) fused_max_m = FUSED_MAX_M;
  fused_max_m = std::min(fused_max_m, FUSED_MAX_M);
  // bf16: fused up to where linear_bf16 would leave the rows path, so a token count runs the same path fused
  // or per expert
  if (bf16) fused_max_m = std::min(fused_max_m, ops().bf16_rows_max_m.call());

  // group the pairs by expert: order[start_e + i] = the i-th pair (in token order) routed to e
  std::vector<int64_t> count(E + 1, 0), order(P), pos_of(P);
  for (int64_t p = 0; p < P; ++p) ++count[ids[p] + 1];
  for (int64_t e = 0; e < E; ++e) count[e + 1] += count[e];
  std::vector<int64_t> next(count.begin(), count.end() - 1);
  for (int64_t p = 0; p < P; ++p) {
    pos_of[p] = next[ids[p]]++;
    order[pos_of[p]] = p;
  }
  std::vector<Expert> fused, batched;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = count[e + 1] - count[e];
    if (n == 0) continue;
    bool fuse = n <= fused_max_m;
    if (fuse && q8) fuse = ops().q8_path.call(qtype_gate_up, n) < 0 && ops().q8_path.call(qtype_down, n) < 0;
    (fuse ? fused : batched).push_back({e, count[e], n});
  }

  // x's rows in pair order; gate, up, activations and each pair's output row
  Tensor xs = at::empty({P, h}, x.options()), y = at::empty({P, h}, x.options());
  const float* xp = x.data_ptr<float>();
  float* xsp = xs.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, P, std::max<int64_t>(1, 16384 / h), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) std::copy_n(xp + order[i] / k * h, h, xsp + i * h);
  });

  for (const Expert& ex : batched) {  // one projection call each, threaded over its rows
    const auto& lin = q8 ? ops().linear_q8 : bf16 ? ops().linear_bf16 : ops().linear;
    const Tensor xe = xs.narrow(0, ex.start, ex.n);
    const Tensor g = lin.call(xe, gate[ex.e], qtype_gate_up, std::nullopt, -1).contiguous();  // (n, f)
    const Tensor u = lin.call(xe, up[ex.e], qtype_gate_up, std::nullopt, -1).contiguous();
    Tensor act = at::empty({ex.n, f}, x.options());
    const float* gp = g.data_ptr<float>();
    const float* upp = u.data_ptr<float>();
    float* ap = act.data_ptr<float>();
    at::parallel_for(0, ex.n, std::max<int64_t>(1, 16384 / f), [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m) troupe_moe_silu::silu_mul(gp + m * f, upp + m * f, f, ap + m * f);
    });
    y.narrow(0, ex.start, ex.n).copy_(lin.call(act, down[ex.e], qtype_down, std::nullopt, -1));
  }

  if (!fused.empty()) {
    const int64_t nf = static_cast<int64_t>(fused.size());
    int64_t rows_fused = 0;
    for (const Expert& ex : fused) rows_fused = std::max(rows_fused, ex.start + ex.n);
    Tensor gt = at::empty({rows_fused, f}, x.options()), ut = at::empty({rows_fused, f}, x.options());
    Tensor act = at::empty({rows_fused, f}, x.options());
    float* gtp = gt.data_ptr<float>();
    float* utp = ut.data_ptr<float>();
    float* actp = act.data_ptr<float>();
    const int64_t f_rows = item_rows(f, nf), h_rows = item_rows(h, nf);
    const int64_t f_items = (f + f_rows - 1) / f_rows, h_items = (h + h_rows - 1) / h_rows;  // per expert
    if (min_blocks < 0) min_blocks = rows::MIN_BLOCKS_PER_THREAD;
    // an item's cost: its weight blocks, streamed once per pass and multiplied into each token
    auto cost = [&](const Expert& ex, int64_t blocks) { return blocks * (2 * ((ex.n + rows::MAX_MB - 1) / rows::MAX_MB) + ex.n) / 3; };
    const int64_t rb_gu = gate[0].size(1), rb_dn = down[0].size(1);
#if defined(TROUPE_ROWS_I16)
    // "gguf-bf16": the formats the 16-bit rows path decodes take it, on x's (then the activations') rows
    // prepared once (only the fused experts' rows)
    const bool i16_gu = bf16 && rows_i16::supported(qtype_gate_up), i16_dn = bf16 && rows_i16::supported(qtype_down);
    rows_i16::PreparedRows xprep(i16_gu ? rows_fused : 0, h), aprep(i16_dn ? rows_fused : 0, f);
    auto prepare = [&](rows_i16::PreparedRows& p, const float* rows, int64_t K) {
      at::parallel_for(0, nf, 1, [&](int64_t e0, int64_t e1) {
        for (int64_t e = e0; e < e1; ++e)
          for (int64_t m = fused[e].start; m < fused[e].start + fused[e].n; ++m) p.prepare(rows + m * K, m);
      });
    };
    if (i16_gu) prepare(xprep, xsp, h);
#endif
    dispatch(qtype_gate_up, [&](auto q) {
      constexpr int Q = decltype(q)::value;
      const int64_t item_blocks = 2 * f_rows * (h / Fmt<Q>::QK);
      balanced_for(nf * f_items, min_blocks, [&](int64_t i) { return cost(fused[i / f_items], item_blocks); },
                   [&](int64_t i) {
          const Expert& ex = fused[i / f_items];
          const int64_t n0 = i % f_items * f_rows, n1 = std::min(f, n0 + f_rows);
          float* g = gtp + ex.start * f;
          float* u = utp + ex.start * f;
          bool done = false;
#if defined(TROUPE_ROWS_I16)
          if constexpr (rows_i16::decodes<Q>()) {
            if (i16_gu) {
              rows_i16::rows_range<Q>(xprep, ex.start, ex.n, gate[ex.e].data_ptr<uint8_t>(), rb_gu, f, n0, n1, g, f,
                                      nullptr);
              rows_i16::rows_range<Q>(xprep, ex.start, ex.n, up[ex.e].data_ptr<uint8_t>(), rb_gu, f, n0, n1, u, f,
                                      nullptr);
              done = true;
            }
          }
#endif
          if (!done) {
            chunk_rows<Q>(xsp + ex.start * h, ex.n, h, gate[ex.e].data_ptr<uint8_t>(), rb_gu, f, n0, n1, g);  // gate rows
            chunk_rows<Q>(xsp + ex.start * h, ex.n, h, up[ex.e].data_ptr<uint8_t>(), rb_gu, f, n0, n1, u);    // up rows
          }
          for (int64_t m = 0; m < ex.n; ++m)
            troupe_moe_silu::silu_mul(g + m * f + n0, u + m * f + n0, n1 - n0, actp + (ex.start + m) * f + n0);
      });
    });
#if defined(TROUPE_ROWS_I16)
    if (i16_dn) prepare(aprep, actp, f);
#endif
    dispatch(qtype_down, [&](auto q) {
      constexpr int Q = decltype(q)::value;
      const int64_t item_blocks = h_rows * (f / Fmt<Q>::QK);
      balanced_for(nf * h_items, min_blocks, [&](int64_t i) { return cost(fused[i / h_items], item_blocks); },
                   [&](int64_t i) {
          const Expert& ex = fused[i / h_items];
          const int64_t n0 = i % h_items * h_rows, n1 = std::min(h, n0 + h_rows);
#if defined(TROUPE_ROWS_I16)
          if constexpr (rows_i16::decodes<Q>()) {
            if (i16_dn)
              return rows_i16::rows_range<Q>(aprep, ex.start, ex.n, down[ex.e].data_ptr<uint8_t>(), rb_dn, h, n0, n1,
                                             yp + ex.start * h, h, nullptr);
          }
#endif
          chunk_rows<Q>(actp + ex.start * f, ex.n, f, down[ex.e].data_ptr<uint8_t>(), rb_dn, h, n0, n1, yp + ex.start * h);
      });
    });
  }

  // the weighted sum, each token's pairs in expert order
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, std::max<int64_t>(1, 16384 / (h * k)), [&](int64_t t0, int64_t t1) {
    std::vector<int64_t> rows(k);
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t j = 0; j < k; ++j) rows[j] = pos_of[t * k + j];
      std::sort(rows.begin(), rows.end());  // pair order is expert order
      float* o = op + t * h;
      std::fill(o, o + h, 0.0f);
      for (const int64_t r : rows) {
        const float wgt = rw[order[r]];
        const float* yr = yp + r * h;
        for (int64_t d = 0; d < h; ++d) o[d] += wgt * yr[d];
      }
    }
  });
  return out;
}

}  // namespace
}  // namespace troupe_moe

TORCH_LIBRARY(troupe_moe, m) {
  // fused_max_m: experts with up to this many tokens run fused (-1: FUSED_MAX_M; 0: none, for tests and the
  // benchmark); min_blocks: weight blocks a thread gets at least before another is woken (-1: the rows
  // path's own minimum; tests: 1, to split tiny shapes)
  m.def("moe(Tensor x, Tensor ids, Tensor weights, Tensor[] gate, Tensor[] up, Tensor[] down, int qtype_gate_up, "
        "int qtype_down, bool q8, bool bf16, int fused_max_m, int min_blocks) -> Tensor",
        &troupe_moe::moe);
}
