// The "gguf-bf16" projection: y (M, N) = x (M, K) @ W^T (+ bias) with W's GGUF blocks decoded to bfloat16
// in the panel packing, x rounded to bfloat16 once per call, products summed in float32 (panel_bf16.h has
// the layouts, the micro-kernels and the error bound). For batches only: up to `bf16_rows_max_m()` rows
// (decode, where the weights' memory traffic and the packing, not the multiply-adds, set the time) the call
// is the 16-bit rows path's (rows_i16.h: x in int16, the blocks' integers exact, `vpdpwssd`) for the formats
// it decodes (the K-quants), else the output-exact float path's (troupe_qmm::linear, by M).
//
// Built where the compiler targets AVX512_BF16 (`-march=native` on a CPU with avx512_bf16); elsewhere the op
// exists and raises. `bf16_kernels()` says which kernels: 0 none, 1 avx512_bf16, 2 AMX as well.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <type_traits>

// The decoded weight values are the reference's float32 values before their rounding to bf16 (as in
// qmatmul.cpp: no multiply-add fused behind our back in the decoders).
#pragma GCC optimize("fp-contract=off")
#include "panel_bf16.h"
#include "panel_gemm.h"
#include "rows_i16.h"

at::Tensor qmatmul_linear(const at::Tensor& x, const at::Tensor& w, int64_t qtype, const std::optional<at::Tensor>& bias,
                          int64_t path);

namespace {

using namespace troupe_quant;

// Up to this M, the float path: the bf16 panel's packing is paid per call, and few rows of x do not amortize
// it against the float rows path's streaming. AMX: the default model's projections in model order, one
// thread (Xeon, model 207), took 2.27 / 1.09 / 0.72 / 0.68 of the float path's time at M = 4 / 8 / 12 / 16.
// The avx512_bf16 kernel on AMD (Zen 4, family 25 model 17; the same, 2 threads): 1.10 / 1.01 / 0.98 / 0.93
// / 0.83 at M = 5 / 6 / 7 / 8 / 9. On Intel cores without AMX `vdpbf16ps` runs at a quarter of the FMA rate
// and the kernel is slower than the float GEMM: the float panel GEMM's crossover (ROWS_PATH_MAX_M) there.
constexpr int64_t BF16_AMX_ROWS_MAX_M = 8;
constexpr int64_t BF16_DP_AMD_ROWS_MAX_M = 6;
constexpr int64_t BF16_DP_ROWS_MAX_M = 12;
// Rows of x converted to bf16 per thread at least (the conversion is a fraction of the GEMM's time).
constexpr int64_t CONVERT_GRAIN = 64;

// 0: none, 1: avx512_bf16 dot products (PanelB), 2: AMX tiles as well (PanelA)
int64_t bf16_kernels() {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (amx_ready()) return 2;
#endif
#if defined(__AVX512BF16__)
  return 1;
#else
  return 0;
#endif
}

int64_t bf16_rows_max_m() {
  if (bf16_kernels() == 2) return BF16_AMX_ROWS_MAX_M;
  static const bool amd = __builtin_cpu_is("amd");
  return amd ? BF16_DP_AMD_ROWS_MAX_M : BF16_DP_ROWS_MAX_M;
}

#if defined(__AVX512BF16__)
// The fused schedule (each panel's K slice packed just before use, in L1) up to this M, the tiled one above
// (panel_gemm.h).
constexpr int64_t BF16_FUSED_MAX_M = 64;

template <class L, int Q>
void bf16_run(const uint16_t* x, int64_t M, int64_t K, const uint8_t* w, int64_t rb, int64_t N, float* out,
              const float* bias) {
  const bool fused = M <= BF16_FUSED_MAX_M;
  const Tiles tiles = Tiles::of((N + L::NR - 1) / L::NR, tile_panels<L>(fused, K));
  at::parallel_for(0, tiles.count, 1, [&](int64_t t0, int64_t t1) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if constexpr (std::is_same_v<L, PanelA>) L::amx_begin();
#endif
    panel_tiles<L, Q>(x, M, K, w, rb, N, out, bias, tiles, fused, t0, t1);
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if constexpr (std::is_same_v<L, PanelA>) L::amx_end();
#endif
  });
}

