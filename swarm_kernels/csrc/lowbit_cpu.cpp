// swarm_kernels: the int4 and int2 codecs' CPU path (fused, multi-threaded over blocks).
//
// The specification is swarm_kernels/lowbit_reference.py; this file performs exactly its fp32
// operations (compiled, like int8_cpu.cpp and into the same library, with -ffp-contract=off and
// without -ffast-math). Blocks start on a byte (the block size is a multiple of the codes a
// byte), so threads that take different blocks never share a byte, and the bytes do not depend
// on the thread count.
//
// Codes are sign-magnitude: m | sign, with m the index of a grid magnitude G[m] (lowbit_reference.py
// INT4 / INT2). A block's values are fp32(G[m] * scale), so each block's table of kMags products
// is computed once and every element looks its value up (AVX2: one vpermps) and flips its sign.
//
// Returns (no exception crosses the C boundary):
//   swarm_lowbit_quantize:   -1 ok; the index of the first block holding |x| > 2**127 or NaN;
//                            -2 internal error; -3 bits is neither 4 nor 2.
//   swarm_lowbit_dequantize*: 0 ok; 1 scale *where is malformed; 2 code *where is "-0";
//                            3 the padding bits are not 0; -1 internal error; -3 bad bits.
// On an error nothing has been written to acc (the whole payload is checked first).

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define SWARM_X86_AVX2 1
#define SWARM_AVX2 __attribute__((target("avx2")))
#endif

namespace {

constexpr uint32_t kAbsMask = 0x7FFFFFFFu;
constexpr uint32_t kMaxAbsBits = 0x7F000000u;  // 2**127
constexpr uint32_t kTinyBits = 0x08800000u;    // 2**-110
constexpr int64_t kGrainElements = 1 << 16;    // at least this many elements per task

// The grids and their midpoints, fp32 bits (lowbit_reference.INT4 / INT2).
constexpr uint32_t kGrid4[8] = {0x0,        0x3D99CE07, 0x3E2A4A8C, 0x3E8C2F83,
                                0x3ECCF41F, 0x3F0D35A8, 0x3F3D9168, 0x3F800000};
constexpr uint32_t kThr4[7] = {0x3D19CE07, 0x3DF73190, 0x3E6154C9, 0x3EAC91D1, 0x3EF3AFB8, 0x3F256388, 0x3F5EC8B4};
constexpr uint32_t kGrid2[2] = {0x0, 0x3ECCCCCD};
constexpr uint32_t kThr2[1] = {0x3E4CCCCD};

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <int BITS>
struct Fmt {
  static_assert(BITS == 4 || BITS == 2, "int4 or int2");
  static constexpr int kPerByte = 8 / BITS;                 // codes a byte
  static constexpr int kMags = BITS == 4 ? 8 : 2;           // grid magnitudes, 0 included
  static constexpr uint32_t kSign = 1u << (BITS - 1);       // the sign bit of a code
  static constexpr uint32_t kMask = (1u << BITS) - 1;
  static float grid(int m) { return float_of(BITS == 4 ? kGrid4[m] : kGrid2[m]); }
  static float thr(int j) { return float_of(BITS == 4 ? kThr4[j] : kThr2[j]); }  // T[j + 1]
  // of 8 bytes of codes, the sign bit of each code whose other bits are all 0 ("-0"): the shifts
  // move a code's magnitude bits onto its sign bit and never across codes (SWAR, vectorises)
  static uint64_t minus_zero(uint64_t w) {
    if (BITS == 4) return w & 0x8888888888888888ull & ~((w << 1) | (w << 2) | (w << 3));
    return w & 0xAAAAAAAAAAAAAAAAull & ~(w << 1);
  }
};

// the same work split as int8_cpu.cpp: f(b0, b1) over blocks [0, nb), threads pull grains
template <class F>
void for_blocks(int64_t nb, int64_t block, const F& f) {
  const int64_t grain = std::max<int64_t>(1, kGrainElements / block);
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), (nb + grain - 1) / grain);
  at::parallel_for(0, std::max<int64_t>(workers, 1), 1, [&](int64_t, int64_t) {
    for (int64_t b0 = next.fetch_add(grain); b0 < nb; b0 = next.fetch_add(grain)) f(b0, std::min(nb, b0 + grain));
  });
}

