// The tiled integer GEMM of the "gguf-q8" mode for batches of many rows (prefill chunks, large decode
// batches): y (M, N) = q8(x) (M, K) @ W^T, W kept as GGUF blocks. Included by qmatmul_q8.cpp.
//
// Weights. A thread unpacks a tile of weight rows once per call into a scratch: per group of L rows
// (L = 16 int32 lanes with AVX-512, 8 with AVX2) and per 32-value chunk c, the L rows' 32 weight integers
// as unsigned bytes u (`Q8Fmt::decode`, Q8_0's signed q stored as q + 128), interleaved 4 bytes at a time:
// vector k4 (0..7) holds bytes 4 k4 .. 4 k4 + 3 of each of the L rows, lane r = row r. Next to them the
// chunk's a[r], b[r] with w = a u + b (Q8_0: b = -128 a).
//
// Activations. Each row is quantized once per call (qmatmul_q8.cpp: q int8, d per chunk, s = d * sum q).
// A dot product along one chunk: sum_i w_i x_i ~= (a d) U + b s, U = sum_i u_i q_i.
//
// Micro-kernel: MR rows of x against one group of L weight rows. Per chunk, 8 steps of one weight-vector
// load and MR integer dot products u (vector) x 4 bytes of q broadcast (`vpdpbusd` where the CPU has VNNI,
// else `vpmaddubsw` pairs summed in int16 for as many steps as cannot overflow, then `vpmaddwd`), then per
// row one int32 -> float32 conversion and two FMAs into float accumulators (the rescale by a d and the
// offset b s). The x rows of a micro-kernel call stay in L1 while the tile's groups stream from L2.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "q8_vec.h"
#include "quant_q8.h"
#include "scratch.h"

namespace troupe_quant {

#if defined(__AVX512F__)
constexpr int GMR = 8;  // rows of x per micro-kernel: MR int32 + MR float accumulators
#else
constexpr int GMR = 4;
#endif

// The largest weight integer of a format's unpacked bytes (Q8_0: q + 128); with `vpmaddubsw` a pair of
// products 2 * UMAX * 127 must fit int16 for every step summed before `vpmaddwd` widens it.
template <int Q>
constexpr int gemm_umax() {
  return Q == Q8_0 ? 255 : (Q == Q5_K ? 31 : 15);
}

// Whether the GEMM takes format Q on this build: per-32 scales only (Q6_K's are per 16), and Q8_0's
// bytes overflow `vpmaddubsw`'s int16 pairs, so it needs VNNI.
template <int Q>
constexpr bool gemm_supported() {
  return Q != Q6_K && (G_VNNI || 2 * gemm_umax<Q>() * 127 <= 32767);
}

// Unpack weight rows [n0, n0 + GL) (rows >= N: zeros) into group scratch: bytes (C x 8 vectors) and a, b
// (C x GL floats each); tmp: GL x K bytes of row-major staging.
template <int Q>
inline void gemm_unpack(const uint8_t* w, int64_t rb, int64_t n0, int64_t N, int64_t K, uint8_t* dst, float* ga,
                        float* gb, uint8_t* tmp) {
  using F = Q8Fmt<Q>;
  const int64_t C = K / 32, nb = K / F::QK;
  for (int r = 0; r < GL; ++r) {
    uint8_t* t = tmp + r * K;
    if (n0 + r >= N) {
      std::memset(t, 0, K);
      for (int64_t c = 0; c < C; ++c) ga[c * GL + r] = gb[c * GL + r] = 0.0f;
      continue;
    }
    const uint8_t* row = w + (n0 + r) * rb;
    for (int64_t b = 0; b < nb; ++b) {
      F::decode(row + b * F::BYTES, [&](int c, __m256i u, float a0, float, float b0, float) {
        const int64_t ci = b * (F::QK / 32) + c;
        if constexpr (F::SIGNED) {
          u = _mm256_xor_si256(u, _mm256_set1_epi8(static_cast<char>(0x80)));  // q + 128
          b0 = -128.0f * a0;
        }
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(t + ci * 32), u);
        ga[ci * GL + r] = a0;
        gb[ci * GL + r] = b0;
      });
    }
  }
  for (int64_t c = 0; c < C; ++c) {
    __m256i rows[GL];
    for (int r = 0; r < GL; ++r) rows[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tmp + r * K + c * 32));
    GI out[8];
    g_transpose(rows, out);
    for (int k = 0; k < 8; ++k) std::memcpy(dst + (c * 8 + k) * sizeof(GI), &out[k], sizeof(GI));
  }
}

// While a group's chunk is unpacked, the same chunk of the next group's first `rows` rows (GL rows further)
// is prefetched: the unpack reads GL rows side by side, GL interleaved streams that the hardware prefetcher
// does not follow well, so weights streamed from memory arrived far below the memory's rate.
inline void prefetch_next_group(const uint8_t* blk, int64_t rb, int rows) {
  const uint8_t* next = blk + GL * rb;
  for (int r = 0; r < rows; ++r) _mm_prefetch(reinterpret_cast<const char*>(next + r * rb), _MM_HINT_T0);
}

