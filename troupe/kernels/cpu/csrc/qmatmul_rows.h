// The rows path of the float projection (qmatmul.cpp): y (M, N) = x (M, K) @ W^T (+ bias) for decode-sized
// M (1..4 rows of x), W kept as its raw blocks. Included by qmatmul.cpp only, after quant.h (and its
// fp-contract pragma: the decoded values stay the reference's bit for bit; the FMAs are explicit).
//
// At M = 1 the work per weight block is one decode and NV FMAs, so a kernel that walks one weight row at a
// time is bound by the latency of its few FMA chains and pays a full horizontal reduction per output. Here
// R weight rows are in flight: block b of each of the R rows is decoded and multiplied into its own
// accumulators (R x MB x NA independent chains), and the R rows' sums are reduced together (four at once
// into one 4-float store, `sum4`). The next rows' bytes are prefetched while a group computes. Threads
// take contiguous, equal runs of row groups, so each streams one region of W.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "quant.h"

namespace troupe_quant {

// the sums of the lanes of a0..a3, as one 4-float vector
inline __m128 sum4(Vf a0, Vf a1, Vf a2, Vf a3) {
#if defined(__AVX512F__)
  __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  __m512 s = _mm512_add_ps(_mm512_shuffle_ps(s01, s23, 0x44), _mm512_shuffle_ps(s01, s23, 0xEE));
  __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
#else
  __m256 s01 = _mm256_hadd_ps(a0, a1), s23 = _mm256_hadd_ps(a2, a3);
  __m256 s = _mm256_hadd_ps(s01, s23);
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
#endif
}

namespace rows {

// Vector registers the accumulators may take (the rest hold the decoder's temporaries and x):
// AVX-512 has 32, AVX2 16.
#if defined(__AVX512F__)
constexpr int ACC_REGS = 16;
#else
constexpr int ACC_REGS = 8;
#endif

// weight rows in flight for MB rows of x: 4 (one sum4 reduction) while 4 x MB accumulators fit, else 2
template <int MB>
constexpr int group_rows() {
  return 4 * MB <= ACC_REGS ? 4 : 2;
}

// accumulators per (weight row, row of x): up to NV (one per vector of a chunk: shorter FMA chains) while
// R x MB x NA of them fit the registers; a divisor of NV
template <int MB, int R>
constexpr int acc_split() {
  int na = NV;
  while (na > 1 && R * MB * na > ACC_REGS) na /= 2;
  return na;
}

// How far ahead (in weight rows) a group prefetches: two groups of four at M = 1. Without it the
// projections of a decode step in model order run much slower (the hardware prefetcher stops at every
// 4 KiB page and falls behind four streams); 8 and 16 rows measured level, and T0 and T1 hints
// (docs/kernels.md).
constexpr int64_t PREFETCH_ROWS = 8;

// Rows of x one kernel call takes at most (MB = 1..MAX_MB); more rows go in passes of MAX_MB.
constexpr int64_t MAX_MB = 4;

// fn(m0, std::integral_constant<int, MB>{}) for each pass over M rows of x: rows m0 .. m0 + MB - 1
template <class Fn>
inline void passes(int64_t M, Fn&& fn) {
  for (int64_t m0 = 0; m0 < M; m0 += MAX_MB) {
    switch (std::min(MAX_MB, M - m0)) {
      case 1: fn(m0, std::integral_constant<int, 1>{}); break;
      case 2: fn(m0, std::integral_constant<int, 2>{}); break;
      case 3: fn(m0, std::integral_constant<int, 3>{}); break;
      default: fn(m0, std::integral_constant<int, 4>{}); break;
    }
  }
}

// out[m * ldo + r] = sum of the lanes of s[r][m] (+ bias[r]) for m < MB, r < R: four rows' sums reduced
// together into one 4-float store (sum4)
template <int MB, int R>
inline void store_sums(const Vf (&s)[R][MB], float* out, int64_t ldo, const float* bias) {
  if constexpr (R == 4) {
    const __m128 bv = bias ? _mm_loadu_ps(bias) : _mm_setzero_ps();
    for (int m = 0; m < MB; ++m) _mm_storeu_ps(out + m * ldo, _mm_add_ps(sum4(s[0][m], s[1][m], s[2][m], s[3][m]), bv));
  } else {
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < MB; ++m) out[m * ldo + r] = vsum(s[r][m]) + (bias ? bias[r] : 0.0f);
  }
}

// out[m * ldo + n + r] = dot(x[m], W[n + r]) (+ bias[n + r]) for m < MB, r < R; `w` points at row n,
// `pf` at the bytes to prefetch while this group computes (R rows' worth, consumed at the group's pace)
template <int Q, int MB, int R>
inline void group(const float* x, int64_t ldx, const uint8_t* w, int64_t row_bytes, int64_t nb, const uint8_t* pf,
                  float* out, int64_t ldo, const float* bias) {
  using F = Fmt<Q>;
  constexpr int NA = acc_split<MB, R>();
  Vf acc[R][MB][NA];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m)
      for (int a = 0; a < NA; ++a) acc[r][m][a] = vzero();
  for (int64_t b = 0; b < nb; ++b) {
    for (int64_t o = b * R * F::BYTES; o < (b + 1) * R * F::BYTES; o += 64)
      _mm_prefetch(reinterpret_cast<const char*>(pf + o), _MM_HINT_T0);
    const float* xb = x + b * F::QK;
#pragma GCC unroll 4  // each row's accumulators stay in registers (a loop over r kept them in memory)
    for (int r = 0; r < R; ++r) {
      F::decode(w + r * row_bytes + b * F::BYTES, [&](int c, const Vf* wv) {
        for (int m = 0; m < MB; ++m)
          for (int j = 0; j < NV; ++j)
            acc[r][m][j % NA] = vfma(wv[j], vload(xb + m * ldx + 32 * c + W * j), acc[r][m][j % NA]);
      });
    }
  }
  Vf s[R][MB];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) {
      s[r][m] = acc[r][m][0];
      for (int a = 1; a < NA; ++a) s[r][m] = vadd(s[r][m], acc[r][m][a]);
    }
  store_sums<MB, R>(s, out, ldo, bias);
}