inline void atomic_min(std::atomic<int64_t>& a, int64_t v) {
  int64_t cur = a.load(std::memory_order_relaxed);
  while (v < cur && !a.compare_exchange_weak(cur, v, std::memory_order_relaxed)) {
  }
}

bool detect_avx2() {
#ifdef SWARM_X86_AVX2
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2");
#else
  return false;
#endif
}

bool g_avx2 = detect_avx2();

struct F32 {
  using T = float;
  static inline uint32_t bits(const T* x, int64_t i) { return bits_of(x[i]); }
};
struct BF16 {
  using T = uint16_t;
  static inline uint32_t bits(const T* x, int64_t i) { return uint32_t(x[i]) << 16; }
};

// --- one block's pieces, portable (any CPU) ---------------------------------------------------

// rules 2-3: false (scale 0, codes 0) for a block under TINY or holding a bad value (the caller
// records the latter); else the scale and inv of rule 4
inline bool block_scale(uint32_t absmax_bits, float* scale, float* inv) {
  if (absmax_bits < kTinyBits || absmax_bits > kMaxAbsBits) {
    *scale = 0.0f;
    return false;
  }
  *scale = float_of(absmax_bits);
  *inv = 1.0f / *scale;
  return true;
}

template <class In>
uint32_t absmax_bits_scalar(const typename In::T* x, int64_t len) {
  uint32_t m = 0;
  for (int64_t i = 0; i < len; ++i) m = std::max(m, In::bits(x, i) & kAbsMask);
  return m;
}

template <int BITS>
inline uint32_t code_of(uint32_t xbits, float inv) {  // rule 4
  const float t = float_of(xbits & kAbsMask) * inv;
  uint32_t m = 0;
  for (int j = 0; j + 1 < Fmt<BITS>::kMags; ++j) m += t > Fmt<BITS>::thr(j) ? 1u : 0u;
  return m | ((xbits >> 31) != 0 && m != 0 ? Fmt<BITS>::kSign : 0u);
}

// the codes of x[e0, len) into out (the block's first byte); e0 is a multiple of k
template <int BITS, class In>
void codes_scalar(const typename In::T* x, int64_t e0, int64_t len, float inv, uint8_t* out) {
  constexpr int K = Fmt<BITS>::kPerByte;
  for (int64_t i = e0; i < len; i += K) {
    uint32_t byte = 0;
    for (int r = 0; r < K && i + r < len; ++r) byte |= code_of<BITS>(In::bits(x, i + r), inv) << (BITS * r);
    out[i / K] = uint8_t(byte);
  }
}

template <int BITS>
inline float value_of(uint32_t code, const float* table) {  // rule 5, table[m] = G[m] * scale
  const float v = table[code & (Fmt<BITS>::kSign - 1)];
  return (code & Fmt<BITS>::kSign) ? -v : v;
}

template <int BITS>
inline uint32_t code_at(const uint8_t* p, int64_t i) {
  constexpr int K = Fmt<BITS>::kPerByte;
  return (uint32_t(p[i / K]) >> (BITS * (i % K))) & Fmt<BITS>::kMask;
}

// elements [e0, len) of a block (codes from p, its first byte); ACC: acc += w * v, else out = v
template <int BITS, bool ACC>
void values_scalar(const uint8_t* p, int64_t e0, int64_t len, const float* table, float w, float* out) {
  for (int64_t i = e0; i < len; ++i) {
    const float v = value_of<BITS>(code_at<BITS>(p, i), table);
    out[i] = ACC ? out[i] + w * v : v;
  }
}

// --- the blocks [k0, k1) of a vector, portable -------------------------------------------------

