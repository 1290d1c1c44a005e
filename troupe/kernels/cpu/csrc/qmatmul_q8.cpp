// The "gguf-q8" projection: x quantized to 8 bits per 32-value chunk (each row once per call), integer dot
// products with the weight blocks (quant_q8.h has the formats and the arithmetic). Two kernels:
// - the tiled GEMM (q8_gemm.h), for batches (by M: see qmatmul_linear_q8): weight tiles unpacked to bytes once
//   per call, register-blocked integer dot products; every format but Q6_K (per-16 scales), and Q8_0 only
//   where the CPU has VNNI;
// - the rows kernel (below), for fewer rows where it pays (AVX2 builds on AMD CPUs: see ByM): each weight
//   block decoded to bytes once per group of up to 4 rows of x and multiplied into all of them; N split
//   across threads.
// Anything else (a few rows elsewhere, Q6_K batches, Q8_0 batches without VNNI, the float formats
// F32/F16/BF16) takes the output-exact float path (qmatmul.cpp). docs/kernels.md has the measured crossovers.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <utility>

#include "q8_gemm.h"
#include "quant_q8.h"

at::Tensor qmatmul_linear(const at::Tensor& x, const at::Tensor& w, int64_t qtype, const std::optional<at::Tensor>& bias,
                          int64_t path);

namespace {

using namespace troupe_quant;

constexpr int64_t Q8_ROWS = 4;  // rows of x per pass over the weights

// The by-M choice (measured in model order, 2 threads; docs/kernels.md), in rows of x:
struct ByM {
  int64_t float_rows_max_m;  // the float rows path up to this M
  int64_t q8_rows_first_m;   // then the rows kernel up to this M, before the GEMM
  int64_t q8_max_m;          // formats without the GEMM: the rows kernel up to this M, then the float path
};
// The float rows path up to 4 rows (exact, and it streams the weights faster than either integer kernel
// there), then the GEMM: AVX-512 builds (their in-register lookup decode), and AVX2 builds on Intel CPUs
// (held to AVX2, Intel cores ran the rows kernel well behind the float path at 1-2 rows: their vector ALU
// ports are fewer than Zen's).
constexpr ByM FLOAT_FIRST{4, 0, 0};
// AVX2 builds on AMD CPUs (the issue-13 machine, an EPYC with AVX-512 hidden): the float decode costs more
// than the integer one at every M, so the rows kernel takes 1-2 rows, the GEMM from 3; formats without the
// GEMM the rows kernel up to 4.
constexpr ByM INTEGER_FIRST{0, 2, 4};

const ByM& by_m_here() {
#if defined(__AVX512F__)
  return FLOAT_FIRST;
#else
  static const ByM* const table = [] {  // one of the two tables itself (q8_table compares addresses)
    __builtin_cpu_init();
    return __builtin_cpu_is("amd") ? &INTEGER_FIRST : &FLOAT_FIRST;
  }();
  return *table;
#endif
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline int32_t hsum8i(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// Chunks of x a thread quantizes at least (a few % of the projection that follows): a smaller x is
// quantized on the calling thread, so that a call opens one parallel region, not two (on a loaded machine
// each region can wait a whole scheduler slice for a thread that lost its core).
constexpr int64_t QUANT_GRAIN = 16384;

// x (M, K) -> q (M, K) int8, d (M, K/32): the chunk scales, ds (M, K/16): d * the sums of q per 16 values
void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* q, float* d, float* ds) {
  const int64_t nc = K / 32;
  at::parallel_for(0, M * nc, QUANT_GRAIN, [&](int64_t i0, int64_t i1) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t i = i0; i < i1; ++i) {
      const float* src = x + i * 32;  // chunk i of the flattened (M, nc) grid: rows are whole chunks
      __m256 v[4];
      __m256 amax = _mm256_setzero_ps();
      for (int j = 0; j < 4; ++j) {
        v[j] = _mm256_loadu_ps(src + 8 * j);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
      }
      __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      m = _mm_max_ps(m, _mm_movehl_ps(m, m));
      m = _mm_max_ss(m, _mm_movehdup_ps(m));
      const float dd = _mm_cvtss_f32(m) / 127.0f;
      const __m256 id = _mm256_set1_ps(dd != 0.0f ? 1.0f / dd : 0.0f);
      __m256i qi[4];
      for (int j = 0; j < 4; ++j) qi[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], id));  // round to nearest even
      __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i * 32), _mm256_permutevar8x32_epi32(p, order));
      d[i] = dd;
      ds[2 * i] = dd * static_cast<float>(hsum8i(_mm256_add_epi32(qi[0], qi[1])));
      ds[2 * i + 1] = dd * static_cast<float>(hsum8i(_mm256_add_epi32(qi[2], qi[3])));
    }
  });
}