// Q4_0 / Q4_1, a whole group (rows n0 .. n0 + GL < N): the packed bytes are transposed as they are (16
// bytes of row r = dwords D0..D3; byte i holds values i and 16 + i), and the nibbles split after: the low
// nibbles of dword d of every row are values 4d .. 4d + 3 (vector d), the high ones 16 + 4d .. (vector 4 + d).
// The scales come from one gather of each block's first dword per chunk (Q4_1: d and m; Q4_0: d).
template <int Q>
inline void gemm_unpack_q4(const uint8_t* w, int64_t rb, int64_t n0, int64_t K, uint8_t* dst, float* ga, float* gb,
                           int pf_rows) {
  constexpr int64_t BYTES = Q == Q4_1 ? 20 : 18, QS = Q == Q4_1 ? 4 : 2;
  const int64_t C = K / 32;
  const uint8_t* base = w + n0 * rb;
  const GI m4 = g_set1_8(0x0F);
  alignas(64) float hi[GL];
  for (int64_t c = 0; c < C; ++c) {
    const uint8_t* blk = base + c * BYTES;
    prefetch_next_group(blk, rb, pf_rows);
    GI a[4], t[4];
    for (int j = 0; j < 4; ++j) a[j] = g_rows4(blk + QS, rb, j);
    t[0] = g_unpacklo32(a[0], a[1]);
    t[1] = g_unpackhi32(a[0], a[1]);
    t[2] = g_unpacklo32(a[2], a[3]);
    t[3] = g_unpackhi32(a[2], a[3]);
    const GI p[4] = {g_unpacklo64(t[0], t[2]), g_unpackhi64(t[0], t[2]), g_unpacklo64(t[1], t[3]), g_unpackhi64(t[1], t[3])};
    uint8_t* o = dst + c * 8 * sizeof(GI);
    for (int d = 0; d < 4; ++d) {
      g_store_i(o + d * sizeof(GI), g_and(p[d], m4));
      g_store_i(o + (4 + d) * sizeof(GI), g_and(g_srli16(p[d], 4), m4));
    }
    g_f16_pairs(blk, rb, ga + c * GL, hi);
    if constexpr (Q == Q4_1) {
      for (int r = 0; r < GL; ++r) gb[c * GL + r] = hi[r];
    } else {
      for (int r = 0; r < GL; ++r) gb[c * GL + r] = -8.0f * ga[c * GL + r];
    }
  }
}

// Q8_0, a whole group: each row's 32 signed bytes transposed 4 at a time (g_transpose), offset to
// unsigned (q + 128, b = -128 a); the scales from one gather per chunk.
inline void gemm_unpack_q8_0(const uint8_t* w, int64_t rb, int64_t n0, int64_t K, uint8_t* dst, float* ga, float* gb,
                             int pf_rows) {
  const int64_t C = K / 32;
  const uint8_t* base = w + n0 * rb;
  const GI flip = g_set1_8(static_cast<char>(0x80));
  alignas(64) float hi[GL];
  for (int64_t c = 0; c < C; ++c) {
    const uint8_t* blk = base + c * 34;
    prefetch_next_group(blk, rb, pf_rows);
    __m256i rows[GL];
    for (int r = 0; r < GL; ++r) rows[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + r * rb + 2));
    GI out[8];
    g_transpose(rows, out);
    uint8_t* o = dst + c * 8 * sizeof(GI);
    for (int k = 0; k < 8; ++k) g_store_i(o + k * sizeof(GI), g_xor(out[k], flip));
    g_f16_pairs(blk, rb, ga + c * GL, hi);
    for (int r = 0; r < GL; ++r) gb[c * GL + r] = -128.0f * ga[c * GL + r];
  }
}

// out[m * ldo + j] = row m of x . weight row j of the group (+ bias[j]), m < MRT, j < nv
template <int Q, int MRT>
inline void gemm_micro(const uint8_t* wq, const float* ga, const float* gb, int64_t C, const int8_t* xq, int64_t K,
                       const float* xd, const float* xs, float* out, int64_t ldo, const float* bias, int nv) {
  constexpr int STEP = G_VNNI ? 8 : std::min(8, 32767 / (2 * gemm_umax<Q>() * 127));  // int16 sums per widening
  GF acc[MRT];
  for (int m = 0; m < MRT; ++m) acc[m] = g_zerof();
  for (int64_t c = 0; c < C; ++c) {
    const uint8_t* wc = wq + c * 8 * sizeof(GI);
    const int8_t* xc = xq + c * 32;
    GI s[MRT];
    for (int m = 0; m < MRT; ++m) s[m] = g_zeroi();
    for (int k0 = 0; k0 < 8; k0 += STEP) {
      if constexpr (G_VNNI) {
        for (int k = k0; k < k0 + STEP; ++k) {
          const GI wv = g_load(wc + k * sizeof(GI));
          for (int m = 0; m < MRT; ++m) {
            int32_t xv;
            std::memcpy(&xv, xc + m * K + 4 * k, 4);
            s[m] = g_dpbusd(s[m], wv, g_bcast(xv));
          }
        }
      } else {
        GI p[MRT];
        for (int k = k0; k < k0 + STEP; ++k) {
          const GI wv = g_load(wc + k * sizeof(GI));
          for (int m = 0; m < MRT; ++m) {
            int32_t xv;
            std::memcpy(&xv, xc + m * K + 4 * k, 4);
            const GI d = g_maddubs(wv, g_bcast(xv));
            p[m] = k == k0 ? d : g_add16(p[m], d);
          }
        }
        for (int m = 0; m < MRT; ++m) s[m] = g_add32(s[m], g_madd1(p[m]));
      }
    }
    const GF a = g_loadf(ga + c * GL), b = g_loadf(gb + c * GL);
    for (int m = 0; m < MRT; ++m) {
      acc[m] = g_fma(g_cvt(s[m]), g_mul(a, g_set1(xd[m * C + c])), acc[m]);
      acc[m] = g_fma(b, g_set1(xs[m * C + c]), acc[m]);
    }
  }
  const GF bv = bias ? g_loadu_n(bias, nv) : g_zerof();
  for (int m = 0; m < MRT; ++m) g_store(out + m * ldo, g_addf(acc[m], bv), nv);
}