template <int BITS, class In>
int64_t quantize_blocks_scalar(const typename In::T* x, int64_t n, int64_t block, int64_t k0, int64_t k1,
                               uint8_t* packed, float* scales) {
  constexpr int K = Fmt<BITS>::kPerByte;
  int64_t bad = -1;
  for (int64_t k = k0; k < k1; ++k) {
    const int64_t start = k * block, len = std::min(block, n - start);
    const uint32_t m = absmax_bits_scalar<In>(x + start, len);
    if (m > kMaxAbsBits && bad < 0) bad = k;
    float inv = 0.0f;
    if (block_scale(m, scales + k, &inv))
      codes_scalar<BITS, In>(x + start, 0, len, inv, packed + start / K);
    else
      std::memset(packed + start / K, 0, size_t((len + K - 1) / K));
  }
  return bad;
}

template <int BITS, bool ACC>
void values_blocks_scalar(const uint8_t* packed, const float* scales, int64_t n, int64_t block, int64_t k0,
                          int64_t k1, float w, float* out) {
  for (int64_t k = k0; k < k1; ++k) {
    const int64_t start = k * block, len = std::min(block, n - start);
    float table[Fmt<BITS>::kMags];
    for (int m = 0; m < Fmt<BITS>::kMags; ++m) table[m] = Fmt<BITS>::grid(m) * scales[k];
    values_scalar<BITS, ACC>(packed + start / Fmt<BITS>::kPerByte, 0, len, table, w, out + start);
  }
}

// --- the same, eight lanes at a time (AVX2) ------------------------------------------------------

#ifdef SWARM_X86_AVX2

SWARM_AVX2 inline __m256i load8_bits(const float* x) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)); }
SWARM_AVX2 inline __m256i load8_bits(const uint16_t* x) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
  return _mm256_slli_epi32(w, 16);
}

SWARM_AVX2 inline uint32_t hmax_epu31(__m256i m) {
  __m128i v = _mm_max_epi32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
  v = _mm_max_epi32(v, _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 0, 3, 2)));
  v = _mm_max_epi32(v, _mm_shuffle_epi32(v, _MM_SHUFFLE(2, 3, 0, 1)));
  return uint32_t(_mm_cvtsi128_si32(v));
}

// max of (bits & 0x7FFFFFFF): the integer order of non-negative fp32 is their order, and NaN / inf
// land above kMaxAbsBits, so one integer max finds absmax and catches them (as int8_cpu.cpp)
template <class In>
SWARM_AVX2 inline uint32_t absmax_bits_avx2(const typename In::T* x, int64_t len) {
  const __m256i mask = _mm256_set1_epi32(int(kAbsMask));
  __m256i m0 = _mm256_setzero_si256(), m1 = m0;
  int64_t i = 0;
  for (; i + 16 <= len; i += 16) {
    m0 = _mm256_max_epi32(m0, _mm256_and_si256(load8_bits(x + i), mask));
    m1 = _mm256_max_epi32(m1, _mm256_and_si256(load8_bits(x + i + 8), mask));
  }
  return std::max(hmax_epu31(_mm256_max_epi32(m0, m1)), absmax_bits_scalar<In>(x + i, len - i));
}

// The thresholds as an AVX2 code needs them: int2 its one threshold broadcast; int4 a binary
// search over its seven: T[4] broadcast, then (by the index found so far, vpermps) T[2] or T[6],
// then T[1], T[3], T[5] or T[7]. Either counts the thresholds below t, as the scalar loop does.
struct Thresholds {
  __m256 first, second, third;
};

template <int BITS>
SWARM_AVX2 inline Thresholds thresholds() {
  const float T1 = Fmt<BITS>::thr(0);  // T[1]
  if (BITS == 2) return {_mm256_set1_ps(T1), _mm256_setzero_ps(), _mm256_setzero_ps()};
  const float T2 = Fmt<BITS>::thr(1), T3 = Fmt<BITS>::thr(2), T4 = Fmt<BITS>::thr(3);
  const float T5 = Fmt<BITS>::thr(4), T6 = Fmt<BITS>::thr(5), T7 = Fmt<BITS>::thr(6);
  return {_mm256_set1_ps(T4), _mm256_setr_ps(T2, 0, 0, 0, T6, 0, 0, 0), _mm256_setr_ps(T1, 0, T3, 0, T5, 0, T7, 0)};
}