template <int Q, int MB>
void q8_rows(const int8_t* xq, const float* xd, const float* xds, int64_t K, const uint8_t* w, int64_t rb,
             int64_t n0, int64_t n1, float* out, int64_t ldo, const float* bias) {
  using F = Q8Fmt<Q>;
  const int64_t nb = K / F::QK, nc = K / 32;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * rb;
    __m256 acc[MB];
    float sacc[MB];
    for (int m = 0; m < MB; ++m) {
      acc[m] = _mm256_setzero_ps();
      sacc[m] = 0.0f;
    }
    for (int64_t b = 0; b < nb; ++b) {
      F::decode(row + b * F::BYTES, [&](int c, __m256i u, float a0, float a1, float b0, float b1) {
        const int64_t ci = b * (F::QK / 32) + c;
        __m256 a;
        if constexpr (Q == Q6_K) {
          a = _mm256_setr_m128(_mm_set1_ps(a0), _mm_set1_ps(a1));  // lanes 0-3: values 0..15
        } else {
          a = _mm256_set1_ps(a0);
        }
        for (int m = 0; m < MB; ++m) {
          const int64_t xi = m * nc + ci;
          __m256i dot = dot32<F::SIGNED>(u, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + xi * 32)));
          acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(a, _mm256_set1_ps(xd[xi])), acc[m]);
          sacc[m] += b0 * xds[2 * xi] + b1 * xds[2 * xi + 1];
        }
      });
    }
    const float add = bias ? bias[n] : 0.0f;
    for (int m = 0; m < MB; ++m) out[m * ldo + n] = hsum8(acc[m]) + sacc[m] + add;
  }
}

template <int Q>
void q8_linear(const int8_t* xq, const float* xd, const float* xds, int64_t M, int64_t K, const uint8_t* w,
               int64_t rb, int64_t N, float* out, const float* bias) {
  const int64_t nc = K / 32;
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t m0 = 0; m0 < M; m0 += Q8_ROWS) {
      const int8_t* q = xq + m0 * K;
      const float* d = xd + m0 * nc;
      const float* s = xds + 2 * m0 * nc;
      float* o = out + m0 * N;
      switch (std::min(Q8_ROWS, M - m0)) {
        case 1: q8_rows<Q, 1>(q, d, s, K, w, rb, n0, n1, o, N, bias); break;
        case 2: q8_rows<Q, 2>(q, d, s, K, w, rb, n0, n1, o, N, bias); break;
        case 3: q8_rows<Q, 3>(q, d, s, K, w, rb, n0, n1, o, N, bias); break;
        default: q8_rows<Q, 4>(q, d, s, K, w, rb, n0, n1, o, N, bias); break;
      }
    }
  });
}

// The kernel the by-M choice `t` takes for M rows: -1 the output-exact float path, 0 the rows kernel, 1 the
// GEMM. Up to float_rows_max_m rows the float rows path, then up to q8_rows_first_m the rows kernel, then
// the GEMM where the format has one, else the rows kernel up to q8_max_m rows, else the float path; the
// float formats (`integer` false: no integer kernels): the float path. `gemm`: the format has the GEMM here.
int64_t path_by_m(bool integer, bool gemm, int64_t M, const ByM& t = by_m_here()) {
  if (!integer || M <= t.float_rows_max_m) return -1;
  return M <= t.q8_rows_first_m ? 0 : gemm ? 1 : (M <= t.q8_max_m ? 0 : -1);
}

// The format's (integer, gemm) on this build.
std::pair<bool, bool> q8_kernels(int64_t qtype) {
  bool gemm = false;
  const bool integer = dispatch_q8(qtype, [&](auto q) { gemm = gemm_supported<decltype(q)::value>(); });
  return {integer, gemm};
}

}  // namespace