template <int Q, int MRT>
inline void gemm_micro_any(int mr, const uint8_t* wq, const float* ga, const float* gb, int64_t C, const int8_t* xq,
                           int64_t K, const float* xd, const float* xs, float* out, int64_t ldo, const float* bias,
                           int nv) {
  if constexpr (MRT > 1) {
    if (mr < MRT) return gemm_micro_any<Q, MRT - 1>(mr, wq, ga, gb, C, xq, K, xd, xs, out, ldo, bias, nv);
  }
  gemm_micro<Q, MRT>(wq, ga, gb, C, xq, K, xd, xs, out, ldo, bias, nv);
}

// y (M, N) = the quantized x (xq (M, K), xd and xs (M, K / 32)) @ W^T (+ bias). Threads take tiles of
// weight groups (as many groups as fit ~256 KiB, the tile count a multiple of the threads so that they
// balance), unpack each tile once and multiply every row of x by it.
template <int Q>
void q8_gemm(const int8_t* xq, const float* xd, const float* xs, int64_t M, int64_t K, const uint8_t* w, int64_t rb,
             int64_t N, float* out, const float* bias) {
  const int64_t C = K / 32, G = (N + GL - 1) / GL;
  const int64_t group_bytes = C * 8 * static_cast<int64_t>(sizeof(GI));
  const int64_t by_cache = std::max<int64_t>(1, (int64_t{1} << 18) / (group_bytes + 2 * C * GL * 4));
  const int64_t threads = at::get_num_threads();
  const int64_t rounds = (G + threads * by_cache - 1) / (threads * by_cache);
  const int64_t TG = (G + threads * rounds - 1) / (threads * rounds);  // groups per tile
  const int64_t tiles = (G + TG - 1) / TG;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    uint8_t* buf = thread_scratch(static_cast<size_t>(TG * group_bytes + 2 * TG * C * GL * 4 + GL * K));
    uint8_t* wq = buf;
    float* ga = reinterpret_cast<float*>(buf + TG * group_bytes);
    float* gb = ga + TG * C * GL;
    uint8_t* tmp = reinterpret_cast<uint8_t*>(gb + TG * C * GL);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t g0 = t * TG, ng = std::min(TG, G - g0);
      for (int64_t g = 0; g < ng; ++g) {
        const int64_t n0 = (g0 + g) * GL;
        // the next group's rows that exist (this thread's next tile follows on; the last group has none)
        const int pf = static_cast<int>(std::clamp<int64_t>(N - (n0 + GL), 0, GL));
        if constexpr (Q == Q4_0 || Q == Q4_1) {
          if (n0 + GL <= N) {
            gemm_unpack_q4<Q>(w, rb, n0, K, wq + g * group_bytes, ga + g * C * GL, gb + g * C * GL, pf);
            continue;
          }
        }
        if constexpr (Q == Q8_0) {
          if (n0 + GL <= N) {
            gemm_unpack_q8_0(w, rb, n0, K, wq + g * group_bytes, ga + g * C * GL, gb + g * C * GL, pf);
            continue;
          }
        }
        gemm_unpack<Q>(w, rb, n0, N, K, wq + g * group_bytes, ga + g * C * GL, gb + g * C * GL, tmp);
      }
      for (int64_t m0 = 0; m0 < M; m0 += GMR) {
        const int mr = static_cast<int>(std::min<int64_t>(GMR, M - m0));
        for (int64_t g = 0; g < ng; ++g) {
          const int64_t n0 = (g0 + g) * GL;
          const int nv = static_cast<int>(std::min<int64_t>(GL, N - n0));
          gemm_micro_any<Q, GMR>(mr, wq + g * group_bytes, ga + g * C * GL, gb + g * C * GL, C, xq + m0 * K, K,
                                 xd + m0 * C, xs + m0 * C, out + m0 * N + n0, N, bias ? bias + n0 : nullptr, nv);
        }
      }
    }
  });
}

}  // namespace troupe_quant