SWARM_AVX2 inline __m256i above(__m256 t, __m256 threshold) {  // t > T: all ones (-1) per lane
  return _mm256_castps_si256(_mm256_cmp_ps(t, threshold, _CMP_GT_OQ));
}

// eight codes (int32 lanes) of rule 4
template <int BITS, class In>
SWARM_AVX2 inline __m256i codes8(const typename In::T* x, __m256 inv, const Thresholds& thr) {
  const __m256i xb = load8_bits(x);
  const __m256 t = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_and_si256(xb, _mm256_set1_epi32(int(kAbsMask)))), inv);
  __m256i m;
  if (BITS == 2) {
    m = _mm256_sub_epi32(_mm256_setzero_si256(), above(t, thr.first));
  } else {
    m = _mm256_and_si256(above(t, thr.first), _mm256_set1_epi32(4));
    m = _mm256_or_si256(m, _mm256_and_si256(above(t, _mm256_permutevar8x32_ps(thr.second, m)), _mm256_set1_epi32(2)));
    m = _mm256_sub_epi32(m, above(t, _mm256_permutevar8x32_ps(thr.third, m)));
  }
  const __m256i sign = _mm256_and_si256(_mm256_srai_epi32(xb, 31), _mm256_set1_epi32(int(Fmt<BITS>::kSign)));
  return _mm256_or_si256(m, _mm256_andnot_si256(_mm256_cmpeq_epi32(m, _mm256_setzero_si256()), sign));
}

// 32 codes -> 32 / k bytes at out: the codes as 32 bytes in order, then each k of them summed
// into one byte with weights 1, 2**b, ... (maddubs, madd: the codes are small, so sums are ors)
template <int BITS>
SWARM_AVX2 inline void pack32(__m256i q0, __m256i q1, __m256i q2, __m256i q3, uint8_t* out) {
  const __m256i b = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(_mm256_packs_epi32(q0, q1), _mm256_packs_epi32(q2, q3)),
                                                _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  if (BITS == 4) {  // c0 + 16 c1 per 16-bit lane, then the 16 low bytes in order
    const __m256i r = _mm256_maddubs_epi16(b, _mm256_set1_epi16(0x1001));
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi16(r, r), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(packed));
  } else {  // c0 + 4 c1 per 16-bit lane, then + 16 (c2 + 4 c3) per 32-bit lane
    const __m256i r = _mm256_madd_epi16(_mm256_maddubs_epi16(b, _mm256_set1_epi16(0x0401)), _mm256_set1_epi32(0x00100001));
    const __m256i words = _mm256_packus_epi32(r, r);
    const __m256i bytes = _mm256_packus_epi16(words, words);  // each lane's first 4 bytes: its 4 sums
    const __m256i packed = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(packed));
  }
}

template <int BITS, class In>
SWARM_AVX2 int64_t quantize_blocks_avx2(const typename In::T* x, int64_t n, int64_t block, int64_t k0, int64_t k1,
                                        uint8_t* packed, float* scales) {
  constexpr int K = Fmt<BITS>::kPerByte;
  const Thresholds thr = thresholds<BITS>();
  int64_t bad = -1;
  for (int64_t k = k0; k < k1; ++k) {
    const int64_t start = k * block, len = std::min(block, n - start);
    const typename In::T* xs = x + start;
    uint8_t* out = packed + start / K;
    const uint32_t m = absmax_bits_avx2<In>(xs, len);  // pass 1: absmax (the block stays in L1)
    if (m > kMaxAbsBits && bad < 0) bad = k;
    float inv = 0.0f;
    if (!block_scale(m, scales + k, &inv)) {
      std::memset(out, 0, size_t((len + K - 1) / K));
      continue;
    }
    const __m256 vinv = _mm256_set1_ps(inv);
    int64_t i = 0;
    for (; i + 32 <= len; i += 32)  // pass 2: codes
      pack32<BITS>(codes8<BITS, In>(xs + i, vinv, thr), codes8<BITS, In>(xs + i + 8, vinv, thr),
                   codes8<BITS, In>(xs + i + 16, vinv, thr), codes8<BITS, In>(xs + i + 24, vinv, thr), out + i / K);
    codes_scalar<BITS, In>(xs, i, len, inv, out);
  }
  return bad;
}

