// Projections on GGUF block weights: y (M, N) = x (M, K) @ W^T (+ bias), W (N, K) kept as its raw blocks
// (N rows of K / QK blocks), x and y float32. Output-exact: every weight value is the reference's
// dequantized float32 value (quant.h), multiplied and summed in float32 (results differ from
// `x @ dequantize(W).T` only by summation order).
//
// Paths, by the number of rows M (the choice in qmatmul_linear; docs/kernels.md has the figures). N is
// split across threads in every one; each weight block is decoded once per call.
// - rows (M <= 4, decode): a block is decoded into registers and multiplied into all M rows at once;
//   memory-bound: the weights stream once.
// - tiles (M > 4): a thread decodes a tile of weight rows into a float32 scratch (L2) and multiplies all
//   M rows by it with the single-threaded float32 GEMM of the MKL inside torch (`sgemm_`, which torch's
//   library exports) -- or, where a torch build has none, with our own register-blocked kernel (panel).
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

// ------------------------------------------------------------------------------- rows path (small M)

// out[m * ldo + n] = dot(x[m], W[n]) for the MB rows of x, n in [n0, n1)
template <int Q, int MB>
void rows_kernel(const float* x, int64_t ldx, const uint8_t* w, int64_t row_bytes, int64_t K, int64_t n0,
                 int64_t n1, float* out, int64_t ldo, const float* bias) {
  using F = Fmt<Q>;
  const int64_t nb = K / F::QK;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    Vf acc[MB][NV];
    for (int m = 0; m < MB; ++m)
      for (int j = 0; j < NV; ++j) acc[m][j] = vzero();
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + b * F::QK;
      F::decode(row + b * F::BYTES, [&](int c, const Vf* wv) {
        for (int m = 0; m < MB; ++m)
          for (int j = 0; j < NV; ++j) acc[m][j] = vfma(wv[j], vload(xb + m * ldx + 32 * c + W * j), acc[m][j]);
      });
    }
    const float add = bias ? bias[n] : 0.0f;
    for (int m = 0; m < MB; ++m) {
      Vf s = acc[m][0];
      for (int j = 1; j < NV; ++j) s = vadd(s, acc[m][j]);
      out[m * ldo + n] = vsum(s) + add;
    }
  }
}

template <int Q>
void rows_path(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t N, float* out,
               const float* bias) {
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    switch (M) {
      case 1: rows_kernel<Q, 1>(x, K, w, row_bytes, K, n0, n1, out, N, bias); break;
      case 2: rows_kernel<Q, 2>(x, K, w, row_bytes, K, n0, n1, out, N, bias); break;
      case 3: rows_kernel<Q, 3>(x, K, w, row_bytes, K, n0, n1, out, N, bias); break;
      default: rows_kernel<Q, 4>(x, K, w, row_bytes, K, n0, n1, out, N, bias); break;
    }
  });
}

// ------------------------------------------------------------------------------- panel path (moderate M)
//
// A vector runs over M: C^T[n][m..m+W) += W[n][k] * x^T[k][m..m+W). x is packed once per call into blocks
// of MB = MV * W rows, each (K, MB) (zero padded past M), so a block's K-slice of KC rows (KC x MB floats,
// 32 KiB) stays in L1 while every register tile of a weight tile sweeps it. A thread decodes NT weight rows
// into a scratch of NT x K floats (decoded rows stay K-contiguous; the kernel reads them as broadcast
// scalars), then for each block of rows and each K-slice runs NR x mv register tiles over the NT rows.

#if defined(__AVX512F__)
constexpr int MV = 4;  // vectors over M per register tile (x NR accumulators)
#else
constexpr int MV = 2;
#endif
constexpr int MB = MV * W;  // rows of x per packed block
constexpr int NT = 48;      // weight rows decoded per tile (a multiple of every NR below)
constexpr int64_t KC = 4096;

// acc[n * MB + m] += sum_{k < kc} p[n * ldp + k] * xb[k * MB + m]  (n < nr, m < mv * W)
template <int nr, int mv>
inline void micro(const float* xb, const float* p, int64_t ldp, int64_t kc, float* acc_io) {
  Vf acc[nr][mv];
  for (int n = 0; n < nr; ++n)
    for (int j = 0; j < mv; ++j) acc[n][j] = vload(acc_io + n * MB + j * W);
  for (int64_t k = 0; k < kc; ++k) {
    Vf xv[mv];
    for (int j = 0; j < mv; ++j) xv[j] = vload(xb + k * MB + j * W);
    for (int n = 0; n < nr; ++n) {
      const Vf wb = vset1(p[n * ldp + k]);
      for (int j = 0; j < mv; ++j) acc[n][j] = vfma(wb, xv[j], acc[n][j]);
    }
  }
  for (int n = 0; n < nr; ++n)
    for (int j = 0; j < mv; ++j) vstore(acc_io + n * MB + j * W, acc[n][j]);
}

// all NT rows of a tile, one K-slice: NR chosen so that NR * mv accumulators fit in registers
template <int mv>
inline void micro_tile(const float* xb, const float* p, int64_t ldp, int64_t kc, float* acc) {
#if defined(__AVX512F__)
  constexpr int nr = mv == 4 ? 6 : mv == 3 ? 8 : mv == 2 ? 12 : 24;
#else
  constexpr int nr = mv == 2 ? 6 : 12;
#endif
  static_assert(NT % nr == 0, "a tile is whole register tiles");
  for (int n = 0; n < NT; n += nr) micro<nr, mv>(xb, p + n * ldp, ldp, kc, acc + n * MB);
}

