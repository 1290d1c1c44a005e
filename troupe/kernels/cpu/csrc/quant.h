// GGUF block formats decoded to float32 vectors (AVX-512 or AVX2/FMA/F16C, chosen at compile time).
//
// Each format is a `Fmt<QTYPE>` with QK (values per block), BYTES (bytes per block) and
//   template <class Emit> static void decode(const uint8_t* block, Emit&& emit)
// which calls `emit(c, w)` for each 32-value chunk c (0 <= c < QK / 32) of the block, in order, with
// `w[NV]` the chunk's 32 values as NV float vectors of W lanes. The values are bit for bit those of the
// torch reference (troupe/kernels/quant.py, = gguf.quants.dequantize): the same float32 multiply and add
// in the same order, never fused into an FMA (the including file turns fp-contract off for that).
// Layouts: troupe/kernels/quant.py's module docstring.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace troupe_quant {

enum QType : int64_t { F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, BF16 = 30 };

#if defined(__AVX512F__)
using Vf = __m512;
using Vi = __m512i;
constexpr int W = 16;
inline Vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, Vf v) { _mm512_storeu_ps(p, v); }
inline Vf vfma(Vf a, Vf b, Vf c) { return _mm512_fmadd_ps(a, b, c); }
inline Vf vmul(Vf a, Vf b) { return _mm512_mul_ps(a, b); }
inline Vf vadd(Vf a, Vf b) { return _mm512_add_ps(a, b); }
inline Vf vsub(Vf a, Vf b) { return _mm512_sub_ps(a, b); }
inline Vf vset1(float x) { return _mm512_set1_ps(x); }
inline Vf vzero() { return _mm512_setzero_ps(); }
inline float vsum(Vf v) { return _mm512_reduce_add_ps(v); }
#else
using Vf = __m256;
using Vi = __m256i;
constexpr int W = 8;
inline Vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, Vf v) { _mm256_storeu_ps(p, v); }
inline Vf vfma(Vf a, Vf b, Vf c) { return _mm256_fmadd_ps(a, b, c); }
inline Vf vmul(Vf a, Vf b) { return _mm256_mul_ps(a, b); }
inline Vf vadd(Vf a, Vf b) { return _mm256_add_ps(a, b); }
inline Vf vsub(Vf a, Vf b) { return _mm256_sub_ps(a, b); }
inline Vf vset1(float x) { return _mm256_set1_ps(x); }
inline Vf vzero() { return _mm256_setzero_ps(); }
inline float vsum(Vf v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif
constexpr int NV = 32 / W;  // vectors per 32-value chunk

// f16 -> float32 for block scales: a table of all 65536 values (256 KiB; a model's scales touch few of its
// lines). A lookup is a plain load, which a broadcast then takes from memory: no conversion or shuffle
// uops on the vector ports the decoders are busy with (vcvtph2ps + a register broadcast cost two).
struct F16Table {
  float v[65536];
  F16Table() {
    for (int i = 0; i < 65536; ++i) v[i] = _cvtsh_ss(static_cast<unsigned short>(i));
  }
};
inline const F16Table f16_table;

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return f16_table.v[h];
}

#if defined(__AVX512F__)
// 16 floats: table[i] for i = the low 4 bits of each 32-bit lane of idx
inline Vf lookup16(Vi idx, Vf table) { return _mm512_permutexvar_ps(idx, table); }
inline Vi u8x16(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline Vf iota16(float offset) {
  return _mm512_add_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_ps(offset));
}
#else
// 8 int32 lanes from the bytes p[0..8)
inline Vi u8x8(const __m128i bytes) { return _mm256_cvtepu8_epi32(bytes); }
// the 32 unsigned bytes of v as 4 vectors of 8 floats
inline void u8x32_to_f32(__m256i v, Vf out[4]) {
  __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
  out[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
  out[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
  out[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
  out[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}
inline void i8x32_to_f32(__m256i v, Vf out[4]) {
  __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
  out[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
  out[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
  out[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
  out[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
}
// 16 packed bytes -> 32 bytes: the 16 low nibbles, then the 16 high ones
inline __m256i nibbles32(const uint8_t* p) {
  __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  __m128i m = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m), _mm_and_si128(q, m));
}
#endif

template <int QTYPE>
struct Fmt;

template <>
struct Fmt<F32> {
  static constexpr int QK = 32, BYTES = 128;
  template <class Emit>
  static inline void decode(const uint8_t* b, Emit&& emit) {
    Vf w[NV];
    for (int j = 0; j < NV; ++j) w[j] = vload(reinterpret_cast<const float*>(b) + j * W);
    emit(0, w);
  }
};

template <>
struct Fmt<F16> {
  static constexpr int QK = 32, BYTES = 64;
  template <class Emit>
  static inline void decode(const uint8_t* b, Emit&& emit) {
    Vf w[NV];
#if defined(__AVX512F__)
    for (int j = 0; j < NV; ++j) w[j] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32 * j)));
#else
    for (int j = 0; j < NV; ++j) w[j] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 * j)));
#endif
    emit(0, w);
  }
};