// eight values from the 8 codes at p (one 32-bit word for int4, 16-bit for int2), shifted into
// lanes; vpermps looks up the block's table (its index is a lane's low 3 bits: int2's table
// repeats its two entries) and the code's sign bit moves to bit 31
template <int BITS>
SWARM_AVX2 inline __m256 values8(const uint8_t* p, __m256 table) {
  uint32_t word = 0;
  std::memcpy(&word, p, BITS);  // 8 codes of BITS bits: BITS bytes
  const __m256i shifts = _mm256_setr_epi32(0, BITS, 2 * BITS, 3 * BITS, 4 * BITS, 5 * BITS, 6 * BITS, 7 * BITS);
  const __m256i c = _mm256_srlv_epi32(_mm256_set1_epi32(int(word)), shifts);
  const __m256i sign = _mm256_and_si256(_mm256_slli_epi32(c, 32 - BITS), _mm256_set1_epi32(int(0x80000000u)));
  return _mm256_xor_ps(_mm256_permutevar8x32_ps(table, c), _mm256_castsi256_ps(sign));
}

template <int BITS, bool ACC>
SWARM_AVX2 void values_blocks_avx2(const uint8_t* packed, const float* scales, int64_t n, int64_t block, int64_t k0,
                                   int64_t k1, float w, float* out) {
  constexpr int K = Fmt<BITS>::kPerByte;
  alignas(32) float grid[8];
  for (int j = 0; j < 8; ++j) grid[j] = Fmt<BITS>::grid(j % Fmt<BITS>::kMags);
  const __m256 vgrid = _mm256_load_ps(grid), vw = _mm256_set1_ps(w);
  for (int64_t k = k0; k < k1; ++k) {
    const int64_t start = k * block, len = std::min(block, n - start);
    const uint8_t* p = packed + start / K;
    float* o = out + start;
    const __m256 table = _mm256_mul_ps(vgrid, _mm256_set1_ps(scales[k]));  // G[m] * scale, per lane
    int64_t i = 0;
    for (; i + 8 <= len; i += 8) {
      const __m256 v = values8<BITS>(p + i / K, table);
      _mm256_storeu_ps(o + i, ACC ? _mm256_add_ps(_mm256_loadu_ps(o + i), _mm256_mul_ps(vw, v)) : v);
    }
    if (i < len) {
      alignas(32) float t[8];
      _mm256_store_ps(t, table);
      values_scalar<BITS, ACC>(p, i, len, t, w, o);
    }
  }
}

#endif  // SWARM_X86_AVX2

// --- dispatch, by ranges of blocks ---------------------------------------------------------------

template <int BITS, class In>
int64_t quantize_blocks(const typename In::T* x, int64_t n, int64_t block, int64_t k0, int64_t k1, uint8_t* packed,
                        float* scales) {
#ifdef SWARM_X86_AVX2
  if (g_avx2) return quantize_blocks_avx2<BITS, In>(x, n, block, k0, k1, packed, scales);
#endif
  return quantize_blocks_scalar<BITS, In>(x, n, block, k0, k1, packed, scales);
}

template <int BITS, bool ACC>
void values_blocks(const uint8_t* packed, const float* scales, int64_t n, int64_t block, int64_t k0, int64_t k1,
                   float w, float* out) {
#ifdef SWARM_X86_AVX2
  if (g_avx2) return values_blocks_avx2<BITS, ACC>(packed, scales, n, block, k0, k1, w, out);
#endif
  values_blocks_scalar<BITS, ACC>(packed, scales, n, block, k0, k1, w, out);
}

// --- the entry points ------------------------------------------------------------------------

template <int BITS, class In>
int64_t quantize(const typename In::T* x, int64_t n, int64_t block, uint8_t* packed, float* scales) {
  std::atomic<int64_t> bad{std::numeric_limits<int64_t>::max()};
  for_blocks((n + block - 1) / block, block, [&](int64_t b0, int64_t b1) {
    const int64_t k = quantize_blocks<BITS, In>(x, n, block, b0, b1, packed, scales);
    if (k >= 0) atomic_min(bad, k);
  });
  const int64_t k = bad.load();
  return k == std::numeric_limits<int64_t>::max() ? -1 : k;
}

