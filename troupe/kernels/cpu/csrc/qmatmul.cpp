// Projections on GGUF block weights: y (M, N) = x (M, K) @ W^T (+ bias), W (N, K) kept as its raw blocks
// (N rows of K / QK blocks), x and y float32. Output-exact: every weight value is the reference's
// dequantized float32 value (quant.h), multiplied and summed in float32 (results differ from
// `x @ dequantize(W).T` only by summation order).
//
// Paths, by the number of rows M (the choice in qmatmul_linear; docs/kernels.md has the figures). N is
// split across threads in every one; each weight block is decoded once per call.
// - rows (M <= 4, decode; qmatmul_rows.h): each block is decoded into registers and multiplied into all M
//   rows at once, several weight rows in flight; the weights stream once, prefetched ahead. Up to
//   ROWS_PATH_MAX_M rows (32 with AVX-512) it runs in passes of 4 rows.
// - panel (larger M; panel_gemm.h, panel_pack.h): a thread decodes a tile of weight rows once into packed
//   panels and multiplies rows of x by them with a BLIS-style outer-product micro-kernel (x broadcast,
//   panel vectors streamed; AVX-512 12 x 32 or, for M <= 64, 12 x 8 on 4-k interleaved panels; AVX2
//   6 x 16). The former panel kernel (dot products against a row-major scratch, below) stays callable as
//   path 3, for tests and the benchmark.
//
// Also: dequantize (W -> float32), embedding (the looked-up rows only).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <optional>
#include <vector>

// Dequantized values must be the reference's bit for bit: no multiply-add fused behind our back (the
// FMAs of the dot products are explicit intrinsics, which this does not touch).
#pragma GCC optimize("fp-contract=off")
#include "panel_gemm.h"
#include "qmatmul_rows.h"
#include "quant.h"

namespace {

using namespace troupe_quant;

// A float buffer aligned to 64 bytes (whole cache lines: vector loads never split one).
class AlignedBuffer {
 public:
  explicit AlignedBuffer(size_t n) : p_(static_cast<float*>(std::aligned_alloc(64, (n * sizeof(float) + 63) / 64 * 64))) {
    TORCH_CHECK(p_ != nullptr, "troupe_qmm: out of memory");
  }
  ~AlignedBuffer() { std::free(p_); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  float* data() { return p_; }

 private:
  float* p_;
};

// ------------------------------------------------------------------------------- decode a whole row

template <int Q>
void decode_row(const uint8_t* row, int64_t K, float* out) {
  using F = Fmt<Q>;
  const int64_t nb = K / F::QK;
  for (int64_t b = 0; b < nb; ++b) {
    float* o = out + b * F::QK;
    F::decode(row + b * F::BYTES, [&](int c, const Vf* w) {
      for (int j = 0; j < NV; ++j) vstore(o + 32 * c + W * j, w[j]);
    });
  }
}

// ------------------------------------------------------------------------------- former panel path (path 3)
//
// Kept for comparison (python -m troupe.bench.kernels --former-panel), and taken by M on AVX2 builds up to
// FORMER_PANEL_MAX_M rows. A thread decodes a tile of NT weight rows into a 64-byte aligned float32
// scratch (NT x K), then computes every out[m][n] of the tile as a dot product along K with an MR x NR
// register tile (MR rows of x against NR decoded rows: MR + NR vector loads feed MR * NR FMAs), reducing
// NR accumulators at once into one 4-float store.

#if defined(__AVX512F__)
constexpr int MR = 6;
#else
constexpr int MR = 3;
#endif
constexpr int NR = 4;  // fixed: the reduction stores 4 sums

// Weight rows per tile: 32 for decode-sized M; for larger M as many as fit ~512 KiB of L2 (every row of x
// streams once per tile), but at least two tiles per thread.
inline int64_t tile_rows(int64_t M, int64_t N, int64_t K) {
  if (M <= 64) return 32;
  const int64_t by_cache = std::max<int64_t>(32, (int64_t{1} << 19) / (4 * K));
  const int64_t by_threads = (N + 2 * at::get_num_threads() - 1) / (2 * at::get_num_threads());
  return std::max<int64_t>(8, (std::min(by_cache, by_threads) + NR - 1) / NR * NR);
}

// out[m * ldo + n] = dot(x[m], p[n]) (+ bias[n]) for m < mr, n < NR; p: NR decoded rows of K floats
template <int mr>
inline void micro(const float* x, int64_t ldx, const float* p, int64_t K, float* out, int64_t ldo, const float* bias) {
  Vf acc[mr][NR];
  for (int m = 0; m < mr; ++m)
    for (int n = 0; n < NR; ++n) acc[m][n] = vzero();
  for (int64_t k = 0; k < K; k += W) {
    Vf pv[NR];
    for (int n = 0; n < NR; ++n) pv[n] = vload(p + n * K + k);
    for (int m = 0; m < mr; ++m) {
      const Vf xv = vload(x + m * ldx + k);
      for (int n = 0; n < NR; ++n) acc[m][n] = vfma(xv, pv[n], acc[m][n]);
    }
  }
  const __m128 b = bias ? _mm_loadu_ps(bias) : _mm_setzero_ps();
  for (int m = 0; m < mr; ++m) _mm_storeu_ps(out + m * ldo, _mm_add_ps(sum4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]), b));
}