template <>
struct Fmt<BF16> {
  static constexpr int QK = 32, BYTES = 64;
  template <class Emit>
  static inline void decode(const uint8_t* b, Emit&& emit) {
    Vf w[NV];
#if defined(__AVX512F__)
    for (int j = 0; j < NV; ++j) {
      __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32 * j)));
      w[j] = _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
    }
#else
    for (int j = 0; j < NV; ++j) {
      __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 * j)));
      w[j] = _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
    }
#endif
    emit(0, w);
  }
};

template <>
struct Fmt<Q8_0> {  // d: f16, q: int8[32]; w = q * d
  static constexpr int QK = 32, BYTES = 34;
  template <class Emit>
  static inline void decode(const uint8_t* b, Emit&& emit) {
    Vf d = vset1(f16(b)), w[NV];
#if defined(__AVX512F__)
    for (int j = 0; j < NV; ++j)
      w[j] = vmul(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2 + 16 * j)))), d);
#else
    i8x32_to_f32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2)), w);
    for (int j = 0; j < NV; ++j) w[j] = vmul(w[j], d);
#endif
    emit(0, w);
  }
};

template <>
struct Fmt<Q4_0> {  // d: f16, q: u8[16]; w = d * (nibble - 8)
  static constexpr int QK = 32, BYTES = 18;
  template <class Emit>
  static inline void decode(const uint8_t* b, Emit&& emit) {
    Vf w[NV];
#if defined(__AVX512F__)
    Vf table = vmul(vset1(f16(b)), iota16(-8.0f));
    Vi u = u8x16(b + 2);
    w[0] = lookup16(u, table);
    w[1] = lookup16(_mm512_srli_epi32(u, 4), table);
#else
    Vf d = vset1(f16(b)), eight = vset1(8.0f);
    u8x32_to_f32(nibbles32(b + 2), w);
    for (int j = 0; j < NV; ++j) w[j] = vmul(d, vsub(w[j], eight));
#endif
    emit(0, w);
  }
};

template <>
struct Fmt<Q4_1> {  // d, m: f16, q: u8[16]; w = d * nibble + m
  static constexpr int QK = 32, BYTES = 20;
  template <class Emit>
  static inline void decode(const uint8_t* b, Emit&& emit) {
    Vf w[NV];
#if defined(__AVX512F__)
    Vf table = vadd(vmul(vset1(f16(b)), iota16(0.0f)), vset1(f16(b + 2)));
    Vi u = u8x16(b + 4);
    w[0] = lookup16(u, table);
    w[1] = lookup16(_mm512_srli_epi32(u, 4), table);
#else
    Vf d = vset1(f16(b)), m = vset1(f16(b + 2));
    u8x32_to_f32(nibbles32(b + 4), w);
    for (int j = 0; j < NV; ++j) w[j] = vadd(vmul(d, w[j]), m);
#endif
    emit(0, w);
  }
};

// Q4_K / Q5_K: the 8 sub-blocks' (d * scale, dmin * min) from the 12 packed scale bytes. The 6-bit fields are
// unpacked four at a time in 32-bit words (scale j < 4: byte j's low 6 bits; j >= 4: byte j + 4's low nibble
// and byte j - 4's top 2 bits; the mins likewise from bytes 4..11) and converted and scaled as one vector of
// 8: the same float32 products as one at a time, without 16 scalar int-to-float conversions per block.
__attribute__((always_inline)) inline void k_scales(const uint8_t* b, float ds[8], float dm[8]) {
  uint32_t a, bb, c;
  std::memcpy(&a, b + 4, 4);
  std::memcpy(&bb, b + 8, 4);
  std::memcpy(&c, b + 12, 4);
  const uint32_t sc_lo = a & 0x3F3F3F3Fu, mn_lo = bb & 0x3F3F3F3Fu;
  const uint32_t sc_hi = (c & 0x0F0F0F0Fu) | ((a >> 2) & 0x30303030u);
  const uint32_t mn_hi = ((c >> 4) & 0x0F0F0F0Fu) | ((bb >> 2) & 0x30303030u);
  const __m128i sc = _mm_set_epi32(0, 0, static_cast<int>(sc_hi), static_cast<int>(sc_lo));
  const __m128i mn = _mm_set_epi32(0, 0, static_cast<int>(mn_hi), static_cast<int>(mn_lo));
  _mm256_storeu_ps(ds, _mm256_mul_ps(_mm256_set1_ps(f16(b)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sc))));
  _mm256_storeu_ps(dm, _mm256_mul_ps(_mm256_set1_ps(f16(b + 2)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mn))));
  // The decoders take each of the 16 as a broadcast. Kept in registers, each costs a shuffle and a register
  // broadcast on the port the table lookups need; read back from memory, a broadcast is a plain load (or an
  // operand of the multiply). The empty asm makes the compiler read them back (1.4x at M = 1 on a Xeon).
  asm volatile("" : : "r"(ds), "r"(dm) : "memory");
}

