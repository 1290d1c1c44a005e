// 8-bit activations x GGUF blocks: integer dot products (the "gguf-q8" mode).
//
// Activations: each row of x is cut into 32-value chunks; chunk c gets d = max|x| / 127 (float32), its
// values q = round(x / d) (int8, ties to even) and the per-16 sums of q times d (ds[2c], ds[2c+1]) — as
// llama.cpp's Q8_0 / Q8_1 activation blocks, with the scale kept in float32.
//
// Weights: `Q8Fmt<QTYPE>::decode(block, emit)` calls `emit(c, bytes, a0, a1, b0, b1)` per 32-value chunk:
// the chunk's 32 weight integers u as bytes (unsigned, or signed for Q8_0: SIGNED) with
// w = a * u + b (a0, b0 for values 0..15, a1, b1 for 16..31), so that
//   sum_i w_i x_i ~= d * (a0 * U0 + a1 * U1) + b0 * ds[2c] + b1 * ds[2c+1],  U_h = sum_{half h} u_i q_i.
// The integer dot of 32 bytes is one VNNI `vpdpbusd` where the CPU has it, else `vpmaddubsw` + `vpmaddwd`
// (no saturation: |u| <= 63, or 128 for the sign trick of Q8_0, times |q| <= 127, two at a time, fit int16).
#pragma once

#include "quant.h"

namespace troupe_quant {

// int32 x 8: lane l = sum of u[4l..4l+3] * q[4l..4l+3] (u unsigned bytes, or signed when SIGNED)
template <bool SIGNED>
inline __m256i dot32(__m256i u, __m256i q) {
  if constexpr (SIGNED) {  // |u| * (sign(u) q): the unsigned x signed product the instructions take
    q = _mm256_sign_epi8(q, u);
    u = _mm256_sign_epi8(u, u);
  }
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, q);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, q);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, q), _mm256_set1_epi16(1));
#endif
}

// 16 packed bytes -> 32 bytes: the 16 low nibbles, then the 16 high ones
inline __m256i q8_nibbles(const uint8_t* p) {
  __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  __m128i m = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m), _mm_and_si128(q, m));
}

template <int QTYPE>
struct Q8Fmt;

template <>
struct Q8Fmt<Q8_0> {
  static constexpr int QK = 32, BYTES = 34;
  static constexpr bool SIGNED = true;
  template <class Emit>
  static inline void decode(const uint8_t* b, Emit&& emit) {
    const float d = f16(b);
    emit(0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2)), d, d, 0.0f, 0.0f);
  }
};

template <>
struct Q8Fmt<Q4_0> {
  static constexpr int QK = 32, BYTES = 18;
  static constexpr bool SIGNED = false;
  template <class Emit>
  static inline void decode(const uint8_t* b, Emit&& emit) {
    const float d = f16(b);
    emit(0, q8_nibbles(b + 2), d, d, -8.0f * d, -8.0f * d);
  }
};

template <>
struct Q8Fmt<Q4_1> {
  static constexpr int QK = 32, BYTES = 20;
  static constexpr bool SIGNED = false;
  template <class Emit>
  static inline void decode(const uint8_t* b, Emit&& emit) {
    const float d = f16(b), m = f16(b + 2);
    emit(0, q8_nibbles(b + 4), d, d, m, m);
  }
};

template <>
struct Q8Fmt<Q4_K> {
  static constexpr int QK = 256, BYTES = 144;
  static constexpr bool SIGNED = false;
  template <class Emit>
  static inline void decode(const uint8_t* b, Emit&& emit) {
    float ds[8], dm[8];
    k_scales(b, ds, dm);
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int c = 0; c < 4; ++c) {
      __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + 32 * c));
      emit(2 * c, _mm256_and_si256(v, m4), ds[2 * c], ds[2 * c], -dm[2 * c], -dm[2 * c]);
      emit(2 * c + 1, _mm256_and_si256(_mm256_srli_epi16(v, 4), m4), ds[2 * c + 1], ds[2 * c + 1], -dm[2 * c + 1],
           -dm[2 * c + 1]);
    }
  }
};

template <>
struct Q8Fmt<Q5_K> {
  static constexpr int QK = 256, BYTES = 176;
  static constexpr bool SIGNED = false;
  template <class Emit>
  static inline void decode(const uint8_t* b, Emit&& emit) {
    float ds[8], dm[8];
    k_scales(b, ds, dm);
    const __m256i m4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    const __m256i hv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
    for (int c = 0; c < 4; ++c) {
      __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 48 + 32 * c));
      for (int h = 0; h < 2; ++h) {
        const int j = 2 * c + h;
        __m256i nib = h == 0 ? _mm256_and_si256(v, m4) : _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        __m256i hb = _mm256_and_si256(_mm256_srl_epi16(hv, _mm_cvtsi32_si128(j)), one);
        emit(j, _mm256_or_si256(nib, _mm256_slli_epi16(hb, 4)), ds[j], ds[j], -dm[j], -dm[j]);
      }
    }
  }
};

template <>
struct Q8Fmt<Q6_K> {
  static constexpr int QK = 256, BYTES = 210;
  static constexpr bool SIGNED = false;
  template <class Emit>
  static inline void decode(const uint8_t* b, Emit&& emit) {
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = f16(b + 208);
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(3);
    for (int half = 0; half < 2; ++half) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * half));
      for (int i = 0; i < 4; ++i) {
        __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * half + 32 * (i % 2)));
        l = i < 2 ? _mm256_and_si256(l, m4) : _mm256_and_si256(_mm256_srli_epi16(l, 4), m4);
        __m256i hi = _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(2 * i)), m2);
        const int sub = 8 * half + 2 * i;
        const float a0 = d * static_cast<float>(sc[sub]), a1 = d * static_cast<float>(sc[sub + 1]);
        emit(4 * half + i, _mm256_or_si256(l, _mm256_slli_epi16(hi, 4)), a0, a1, -32.0f * a0, -32.0f * a1);
      }
    }
  }
};

// Calls f(QT<QTYPE>{}) for a format with an integer path; false for the float-only ones (F32/F16/BF16).
template <class F>
inline bool dispatch_q8(int64_t qtype, F&& f) {
  switch (qtype) {
    case Q8_0: f(QT<Q8_0>{}); return true;
    case Q4_0: f(QT<Q4_0>{}); return true;
    case Q4_1: f(QT<Q4_1>{}); return true;
    case Q4_K: f(QT<Q4_K>{}); return true;
    case Q5_K: f(QT<Q5_K>{}); return true;
    case Q6_K: f(QT<Q6_K>{}); return true;
    default: return false;
  }
}

}  // namespace troupe_quant