template <int mr>
inline void micro_any(int mr_rt, const float* x, int64_t ldx, const float* p, int64_t K, float* out, int64_t ldo,
                      const float* bias) {
  if constexpr (mr > 1) {
    if (mr_rt < mr) return micro_any<mr - 1>(mr_rt, x, ldx, p, K, out, ldo, bias);
  }
  micro<mr>(x, ldx, p, K, out, ldo, bias);
}

template <int Q>
void panel_path(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t N, float* out,
                const float* bias) {
  const int64_t NT = tile_rows(M, N, K);
  const int64_t tiles = (N + NT - 1) / NT;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    AlignedBuffer scratch(static_cast<size_t>(NT * K)), tail(static_cast<size_t>(MR * NR));
    float* p = scratch.data();
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * NT, nt = std::min<int64_t>(NT, N - n0);
      for (int64_t r = 0; r < nt; ++r) decode_row<Q>(w + (n0 + r) * row_bytes, K, p + r * K);
      const int64_t padded = (nt + NR - 1) / NR * NR;
      if (padded > nt) std::fill(p + nt * K, p + padded * K, 0.0f);
      for (int64_t m0 = 0; m0 < M; m0 += MR) {
        const int mr = static_cast<int>(std::min<int64_t>(MR, M - m0));
        for (int64_t r = 0; r < padded; r += NR) {
          const float* bb = bias ? bias + n0 + r : nullptr;
          if (r + NR <= nt) {
            micro_any<MR>(mr, x + m0 * K, K, p + r * K, K, out + m0 * N + n0 + r, N, bb);
          } else {  // the last, partial group of rows: through a small buffer
            micro_any<MR>(mr, x + m0 * K, K, p + r * K, K, tail.data(), NR, nullptr);
            for (int m = 0; m < mr; ++m)
              for (int64_t n = 0; n < nt - r; ++n)
                out[(m0 + m) * N + n0 + r + n] = tail.data()[m * NR + n] + (bias ? bias[n0 + r + n] : 0.0f);
          }
        }
      }
    }
  });
}

// ------------------------------------------------------------------------------- dequantize

template <int Q>
void dequant_path(const uint8_t* w, int64_t row_bytes, int64_t K, const int64_t* rows, int64_t n, float* out) {
  at::parallel_for(0, n, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) decode_row<Q>(w + (rows ? rows[r] : r) * row_bytes, K, out + r * K);
  });
}

int64_t block_values(int64_t qtype) {
  int64_t qk = 0;
  dispatch(qtype, [&](auto q) { qk = Fmt<decltype(q)::value>::QK; });
  return qk;
}

int64_t block_bytes(int64_t qtype) {
  int64_t bytes = 0;
  dispatch(qtype, [&](auto q) { bytes = Fmt<decltype(q)::value>::BYTES; });
  return bytes;
}

void check_weight(const at::Tensor& w, int64_t qtype, int64_t K) {
  TORCH_CHECK(block_values(qtype) > 0, "troupe_qmm: unknown weight format ", qtype);
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(), "troupe_qmm: weight must be (N, row_bytes) contiguous uint8");
  TORCH_CHECK(K % block_values(qtype) == 0, "troupe_qmm: K=", K, " is not a multiple of the block size ", block_values(qtype));
  TORCH_CHECK(w.size(1) == K / block_values(qtype) * block_bytes(qtype), "troupe_qmm: weight rows hold ", w.size(1),
              " bytes, K=", K, " needs ", K / block_values(qtype) * block_bytes(qtype));
}

}  // namespace