template <>
struct Fmt<Q4_K> {  // d, dmin, scales[12], q[128]; w = (d * sc) * nibble - dmin * mn
  static constexpr int QK = 256, BYTES = 144;
  template <class Emit>
  static inline void decode(const uint8_t* b, Emit&& emit) {
    float ds[8], dm[8];
    k_scales(b, ds, dm);
    const uint8_t* q = b + 16;
    Vf w[NV];
#if defined(__AVX512F__)
    const Vf iota = iota16(0.0f);
    for (int c = 0; c < 4; ++c) {
      Vi u0 = u8x16(q + 32 * c), u1 = u8x16(q + 32 * c + 16);
      Vf lo = vsub(vmul(vset1(ds[2 * c]), iota), vset1(dm[2 * c]));
      w[0] = lookup16(u0, lo);
      w[1] = lookup16(u1, lo);
      emit(2 * c, w);
      Vf hi = vsub(vmul(vset1(ds[2 * c + 1]), iota), vset1(dm[2 * c + 1]));
      w[0] = lookup16(_mm512_srli_epi32(u0, 4), hi);
      w[1] = lookup16(_mm512_srli_epi32(u1, 4), hi);
      emit(2 * c + 1, w);
    }
#else
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int c = 0; c < 4; ++c) {
      __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * c));
      for (int h = 0; h < 2; ++h) {
        __m256i nib = h == 0 ? _mm256_and_si256(v, m4) : _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        u8x32_to_f32(nib, w);
        Vf s = vset1(ds[2 * c + h]), mn = vset1(dm[2 * c + h]);
        for (int j = 0; j < NV; ++j) w[j] = vsub(vmul(s, w[j]), mn);
        emit(2 * c + h, w);
      }
    }
#endif
  }
};

template <>
struct Fmt<Q5_K> {  // Q4_K plus qh[32]: bit j of qh[l] is bit 4 of value l of sub-block j
  static constexpr int QK = 256, BYTES = 176;
  template <class Emit>
  static inline void decode(const uint8_t* b, Emit&& emit) {
    float ds[8], dm[8];
    k_scales(b, ds, dm);
    const uint8_t* qh = b + 16;
    const uint8_t* q = b + 48;
    Vf w[NV];
#if defined(__AVX512F__)
    const Vf iota_lo = iota16(0.0f), iota_hi = iota16(16.0f);
    const Vi h0 = _mm512_slli_epi32(u8x16(qh), 4), h1 = _mm512_slli_epi32(u8x16(qh + 16), 4);
    const Vi m4 = _mm512_set1_epi32(15), bit4 = _mm512_set1_epi32(16);
    for (int c = 0; c < 4; ++c) {
      Vi u0 = u8x16(q + 32 * c), u1 = u8x16(q + 32 * c + 16);
      for (int h = 0; h < 2; ++h) {
        const int j = 2 * c + h;
        Vf s = vset1(ds[j]), mn = vset1(dm[j]);
        Vf t_lo = vsub(vmul(s, iota_lo), mn), t_hi = vsub(vmul(s, iota_hi), mn);
        Vi n0 = h == 0 ? _mm512_and_si512(u0, m4) : _mm512_srli_epi32(u0, 4);
        Vi n1 = h == 0 ? _mm512_and_si512(u1, m4) : _mm512_srli_epi32(u1, 4);
        Vi i0 = _mm512_or_si512(n0, _mm512_and_si512(_mm512_srli_epi32(h0, j), bit4));
        Vi i1 = _mm512_or_si512(n1, _mm512_and_si512(_mm512_srli_epi32(h1, j), bit4));
        w[0] = _mm512_permutex2var_ps(t_lo, i0, t_hi);
        w[1] = _mm512_permutex2var_ps(t_lo, i1, t_hi);
        emit(j, w);
      }
    }
#else
    const __m256i m4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    const __m256i hv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh));
    for (int c = 0; c < 4; ++c) {
      __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * c));
      for (int h = 0; h < 2; ++h) {
        const int j = 2 * c + h;
        __m256i nib = h == 0 ? _mm256_and_si256(v, m4) : _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        __m256i hb = _mm256_and_si256(_mm256_srl_epi16(hv, _mm_cvtsi32_si128(j)), one);
        u8x32_to_f32(_mm256_or_si256(nib, _mm256_slli_epi16(hb, 4)), w);
        Vf s = vset1(ds[j]), mn = vset1(dm[j]);
        for (int k = 0; k < NV; ++k) w[k] = vsub(vmul(s, w[k]), mn);
        emit(j, w);
      }
    }