inline void micro_tile_any(int mv, const float* xb, const float* p, int64_t ldp, int64_t kc, float* acc) {
  if constexpr (MV == 4) {
    if (mv == 4) return micro_tile<4>(xb, p, ldp, kc, acc);
    if (mv == 3) return micro_tile<3>(xb, p, ldp, kc, acc);
  }
  if (mv == 2) return micro_tile<2>(xb, p, ldp, kc, acc);
  micro_tile<1>(xb, p, ldp, kc, acc);
}

// Fortran BLAS sgemm, exported by torch's own library (MKL inside); weak: null where a build lacks it.
extern "C" void sgemm_(const char* ta, const char* tb, const int* m, const int* n, const int* k, const float* alpha,
                       const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
                       const int* ldc) __attribute__((weak));

constexpr int64_t BLAS_NT = 96;  // weight rows per tile on the BLAS variant

// out[:, n0 : n0 + nt] = x @ tile^T per thread tile, the tile decoded into a per-thread scratch
template <int Q>
void panel_blas(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t N, float* out,
                const float* bias) {
  const int64_t tiles = (N + BLAS_NT - 1) / BLAS_NT;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    AlignedBuffer scratch(static_cast<size_t>(BLAS_NT * K));
    float* p = scratch.data();
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * BLAS_NT, nt = std::min<int64_t>(BLAS_NT, N - n0);
      for (int64_t r = 0; r < nt; ++r) decode_row<Q>(w + (n0 + r) * row_bytes, K, p + r * K);
      const int m = static_cast<int>(nt), n = static_cast<int>(M), k = static_cast<int>(K), ldc = static_cast<int>(N);
      const float one = 1.0f, zero = 0.0f;
      sgemm_("T", "N", &m, &n, &k, &one, p, &k, x, &k, &zero, out + n0, &ldc);
      if (bias)
        for (int64_t i = 0; i < M; ++i)
          for (int64_t j = 0; j < nt; ++j) out[i * N + n0 + j] += bias[n0 + j];
    }
  });
}

template <int Q>
void panel_path(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t N, float* out,
                const float* bias) {
  const int64_t blocks = (M + MB - 1) / MB;
  AlignedBuffer xbuf(static_cast<size_t>(blocks * K * MB));  // blocks of (K, MB), 64-byte aligned
  float* xpd = xbuf.data();
  std::fill(xpd, xpd + blocks * K * MB, 0.0f);
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      float* dst = xpd + b * K * MB;
      for (int64_t m = b * MB; m < std::min<int64_t>(M, (b + 1) * MB); ++m)
        for (int64_t k = 0; k < K; ++k) dst[k * MB + (m - b * MB)] = x[m * K + k];
    }
  });
  const int64_t tiles = (N + NT - 1) / NT;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    AlignedBuffer scratch(static_cast<size_t>(NT * K)), accbuf(static_cast<size_t>(NT * MB));
    float* p = scratch.data();
    float* acc = accbuf.data();
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * NT, nt = std::min<int64_t>(NT, N - n0);
      for (int64_t r = 0; r < nt; ++r) decode_row<Q>(w + (n0 + r) * row_bytes, K, p + r * K);
      if (nt < NT) std::fill(p + nt * K, p + NT * K, 0.0f);
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t m0 = b * MB, mm = std::min<int64_t>(MB, M - m0);
        const int mv = static_cast<int>((mm + W - 1) / W);
        std::fill(acc, acc + NT * MB, 0.0f);
        for (int64_t k0 = 0; k0 < K; k0 += KC)
          micro_tile_any(mv, xpd + b * K * MB + k0 * MB, p + k0, K, std::min(KC, K - k0), acc);
        for (int64_t m = 0; m < mm; ++m) {
          float* o = out + (m0 + m) * N + n0;
          for (int64_t n = 0; n < nt; ++n) o[n] = acc[n * MB + m] + (bias ? bias[n0 + n] : 0.0f);
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

constexpr int64_t ROWS_MAX_M = 4;  // the rows path up to this M (measured: docs/kernels.md)

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
  // -1: choose by M; 0 rows, 1 panel, 2 BLAS tiles (where torch exports sgemm; else panel): forced by tests
  if (path < 0) path = M <= ROWS_MAX_M ? 0 : 2;
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t rb = w.size(1);
  float* o = out.data_ptr<float>();
  const float* xp = xc.data_ptr<float>();
  dispatch(qtype, [&](auto q) {
    constexpr int Q = decltype(q)::value;
    if (path == 2 && sgemm_ != nullptr) {
      panel_blas<Q>(xp, M, K, wp, rb, N, o, b);
    } else if (path == 0) {
      for (int64_t m0 = 0; m0 < M; m0 += ROWS_MAX_M)
        rows_path<Q>(xp + m0 * K, std::min(ROWS_MAX_M, M - m0), K, wp, rb, N, o + m0 * N, b);
    } else {
      panel_path<Q>(xp, M, K, wp, rb, N, o, b);
    }
  });
  return out;
}

bool qmatmul_has_blas() { return sgemm_ != nullptr; }

TORCH_LIBRARY(troupe_qmm, m) {
  m.def("has_blas() -> bool", &qmatmul_has_blas);
  m.def("linear(Tensor x, Tensor w, int qtype, Tensor? bias, int path) -> Tensor", &qmatmul_linear);
  m.def("dequantize(Tensor w, int qtype, int k) -> Tensor", &qmatmul_dequantize);
  m.def("embedding(Tensor w, int qtype, int k, Tensor ids) -> Tensor", &qmatmul_embedding);
}