constexpr int64_t ROWS_MAX_M = 4;  // rows of x per pass of the rows path over the weights
// By M, the rows path (in passes of ROWS_MAX_M rows) up to this M, the panel path above: the measured
// crossover for the default model's projections in model order, 2 threads (docs/kernels.md). In a model
// step every weight comes from memory, not cache, and there the AVX-512 rows path keeps its rate at any M
// while the panel GEMM, which beats it on cache-resident weights from ~16 rows, falls well below it at
// small M. With AVX2 two passes of 4 rows did not pay: the panel from 5 rows.
#if defined(__AVX512F__)
constexpr int64_t ROWS_PATH_MAX_M = 12;
#else
constexpr int64_t ROWS_PATH_MAX_M = 4;
#endif
// Up to this M the by-M choice takes the former panel kernel (path 3) over the panel GEMM. AVX-512: never
// (the GEMM's 4-k packing is cheap enough from 9 rows). AVX2: its 8 x 8 transposes make packing the larger
// cost at small M, where the former kernel's row-major decode wins. The AMD EPYC AVX2 machine (the one
// the targets are set on), in model order, 2 threads: the GEMM at 1.09 / 1.00 / 1.00 / 0.91 / 0.83 / 0.79
// of the former kernel's time at M = 12 / 16 / 20 / 24 / 40 / 64 (docs/kernels.md; a Xeon had put the
// crossover near 64 on single shapes).
#if defined(__AVX512F__)
constexpr int64_t FORMER_PANEL_MAX_M = 0;
#else
constexpr int64_t FORMER_PANEL_MAX_M = 20;
#endif

at::Tensor qmatmul_dequantize(const at::Tensor& w, int64_t qtype, int64_t K) {
  check_weight(w, qtype, K);
  at::Tensor out = at::empty({w.size(0), K}, w.options().dtype(at::kFloat));
  dispatch(qtype, [&](auto q) {
    dequant_path<decltype(q)::value>(w.data_ptr<uint8_t>(), w.size(1), K, nullptr, w.size(0), out.data_ptr<float>());
  });
  return out;
}

at::Tensor qmatmul_embedding(const at::Tensor& w, int64_t qtype, int64_t K, const at::Tensor& ids) {
  check_weight(w, qtype, K);
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1 && ids.is_contiguous(), "troupe_qmm: ids must be (T,) int64");
  const int64_t* rows = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < ids.numel(); ++i)
    TORCH_CHECK(rows[i] >= 0 && rows[i] < w.size(0), "troupe_qmm: token id ", rows[i], " out of range [0, ", w.size(0), ")");
  at::Tensor out = at::empty({ids.numel(), K}, w.options().dtype(at::kFloat));
  dispatch(qtype, [&](auto q) {
    dequant_path<decltype(q)::value>(w.data_ptr<uint8_t>(), w.size(1), K, rows, ids.numel(), out.data_ptr<float>());
  });
  return out;
}

at::Tensor qmatmul_linear(const at::Tensor& x, const at::Tensor& w, int64_t qtype, const std::optional<at::Tensor>& bias,
                          int64_t path) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "troupe_qmm: x must be (M, K) float32");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  check_weight(w, qtype, K);
  const at::Tensor xc = x.contiguous();
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == N && bias->is_contiguous(), "troupe_qmm: bias must be (N,) float32");
    b = bias->data_ptr<float>();
  }
  // -1: by M; forced (tests, benchmarks): 0 rows, 1 panel, 2 the former rows path (one weight row at a time),
  // 3 the former panel path (dot products)
  if (path < 0) path = M <= ROWS_PATH_MAX_M ? 0 : M <= FORMER_PANEL_MAX_M ? 3 : 1;
  TORCH_CHECK(path >= 0 && path <= 3, "troupe_qmm: path must be -1 (by M), 0, 1, 2 or 3, got ", path);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t rb = w.size(1);
  float* o = out.data_ptr<float>();
  const float* xp = xc.data_ptr<float>();
  dispatch(qtype, [&](auto q) {
    constexpr int Q = decltype(q)::value;
    if (path == 0 || path == 2) {
      for (int64_t m0 = 0; m0 < M; m0 += ROWS_MAX_M) {
        const int64_t mb = std::min(ROWS_MAX_M, M - m0);
        if (path == 0) rows_path<Q>(xp + m0 * K, mb, K, wp, rb, N, o + m0 * N, b);
        else rows1_path<Q>(xp + m0 * K, mb, K, wp, rb, N, o + m0 * N, b);
      }
    } else if (path == 1) {
      gemm_panel_path<Q>(xp, M, K, wp, rb, N, o, b);
    } else {
      panel_path<Q>(xp, M, K, wp, rb, N, o, b);
    }
  });
  return out;
}

TORCH_LIBRARY(troupe_qmm, m) {
  m.def("linear(Tensor x, Tensor w, int qtype, Tensor? bias, int path) -> Tensor", &qmatmul_linear);
  m.def("dequantize(Tensor w, int qtype, int k) -> Tensor", &qmatmul_dequantize);
  m.def("embedding(Tensor w, int qtype, int k, Tensor ids) -> Tensor", &qmatmul_embedding);
}