// the whole payload's check: 0 ok, else (status, where) as in the header
template <int BITS>
int check(const uint8_t* packed, const float* scales, int64_t n, int64_t block, int64_t* where) {
  constexpr int K = Fmt<BITS>::kPerByte;
  const int64_t nb = (n + block - 1) / block, nbytes = (n + K - 1) / K;
  for (int64_t k = 0; k < nb; ++k) {
    const uint32_t b = bits_of(scales[k]);
    if (b != 0 && (b < kTinyBits || b > kMaxAbsBits)) {
      *where = k;
      return 1;
    }
  }
  if (n % K != 0 && (packed[nbytes - 1] >> (BITS * (n % K))) != 0) {
    *where = n;
    return 3;
  }
  uint64_t any = 0;
  int64_t i = 0;
  for (; i + 8 <= nbytes; i += 8) {
    uint64_t w;
    std::memcpy(&w, packed + i, 8);
    any |= Fmt<BITS>::minus_zero(w);
  }
  for (; i < nbytes; ++i) any |= Fmt<BITS>::minus_zero(packed[i]);
  if (any == 0) return 0;
  for (i = 0; i < n; ++i)
    if (code_at<BITS>(packed, i) == Fmt<BITS>::kSign) {
      *where = i;
      return 2;
    }
  return -1;  // unreachable: a flagged byte holds a "-0" code
}

// dequantize (ACC false: out = v) or dequantize_accumulate (ACC: out += w * v), after the check:
// on a malformed payload nothing is written
template <int BITS, bool ACC>
int decode(const uint8_t* packed, const float* scales, int64_t n, int64_t block, float w, float* out, int64_t* where) {
  const int status = check<BITS>(packed, scales, n, block, where);
  if (status != 0) return status;
  for_blocks((n + block - 1) / block, block, [&](int64_t b0, int64_t b1) {
    values_blocks<BITS, ACC>(packed, scales, n, block, b0, b1, w, out);
  });
  return 0;
}

}  // namespace

#define SWARM_API extern "C" __attribute__((visibility("default")))

SWARM_API int swarm_lowbit_simd() { return g_avx2 ? 1 : 0; }

SWARM_API int swarm_lowbit_set_simd(int avx2) {  // tests only: not thread-safe
  g_avx2 = avx2 != 0 && detect_avx2();
  return g_avx2 ? 1 : 0;
}

SWARM_API int64_t swarm_lowbit_quantize(int bits, int bf16, const void* x, int64_t n, int64_t block, uint8_t* packed,
                                        float* scales) {
  try {
    const auto* f = static_cast<const float*>(x);
    const auto* h = static_cast<const uint16_t*>(x);
    if (bits == 4) return bf16 ? quantize<4, BF16>(h, n, block, packed, scales) : quantize<4, F32>(f, n, block, packed, scales);
    if (bits == 2) return bf16 ? quantize<2, BF16>(h, n, block, packed, scales) : quantize<2, F32>(f, n, block, packed, scales);
    return -3;
  } catch (...) {
    return -2;
  }
}

SWARM_API int swarm_lowbit_dequantize(int bits, const uint8_t* packed, const float* scales, int64_t n, int64_t block,
                                      float* out, int64_t* where) {
  try {
    if (bits == 4) return decode<4, false>(packed, scales, n, block, 1.0f, out, where);
    if (bits == 2) return decode<2, false>(packed, scales, n, block, 1.0f, out, where);
    return -3;
  } catch (...) {
    return -1;
  }
}

SWARM_API int swarm_lowbit_dequantize_accumulate(int bits, float* acc, const uint8_t* packed, const float* scales,
                                                 int64_t n, int64_t block, float w, int64_t* where) {
  try {
    if (bits == 4) return decode<4, true>(packed, scales, n, block, w, acc, where);
    if (bits == 2) return decode<2, true>(packed, scales, n, block, w, acc, where);
    return -3;
  } catch (...) {
    return -1;
  }
}