// The by-M choice for format qtype on this machine (path_by_m), for tests
int64_t q8_path(int64_t qtype, int64_t M) {
  const auto [integer, gemm] = q8_kernels(qtype);
  return path_by_m(integer, gemm, M);
}

// Which table this machine's choice uses: 1 integer first (AVX2 builds on AMD), 0 float first; and the
// choice under a given table (`integer_first`), for tests on any machine
int64_t q8_table() { return &by_m_here() == &INTEGER_FIRST ? 1 : 0; }

int64_t q8_path_with(int64_t qtype, int64_t M, bool integer_first) {
  const auto [integer, gemm] = q8_kernels(qtype);
  return path_by_m(integer, gemm, M, integer_first ? INTEGER_FIRST : FLOAT_FIRST);
}

// The projection with 8-bit activations; `path` -1: by M (path_by_m), 0: the rows kernel whatever M, 1: the
// GEMM whatever M (a format without one: the rows kernel) (tests).
at::Tensor qmatmul_linear_q8(const at::Tensor& x, const at::Tensor& w, int64_t qtype, const std::optional<at::Tensor>& bias,
                             int64_t path) {
  const auto [integer, gemm] = q8_kernels(qtype);
  const int64_t M = x.dim() == 2 ? x.size(0) : 0;
  if (path < 0) path = path_by_m(integer, gemm, M);
  if (!integer || path < 0) return qmatmul_linear(x, w, qtype, bias, -1);
  at::Tensor out = qmatmul_linear(x.narrow(0, 0, 0), w, qtype, bias, -1);  // checks the arguments
  const int64_t K = x.size(1), N = w.size(0), nc = K / 32;
  const at::Tensor xc = x.contiguous();
  at::Tensor xq = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor xd = at::empty({M, nc}, x.options());
  at::Tensor xds = at::empty({M, K / 16}, x.options());
  quantize_rows(xc.data_ptr<float>(), M, K, xq.data_ptr<int8_t>(), xd.data_ptr<float>(), xds.data_ptr<float>());
  out = at::empty({M, N}, x.options());
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  if (path == 1 && gemm && M > 0) {
    at::Tensor xs = at::empty({M, nc}, x.options());  // d * the sum of q, per chunk
    const float* ds = xds.data_ptr<float>();
    float* s = xs.data_ptr<float>();
    for (int64_t i = 0; i < M * nc; ++i) s[i] = ds[2 * i] + ds[2 * i + 1];
    dispatch_q8(qtype, [&](auto q) {
      constexpr int Q = decltype(q)::value;
      if constexpr (gemm_supported<Q>()) {
        q8_gemm<Q>(xq.data_ptr<int8_t>(), xd.data_ptr<float>(), s, M, K, w.data_ptr<uint8_t>(), w.size(1), N,
                   out.data_ptr<float>(), b);
      }
    });
    return out;
  }
  dispatch_q8(qtype, [&](auto q) {
    q8_linear<decltype(q)::value>(xq.data_ptr<int8_t>(), xd.data_ptr<float>(), xds.data_ptr<float>(), M, K,
                                  w.data_ptr<uint8_t>(), w.size(1), N, out.data_ptr<float>(), b);
  });
  return out;
}

// The activation quantization alone: (q int8 (M, K), d (M, K/32), ds (M, K/16)), for tests.
std::tuple<at::Tensor, at::Tensor, at::Tensor> qmatmul_quantize_q8(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) % 32 == 0, "troupe_qmm: x must be (M, 32k) float32");
  const at::Tensor xc = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor q = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({M, K / 32}, x.options());
  at::Tensor ds = at::empty({M, K / 16}, x.options());
  quantize_rows(xc.data_ptr<float>(), M, K, q.data_ptr<int8_t>(), d.data_ptr<float>(), ds.data_ptr<float>());
  return {q, d, ds};
}

TORCH_LIBRARY_FRAGMENT(troupe_qmm, m) {
  m.def("linear_q8(Tensor x, Tensor w, int qtype, Tensor? bias, int path) -> Tensor", &qmatmul_linear_q8);
  m.def("quantize_q8(Tensor x) -> (Tensor, Tensor, Tensor)", &qmatmul_quantize_q8);
  m.def("q8_path(int qtype, int m) -> int", &q8_path);
  m.def("q8_table() -> int", &q8_table);
  m.def("q8_path_with(int qtype, int m, bool integer_first) -> int", &q8_path_with);
}