// kernel: 1 PanelB, 2 PanelA
template <int Q>
void bf16_panel(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t rb, int64_t N, float* out,
                const float* bias, int64_t kernel) {
  // (M + 32, K) bf16: PanelA's A tiles read up to 32 rows past a block of rows; the padding is zeros
  const int64_t pad = kernel == 2 ? 32 : 0;
  at::Tensor xb = at::empty({M + pad, K}, at::TensorOptions().dtype(at::kBFloat16));
  uint16_t* xp = reinterpret_cast<uint16_t*>(xb.data_ptr());
  std::fill(xp + M * K, xp + (M + pad) * K, uint16_t{0});
  at::parallel_for(0, M, CONVERT_GRAIN, [&](int64_t m0, int64_t m1) { to_bf16(x + m0 * K, (m1 - m0) * K, xp + m0 * K); });
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (kernel == 2) return bf16_run<PanelA, Q>(xp, M, K, w, rb, N, out, bias);
#endif
  bf16_run<PanelB, Q>(xp, M, K, w, rb, N, out, bias);
}
#endif

// Whether the 16-bit rows path (rows_i16.h) takes `qtype` in this build
bool i16_rows(int64_t qtype) {
#if defined(TROUPE_ROWS_I16)
  return rows_i16::supported(qtype);
#else
  (void)qtype;
  return false;
#endif
}

// path: -1 by M (up to bf16_rows_max_m() rows the 16-bit rows path for the formats it decodes, else the float
// path; then the bf16 panel GEMM with the CPU's best kernel), 1 that GEMM at any M; forced (tests,
// benchmarks): 2 the avx512_bf16 kernel, 3 the AMX one, 4 the 16-bit rows path.
at::Tensor qmatmul_linear_bf16(const at::Tensor& x, const at::Tensor& w, int64_t qtype,
                               const std::optional<at::Tensor>& bias, int64_t path) {
  TORCH_CHECK(path >= -1 && path <= 4 && path != 0, "troupe_qmm: bf16 path must be -1, 1, 2, 3 or 4, got ", path);
  const bool small = x.dim() == 2 && x.size(0) <= bf16_rows_max_m();
  TORCH_CHECK(path != 4 || i16_rows(qtype), "troupe_qmm: the 16-bit rows path needs AVX512_VNNI and a format it "
              "decodes (Q4_K, Q5_K, Q6_K), got format ", qtype);
  if (path == -1 && small && !i16_rows(qtype)) return qmatmul_linear(x, w, qtype, bias, -1);
  if (path == -1 && small) path = 4;
  const int64_t kernel = path == 2 || path == 3 ? path - 1 : bf16_kernels();
  TORCH_CHECK(kernel > 0, "troupe_qmm: linear_bf16 needs kernels built for avx512_bf16, and this build targets a CPU without it");
  TORCH_CHECK(kernel <= bf16_kernels(), "troupe_qmm: the AMX kernel needs AMX tiles (amx_bf16 and the OS's permission), "
              "which this build or process lacks");
#if defined(__AVX512BF16__)
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "troupe_qmm: x must be (M, K) float32");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  int64_t qk = 0, bytes = 0;
  TORCH_CHECK(dispatch(qtype, [&](auto q) { qk = Fmt<decltype(q)::value>::QK, bytes = Fmt<decltype(q)::value>::BYTES; }),
              "troupe_qmm: unknown weight format ", qtype);
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(), "troupe_qmm: weight must be (N, row_bytes) contiguous uint8");
  TORCH_CHECK(K % qk == 0 && K % 32 == 0 && w.size(1) == K / qk * bytes, "troupe_qmm: weight rows hold ", w.size(1),
              " bytes, which does not match K=", K);
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == N && bias->is_contiguous(), "troupe_qmm: bias must be (N,) float32");
    b = bias->data_ptr<float>();
  }
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  const at::Tensor xc = x.contiguous();
#if defined(TROUPE_ROWS_I16)
  if (path == 4) {
    dispatch(qtype, [&](auto q) {
      constexpr int Q = decltype(q)::value;
      if constexpr (rows_i16::decodes<Q>())
        rows_i16::rows_path<Q>(xc.data_ptr<float>(), M, K, w.data_ptr<uint8_t>(), w.size(1), N, out.data_ptr<float>(), b);
    });
    return out;
  }
#endif
  dispatch(qtype, [&](auto q) {
    bf16_panel<decltype(q)::value>(xc.data_ptr<float>(), M, K, w.data_ptr<uint8_t>(), w.size(1), N, out.data_ptr<float>(), b, kernel);
  });
  return out;
#else
  return {};
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(troupe_qmm, m) {
  m.def("linear_bf16(Tensor x, Tensor w, int qtype, Tensor? bias, int path) -> Tensor", &qmatmul_linear_bf16);
  m.def("bf16_kernels() -> int", &bf16_kernels);
  m.def("bf16_rows_max_m() -> int", &bf16_rows_max_m);
}