// Walks the row groups [g0, g1) of W (N rows of row_bytes): full(n, pf) for each whole group of R rows from
// row n, pf the bytes to prefetch while it computes (rows PREFETCH_ROWS ahead, inside W); one(r, pf) for each
// row of the last, partial group.
template <int R, class Full, class One>
inline void walk_groups(const uint8_t* w, int64_t row_bytes, int64_t N, int64_t g0, int64_t g1, Full&& full, One&& one) {
  const uint8_t* last = w + (N - 1) * row_bytes;
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t n = g * R;
    if (n + R <= N)
      full(n, std::min(w + (n + PREFETCH_ROWS) * row_bytes, w + (N - R) * row_bytes));
    else
      for (int64_t r = n; r < N; ++r) one(r, last);
  }
}

// rows [g0 * R, min(g1 * R, N)) of the output, for MB rows of x
template <int Q, int MB>
void range(const float* x, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t N, int64_t g0, int64_t g1,
           float* out, const float* bias) {
  constexpr int R = group_rows<MB>();
  const int64_t nb = K / Fmt<Q>::QK;
  walk_groups<R>(
      w, row_bytes, N, g0, g1,
      [&](int64_t n, const uint8_t* pf) {
        group<Q, MB, R>(x, K, w + n * row_bytes, row_bytes, nb, pf, out + n, N, bias ? bias + n : nullptr);
      },
      [&](int64_t r, const uint8_t* pf) {
        group<Q, MB, 1>(x, K, w + r * row_bytes, row_bytes, nb, pf, out + r, N, bias ? bias + r : nullptr);
      });
}

// Blocks one thread should at least get before another thread is woken (a few microseconds of work).
constexpr int64_t MIN_BLOCKS_PER_THREAD = 2048;

}  // namespace rows

// y[m, n] for the MB = M rows of x (M <= 4); N split across threads in contiguous runs of row groups
template <int Q, int MB>
void rows_path_mb(const float* x, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t N, float* out,
                  const float* bias) {
  constexpr int R = rows::group_rows<MB>();
  const int64_t groups = (N + R - 1) / R;
  const int64_t blocks_per_group = R * (K / Fmt<Q>::QK);
  const int64_t grain = std::max<int64_t>(1, rows::MIN_BLOCKS_PER_THREAD / std::max<int64_t>(1, blocks_per_group));
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    rows::range<Q, MB>(x, K, w, row_bytes, N, g0, g1, out, bias);
  });
}

template <int Q>
void rows_path(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t N, float* out,
               const float* bias) {
  switch (M) {
    case 1: rows_path_mb<Q, 1>(x, K, w, row_bytes, N, out, bias); break;
    case 2: rows_path_mb<Q, 2>(x, K, w, row_bytes, N, out, bias); break;
    case 3: rows_path_mb<Q, 3>(x, K, w, row_bytes, N, out, bias); break;
    default: rows_path_mb<Q, 4>(x, K, w, row_bytes, N, out, bias); break;
  }
}

// ------------------------------------------------------------------------------- the former rows path
//
// One weight row at a time (MB x NV accumulators), N split into runs of at least 16 rows: kept callable
// (path 2) as the baseline that `python -m troupe.bench.kernels --model-order` measures the above against.

template <int Q, int MB>
void rows1_kernel(const float* x, int64_t ldx, const uint8_t* w, int64_t row_bytes, int64_t K, int64_t n0,
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
void rows1_path(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t N, float* out,
                const float* bias) {
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    switch (M) {
      case 1: rows1_kernel<Q, 1>(x, K, w, row_bytes, K, n0, n1, out, N, bias); break;
      case 2: rows1_kernel<Q, 2>(x, K, w, row_bytes, K, n0, n1, out, N, bias); break;
      case 3: rows1_kernel<Q, 3>(x, K, w, row_bytes, K, n0, n1, out, N, bias); break;
      default: rows1_kernel<Q, 4>(x, K, w, row_bytes, K, n0, n1, out, N, bias); break;
    }
  });
}

}  // namespace troupe_quant
