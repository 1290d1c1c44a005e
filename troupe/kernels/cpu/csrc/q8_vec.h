// The integer vector type of the gguf-q8 GEMM (q8_gemm.h), one per build: AVX-512 (BW) with 16 int32
// lanes, else AVX2 with 8. Loads, broadcasts, integer dot-product steps (`vpdpbusd` where the build has
// VNNI: G_VNNI; `vpmaddubsw` / `vpmaddwd` otherwise), int32 -> float32, masked stores, the 4-byte
// transposes that interleave weight rows, and a gather of per-row f16 scale pairs.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace troupe_quant {

#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int GL = 16;  // int32 lanes = weight rows per group
using GI = __m512i;
using GF = __m512;
inline GI g_load(const uint8_t* p) { return _mm512_load_si512(p); }
inline GI g_bcast(int32_t v) { return _mm512_set1_epi32(v); }
inline GF g_loadf(const float* p) { return _mm512_load_ps(p); }
inline GF g_cvt(GI v) { return _mm512_cvtepi32_ps(v); }
inline GF g_fma(GF a, GF b, GF c) { return _mm512_fmadd_ps(a, b, c); }
inline GF g_mul(GF a, GF b) { return _mm512_mul_ps(a, b); }
inline GF g_addf(GF a, GF b) { return _mm512_add_ps(a, b); }
inline GF g_set1(float v) { return _mm512_set1_ps(v); }
inline GF g_zerof() { return _mm512_setzero_ps(); }
inline GI g_zeroi() { return _mm512_setzero_si512(); }
inline GI g_maddubs(GI u, GI q) { return _mm512_maddubs_epi16(u, q); }
inline GI g_add16(GI a, GI b) { return _mm512_adds_epi16(a, b); }  // saturating: see the AVX2 one
inline GI g_add32(GI a, GI b) { return _mm512_add_epi32(a, b); }
inline GI g_madd1(GI a) { return _mm512_madd_epi16(a, _mm512_set1_epi16(1)); }
#if defined(__AVX512VNNI__)
constexpr bool G_VNNI = true;
inline GI g_dpbusd(GI acc, GI u, GI q) { return _mm512_dpbusd_epi32(acc, u, q); }
#else
constexpr bool G_VNNI = false;
inline GI g_dpbusd(GI acc, GI, GI) { return acc; }  // unused
#endif
inline void g_store(float* p, GF v, int n) {
  if (n == GL) {
    _mm512_storeu_ps(p, v);
  } else {
    _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1), v);
  }
}
inline GF g_loadu_n(const float* p, int n) {
  return n == GL ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p);
}
// 16 bytes at p + i * stride for i = j, j + 4, j + 8, j + 12 (the 128-bit lanes): the packed nibbles of 4 rows
inline GI g_rows4(const uint8_t* p, int64_t stride, int j) {
  GI v = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + j * stride)));
  v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + (j + 4) * stride)), 1);
  v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + (j + 8) * stride)), 2);
  return _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + (j + 12) * stride)), 3);
}
inline GI g_and(GI a, GI b) { return _mm512_and_si512(a, b); }
inline GI g_xor(GI a, GI b) { return _mm512_xor_si512(a, b); }
inline GI g_srli16(GI a, int n) { return _mm512_srli_epi16(a, n); }
inline GI g_set1_8(char v) { return _mm512_set1_epi8(v); }
inline GI g_unpacklo32(GI a, GI b) { return _mm512_unpacklo_epi32(a, b); }
inline GI g_unpackhi32(GI a, GI b) { return _mm512_unpackhi_epi32(a, b); }
inline GI g_unpacklo64(GI a, GI b) { return _mm512_unpacklo_epi64(a, b); }
inline GI g_unpackhi64(GI a, GI b) { return _mm512_unpackhi_epi64(a, b); }
inline void g_store_i(uint8_t* p, GI v) { _mm512_store_si512(p, v); }
// the f16 pairs at p + r * stride, r < 16 (one dword each): (low halves, high halves) as float32
inline void g_f16_pairs(const uint8_t* p, int64_t stride, float* lo, float* hi) {
  const GI idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                    _mm512_set1_epi32(static_cast<int32_t>(stride)));
  const GI v = _mm512_i32gather_epi32(idx, p, 1);
  _mm512_store_ps(lo, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v)));
  _mm512_store_ps(hi, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(v, 16))));
}
// rows r (ymm of 32 bytes = 8 dwords each, 16 rows) -> out[k4]: dword k4 of rows 0..15
inline void g_transpose(const __m256i* r, GI* out) {
  GI v[8], t[8];
  for (int i = 0; i < 8; ++i) v[i] = _mm512_inserti64x4(_mm512_castsi256_si512(r[i]), r[i + 8], 1);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm512_unpacklo_epi32(v[i], v[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(v[i], v[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    v[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    v[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    v[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    v[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  const GI lo = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13), hi = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
  for (int i = 0; i < 4; ++i) {
    out[i] = _mm512_permutex2var_epi64(v[i], lo, v[i + 4]);
    out[i + 4] = _mm512_permutex2var_epi64(v[i], hi, v[i + 4]);
  }
}
#else
constexpr int GL = 8;
using GI = __m256i;
using GF = __m256;
inline GI g_load(const uint8_t* p) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(p)); }
inline GI g_bcast(int32_t v) { return _mm256_set1_epi32(v); }
inline GF g_loadf(const float* p) { return _mm256_load_ps(p); }
inline GF g_cvt(GI v) { return _mm256_cvtepi32_ps(v); }
inline GF g_fma(GF a, GF b, GF c) { return _mm256_fmadd_ps(a, b, c); }
inline GF g_mul(GF a, GF b) { return _mm256_mul_ps(a, b); }
inline GF g_addf(GF a, GF b) { return _mm256_add_ps(a, b); }
inline GF g_set1(float v) { return _mm256_set1_ps(v); }
inline GF g_zerof() { return _mm256_setzero_ps(); }
inline GI g_zeroi() { return _mm256_setzero_si256(); }
inline GI g_maddubs(GI u, GI q) { return _mm256_maddubs_epi16(u, q); }
// Saturating adds of the int16 pair sums: exact, since the GEMM sums only as many steps as cannot overflow
// (q8_gemm.h's STEP), but unlike plain adds not reassociable, so GCC keeps the sums a chain per row instead
// of a tree of all the steps' products first, whose extra live registers spilled the float accumulators
// to the stack (docs/kernels.md).
inline GI g_add16(GI a, GI b) { return _mm256_adds_epi16(a, b); }
inline GI g_add32(GI a, GI b) { return _mm256_add_epi32(a, b); }
inline GI g_madd1(GI a) { return _mm256_madd_epi16(a, _mm256_set1_epi16(1)); }
#if defined(__AVXVNNI__)
constexpr bool G_VNNI = true;
inline GI g_dpbusd(GI acc, GI u, GI q) { return _mm256_dpbusd_avx_epi32(acc, u, q); }
#else
constexpr bool G_VNNI = false;
inline GI g_dpbusd(GI acc, GI, GI) { return acc; }  // unused
#endif
inline void g_store(float* p, GF v, int n) {
  if (n == GL) {
    _mm256_storeu_ps(p, v);
  } else {
    alignas(32) float t[8];
    _mm256_store_ps(t, v);
    std::memcpy(p, t, sizeof(float) * n);
  }
}
inline GF g_loadu_n(const float* p, int n) {
  if (n == GL) return _mm256_loadu_ps(p);
  alignas(32) float t[8] = {};
  std::memcpy(t, p, sizeof(float) * n);
  return _mm256_load_ps(t);
}
inline GI g_rows4(const uint8_t* p, int64_t stride, int j) {  // rows j, j + 4
  return _mm256_set_m128i(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + (j + 4) * stride)),
                          _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + j * stride)));
}
inline GI g_and(GI a, GI b) { return _mm256_and_si256(a, b); }
inline GI g_xor(GI a, GI b) { return _mm256_xor_si256(a, b); }
inline GI g_srli16(GI a, int n) { return _mm256_srli_epi16(a, n); }
inline GI g_set1_8(char v) { return _mm256_set1_epi8(v); }
inline GI g_unpacklo32(GI a, GI b) { return _mm256_unpacklo_epi32(a, b); }
inline GI g_unpackhi32(GI a, GI b) { return _mm256_unpackhi_epi32(a, b); }
inline GI g_unpacklo64(GI a, GI b) { return _mm256_unpacklo_epi64(a, b); }
inline GI g_unpackhi64(GI a, GI b) { return _mm256_unpackhi_epi64(a, b); }
inline void g_store_i(uint8_t* p, GI v) { _mm256_store_si256(reinterpret_cast<__m256i*>(p), v); }
inline void g_f16_pairs(const uint8_t* p, int64_t stride, float* lo, float* hi) {
  const GI idx = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(static_cast<int32_t>(stride)));
  const GI v = _mm256_i32gather_epi32(reinterpret_cast<const int*>(p), idx, 1);
  const GI pack = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1, 0, 1, 4, 5, 8, 9, 12, 13, -1,
                                   -1, -1, -1, -1, -1, -1, -1);
  const GI l = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(v, pack), 0x08);
  const GI h = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(_mm256_srli_epi32(v, 16), pack), 0x08);
  _mm256_store_ps(lo, _mm256_cvtph_ps(_mm256_castsi256_si128(l)));
  _mm256_store_ps(hi, _mm256_cvtph_ps(_mm256_castsi256_si128(h)));
}
inline void g_transpose(const __m256i* r, GI* out) {  // 8 rows x 8 dwords
  GI t[8], v[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    v[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
    v[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
    v[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
    v[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    out[i] = _mm256_permute2x128_si256(v[i], v[i + 4], 0x20);
    out[i + 4] = _mm256_permute2x128_si256(v[i], v[i + 4], 0x31);
  }
}
#endif

}  // namespace troupe_quant
