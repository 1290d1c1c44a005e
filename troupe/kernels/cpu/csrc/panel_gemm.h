// The panel path's GEMM (moderate and large M): out (M, N) = x (M, K) @ W^T (+ bias), W (N, K) GGUF blocks.
//
// BLIS-style outer products. A thread takes a tile of weight rows, decodes it once into packed panels of
// NR columns ([panel][k][NR] floats: for each k the NR rows' values side by side) and then, for each block
// of up to MR rows of x, accumulates an MR x NR register tile over k: acc[m][v] += x[m][k] * B[k][v] with
// x[m][k] broadcast (x read in place, the block's K-segment hot in L1) and B streamed from L2 (NR / W
// vector loads feed MR * NR / W FMAs). No horizontal sums; C rows are stored directly (masked past the
// tile's last column). K is split into KC-long slices (x block + B micro-panel within L1); a later slice
// adds into C.
//
// Packing: rows are decoded W at a time, one block of K per row, into a small row-major stage (L1), then
// W x W transposed in registers (AVX-512 16 x 16, AVX2 8 x 8) into the panel; rows past N are zeros.
// AVX-512: MR = 12, NR = 32 (24 zmm accumulators); AVX2: MR = 6, NR = 16 (12 ymm).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>

#include "quant.h"

namespace troupe_quant {

#if defined(__AVX512F__)
constexpr int G_MR = 12;
#else
constexpr int G_MR = 6;
#endif
constexpr int G_NV = 2;            // vectors per panel row
constexpr int G_NR = G_NV * W;     // columns per panel: 32 (AVX-512) or 16 (AVX2)
constexpr int64_t G_KC = 384;      // k per slice

// A 64-byte aligned float buffer that lives as long as its thread and only grows (no allocation, no page
// faults per call).
inline float* thread_buffer(size_t n) {
  struct Buf {
    float* p = nullptr;
    size_t n = 0;
    ~Buf() { std::free(p); }
  };
  thread_local Buf buf;
  if (buf.n < n) {
    std::free(buf.p);
    buf.p = static_cast<float*>(std::aligned_alloc(64, (n * sizeof(float) + 63) / 64 * 64));
    TORCH_CHECK(buf.p != nullptr, "troupe_qmm: out of memory");
    buf.n = n;
  }
  return buf.p;
}

// ------------------------------------------------------------------------------- W x W transposes

#if defined(__AVX512F__)
// r[i] (i < 16) rows of 16 floats -> r[j] = column j
inline void transpose_w(Vf r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  // now r[4a + b] holds, per 128-bit lane l, column 4l + (b') of rows 4a..4a+3 (b' the in-lane index)
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
    r[i + 4] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0xDD);
  }
}
#else
inline void transpose_w(Vf r[8]) {
  __m256 t[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  __m256 u[8];
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}
#endif

// ------------------------------------------------------------------------------- packing

// Decode weight rows [0, nr) (nr <= G_NR; row r at w + r * row_bytes) into one panel: dst[k * G_NR + j] =
// W[j][k] for k < K, zero for j >= nr. `stage`: W * QK floats.
template <int Q>
void pack_panel(const uint8_t* w, int64_t row_bytes, int64_t K, int nr, float* stage, float* dst) {
  using F = Fmt<Q>;
  constexpr int QK = F::QK;
  const int64_t nb = K / QK;
  for (int64_t b = 0; b < nb; ++b) {
    for (int g = 0; g < G_NV; ++g) {  // both halves of each panel line while it is in L1
      const int rows = std::clamp(nr - g * W, 0, W);
      for (int r = 0; r < rows; ++r) {
        float* o = stage + r * QK;
        F::decode(w + (g * W + r) * row_bytes + b * F::BYTES, [&](int c, const Vf* v) {
          for (int j = 0; j < NV; ++j) vstore(o + 32 * c + W * j, v[j]);
        });
      }
      if (rows < W) std::fill(stage + rows * QK, stage + W * QK, 0.0f);
      float* d = dst + b * QK * G_NR + g * W;
      for (int k0 = 0; k0 < QK; k0 += W) {
        Vf t[W];
        for (int r = 0; r < W; ++r) t[r] = vload(stage + r * QK + k0);
        transpose_w(t);
        for (int j = 0; j < W; ++j) vstore(d + (k0 + j) * G_NR, t[j]);
      }
    }
  }
}

// ------------------------------------------------------------------------------- micro-kernel

// c[m * ldc + j] (m < mr, j < nc) = (first ? bias[j] : c[...]) + sum_k x[m * ldx + k] * b[k * G_NR + j]
template <int mr>
inline void gemm_micro(const float* x, int64_t ldx, const float* b, int64_t kc, float* c, int64_t ldc, int nc,
                       const float* bias, bool first) {
  Vf acc[mr][G_NV];
  for (int m = 0; m < mr; ++m)
    for (int v = 0; v < G_NV; ++v) acc[m][v] = vzero();
  for (int64_t k = 0; k < kc; ++k) {
    Vf bv[G_NV];
    for (int v = 0; v < G_NV; ++v) bv[v] = vload(b + k * G_NR + v * W);
    for (int m = 0; m < mr; ++m) {
      const Vf a = vset1(x[m * ldx + k]);
      for (int v = 0; v < G_NV; ++v) acc[m][v] = vfma(a, bv[v], acc[m][v]);
    }
  }
#if defined(__AVX512F__)
  __mmask16 mask[G_NV];
  for (int v = 0; v < G_NV; ++v) {
    const int n = std::clamp(nc - v * W, 0, W);
    mask[v] = static_cast<__mmask16>((1u << n) - 1);
  }
  Vf base[G_NV];
  for (int v = 0; v < G_NV; ++v) base[v] = first && bias ? _mm512_maskz_loadu_ps(mask[v], bias + v * W) : vzero();
  for (int m = 0; m < mr; ++m)
    for (int v = 0; v < G_NV; ++v) {
      float* p = c + m * ldc + v * W;
      const Vf prev = first ? base[v] : _mm512_maskz_loadu_ps(mask[v], p);
      _mm512_mask_storeu_ps(p, mask[v], vadd(prev, acc[m][v]));
    }
#else
  if (nc == G_NR) {
    Vf base[G_NV];
    for (int v = 0; v < G_NV; ++v) base[v] = first && bias ? vload(bias + v * W) : vzero();
    for (int m = 0; m < mr; ++m)
      for (int v = 0; v < G_NV; ++v) {
        float* p = c + m * ldc + v * W;
        vstore(p, vadd(first ? base[v] : vload(p), acc[m][v]));
      }
  } else {  // the tile's last, partial panel
    alignas(32) float t[G_NR];
    for (int m = 0; m < mr; ++m) {
      for (int v = 0; v < G_NV; ++v) vstore(t + v * W, acc[m][v]);
      float* p = c + m * ldc;
      for (int j = 0; j < nc; ++j) p[j] = (first ? (bias ? bias[j] : 0.0f) : p[j]) + t[j];
    }
  }
#endif
}

template <int mr>
inline void gemm_micro_any(int mr_rt, const float* x, int64_t ldx, const float* b, int64_t kc, float* c, int64_t ldc,
                           int nc, const float* bias, bool first) {
  if constexpr (mr > 1) {
    if (mr_rt < mr) return gemm_micro_any<mr - 1>(mr_rt, x, ldx, b, kc, c, ldc, nc, bias, first);
  }
  gemm_micro<mr>(x, ldx, b, kc, c, ldc, nc, bias, first);
}

// ------------------------------------------------------------------------------- the path

// Panels per tile: one or two for decode-sized M (many tiles to share), for larger M as many as fit
// ~512 KiB of L2 (x streams once per tile), but at least two tiles per thread.
inline int64_t gemm_tile_panels(int64_t M, int64_t N, int64_t K) {
  const int64_t panels = (N + G_NR - 1) / G_NR;
  if (M <= 64) return 1;
  const int64_t by_cache = std::max<int64_t>(1, (int64_t{1} << 19) / (4 * K * G_NR));
  const int64_t threads = at::get_num_threads();
  const int64_t by_threads = (panels + 2 * threads - 1) / (2 * threads);
  return std::max<int64_t>(1, std::min(by_cache, by_threads));
}

inline int64_t tune_env(const char* name, int64_t dflt) {
  const char* v = std::getenv(name);
  return v ? std::atoll(v) : dflt;
}
inline int64_t tune_order() { static int64_t v = tune_env("TQ_ORDER", 0); return v; }
inline int64_t tune_kc() { static int64_t v = tune_env("TQ_KC", G_KC); return v; }
inline int64_t tune_tp() { static int64_t v = tune_env("TQ_TP", 0); return v; }

template <int Q>
void gemm_panel_path(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t N, float* out,
                     const float* bias) {
  const int64_t tp = tune_tp() ? tune_tp() : gemm_tile_panels(M, N, K);
  const int64_t KC = tune_kc();
  const int64_t NT = tp * G_NR;
  const int64_t tiles = (N + NT - 1) / NT;
  // M in blocks of at most G_MR rows, as even as possible (13 rows: 7 + 6, not 12 + 1)
  const int64_t mblocks = (M + G_MR - 1) / G_MR;
  const int64_t mbase = M / mblocks, mextra = M % mblocks;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    float* packed = thread_buffer(static_cast<size_t>(NT * K + W * Fmt<Q>::QK));
    float* stage = packed + NT * K;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * NT, nt = std::min<int64_t>(NT, N - n0);
      const int64_t np = (nt + G_NR - 1) / G_NR;
      for (int64_t p = 0; p < np; ++p) {
        const int nr = static_cast<int>(std::min<int64_t>(G_NR, nt - p * G_NR));
        pack_panel<Q>(w + (n0 + p * G_NR) * row_bytes, row_bytes, K, nr, stage, packed + p * K * G_NR);
      }
      if (tune_order() == 9) {
      } else if (tune_order() == 0) {
        int64_t m0 = 0;
        for (int64_t mb = 0; mb < mblocks; ++mb) {
          const int mr = static_cast<int>(mbase + (mb < mextra ? 1 : 0));
          for (int64_t k0 = 0; k0 < K; k0 += KC) {
            const int64_t kc = std::min<int64_t>(KC, K - k0);
            for (int64_t p = 0; p < np; ++p) {
              const int nc = static_cast<int>(std::min<int64_t>(G_NR, nt - p * G_NR));
              const int64_t n = n0 + p * G_NR;
              gemm_micro_any<G_MR>(mr, x + m0 * K + k0, K, packed + p * K * G_NR + k0 * G_NR, kc, out + m0 * N + n, N,
                                   nc, bias ? bias + n : nullptr, k0 == 0);
            }
          }
          m0 += mr;
        }
      } else {
        for (int64_t k0 = 0; k0 < K; k0 += KC) {
          const int64_t kc = std::min<int64_t>(KC, K - k0);
          for (int64_t p = 0; p < np; ++p) {
            const int nc = static_cast<int>(std::min<int64_t>(G_NR, nt - p * G_NR));
            const int64_t n = n0 + p * G_NR;
            int64_t m0 = 0;
            for (int64_t mb = 0; mb < mblocks; ++mb) {
              const int mr = static_cast<int>(mbase + (mb < mextra ? 1 : 0));
              gemm_micro_any<G_MR>(mr, x + m0 * K + k0, K, packed + p * K * G_NR + k0 * G_NR, kc, out + m0 * N + n, N,
                                   nc, bias ? bias + n : nullptr, k0 == 0);
              m0 += mr;
            }
          }
        }
      }
    }
  });
}

}  // namespace troupe_quant