#endif
  }
};

#if defined(__AVX512F__)
// Q6_K: d * scale for the block's 16 sub-blocks of 16 values, one vector (the same float32 products as one at
// a time); quant.h's decoder and the 16-bit rows path (rows_i16.h) take it
inline __m512 q6k_scales(const uint8_t* b) {
  return _mm512_mul_ps(_mm512_set1_ps(f16(b + 208)),
                       _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)))));
}
#endif

template <>
struct Fmt<Q6_K> {  // ql[128], qh[64], scales: int8[16], d: f16; w = (d * scale) * (q - 32)
  static constexpr int QK = 256, BYTES = 210;
  template <class Emit>
  static inline void decode(const uint8_t* b, Emit&& emit) {
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    // d * scale for the 16 sub-blocks of 16 values: the same float32 products, as vectors, read back as
    // broadcasts (as k_scales does; 1.36x at M = 1 on a Xeon)
    alignas(64) float ds[16];
#if defined(__AVX512F__)
    _mm512_store_ps(ds, q6k_scales(b));
#else
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = f16(b + 208);
    for (int h = 0; h < 2; ++h)
      _mm256_store_ps(ds + 8 * h, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                                   _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + 8 * h))))));
#endif
    asm volatile("" : : "r"(ds) : "memory");
    Vf w[NV];
    for (int half = 0; half < 2; ++half) {
      for (int i = 0; i < 4; ++i) {  // values 32i .. 32i+31 of this half: chunk 4 * half + i
        const uint8_t* lo = ql + 64 * half + 32 * (i % 2);
        const uint8_t* hi = qh + 32 * half;
        const int sub = 8 * half + 2 * i;  // the scale of values 0..15 of the chunk (sub + 1: 16..31)
#if defined(__AVX512F__)
        for (int k = 0; k < 2; ++k) {
          Vi l = u8x16(lo + 16 * k);
          l = i < 2 ? _mm512_and_si512(l, _mm512_set1_epi32(15)) : _mm512_srli_epi32(l, 4);
          Vi h = _mm512_and_si512(_mm512_srli_epi32(u8x16(hi + 16 * k), 2 * i), _mm512_set1_epi32(3));
          Vi qv = _mm512_sub_epi32(_mm512_or_si512(l, _mm512_slli_epi32(h, 4)), _mm512_set1_epi32(32));
          w[k] = vmul(vset1(ds[sub + k]), _mm512_cvtepi32_ps(qv));
        }
#else
        const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(3);
        __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo));
        l = i < 2 ? _mm256_and_si256(l, m4) : _mm256_and_si256(_mm256_srli_epi16(l, 4), m4);
        __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi));
        h = _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(2 * i)), m2);
        __m256i qv = _mm256_sub_epi8(_mm256_or_si256(l, _mm256_slli_epi16(h, 4)), _mm256_set1_epi8(32));
        i8x32_to_f32(qv, w);
        Vf s0 = vset1(ds[sub]), s1 = vset1(ds[sub + 1]);
        w[0] = vmul(s0, w[0]);
        w[1] = vmul(s0, w[1]);
        w[2] = vmul(s1, w[2]);
        w[3] = vmul(s1, w[3]);
#endif
        emit(4 * half + i, w);
      }
    }
  }
};

template <int Q>
using QT = std::integral_constant<int, Q>;

// Calls f(QT<QTYPE>{}) for the runtime `qtype` (f's argument type names the format at compile time);
// false if the format is unknown.
template <class F>
inline bool dispatch(int64_t qtype, F&& f) {
  switch (qtype) {
    case F32: f(QT<F32>{}); return true;
    case F16: f(QT<F16>{}); return true;
    case BF16: f(QT<BF16>{}); return true;
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
