// swarm_kernels: the int8 codec's CPU path (fused, multi-threaded over blocks).
//
// The specification is swarm_kernels/reference.py; this file performs exactly its fp32
// operations. It must be compiled with -ffp-contract=off and without -ffast-math: a fused
// multiply-add (or a reassociated sum) would change results. Blocks are independent, so the
// result does not depend on which thread computes which block (any thread count, same bytes).
//
// The entry points are plain C functions called through ctypes (which releases the GIL), with
// raw pointers that the wrapper in _cpu.py has checked (dtypes, lengths, contiguity,
// alignment). Not including pybind11 or torch/extension.h keeps the first build to seconds.
//
// Returns (no exception crosses the C boundary):
//   swarm_int8_quantize_*:  -1 ok, or the index of the first block holding |x| > 2**127 or NaN.
//   swarm_int8_dequantize*: 0 ok; 1 scale *where is malformed; 2 code *where is -128;
//                           -1 internal error.
// On an error, dequantize_accumulate has not written acc (the payload is checked first);
// quantize and dequantize may have written their (fresh) outputs.

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <exception>
#include <utility>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define SWARM_X86_AVX2 1
#define SWARM_AVX2 __attribute__((target("avx2")))
#endif

namespace {

constexpr uint32_t kAbsMask = 0x7FFFFFFFu;
constexpr uint32_t kMaxAbsBits = 0x7F000000u;    // 2**127
constexpr uint32_t kTinyBits = 0x08800000u;      // 2**-110
constexpr uint32_t kMinScaleBits = 0x00800000u;  // 2**-126, smallest normal
constexpr uint32_t kMaxScaleBits = 0x7B810204u;  // fp32(2**127 / 127)
constexpr float kQmax = 127.0f;
constexpr int64_t kGrainElements = 1 << 16;  // at least this many elements per task

using Result = std::pair<int, int64_t>;

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

inline float round_half_even(float t) {
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 10
  return __builtin_roundevenf(t);
#else
  return std::nearbyint(t);  // default rounding mode: to nearest, ties to even
#endif
}

inline int64_t grain_blocks(int64_t block) { return std::max<int64_t>(1, kGrainElements / block); }

// f(b0, b1) over the blocks [0, nb), on torch's intra-op threads. Each thread takes the next
// grain of blocks from a shared counter instead of a fixed half: on a busy machine (or beside
// training threads) a thread that is descheduled no longer holds back its share of the work.
// Blocks are independent, so who computes which block changes nothing in the result.
template <class F>
void for_blocks(int64_t nb, int64_t block, const F& f) {
  const int64_t grain = grain_blocks(block);
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
  __builtin_cpu_init();  // needed when called from a static initializer
  return __builtin_cpu_supports("avx2");
#else
  return false;
#endif
}

bool g_avx2 = detect_avx2();

// --- the two input types: fp32, and bf16 (widened exactly: its bits are fp32's top half) ----

struct F32 {
  using T = float;
  static inline uint32_t bits(const T* x, int64_t i) { return bits_of(x[i]); }
  static inline float load(const T* x, int64_t i) { return x[i]; }
};
struct BF16 {
  using T = uint16_t;
  static inline uint32_t bits(const T* x, int64_t i) { return uint32_t(x[i]) << 16; }
  static inline float load(const T* x, int64_t i) { return float_of(uint32_t(x[i]) << 16); }
};

// --- scalar reference loops (any CPU) -------------------------------------------------------

template <class In>
uint32_t absmax_bits_scalar(const typename In::T* x, int64_t len) {
  uint32_t m = 0;
  for (int64_t i = 0; i < len; ++i) m = std::max(m, In::bits(x, i) & kAbsMask);
  return m;
}

template <class In>
void codes_scalar(const typename In::T* x, int64_t len, float inv, int8_t* codes) {
  for (int64_t i = 0; i < len; ++i) codes[i] = int8_t(int32_t(round_half_even(In::load(x, i) * inv)));
}

void dequant_acc_scalar(const int8_t* c, int64_t len, float scale, float w, float* acc) {
  for (int64_t i = 0; i < len; ++i) {
    const float v = float(c[i]) * scale;
    acc[i] = acc[i] + w * v;
  }
}

bool dequant_scalar(const int8_t* c, int64_t len, float scale, float* out) {
  bool bad = false;
  for (int64_t i = 0; i < len; ++i) {
    bad |= c[i] == -128;
    out[i] = float(c[i]) * scale;
  }
  return bad;
}

bool has_code_min_scalar(const int8_t* c, int64_t len) {
  for (int64_t i = 0; i < len; ++i)
    if (c[i] == -128) return true;
  return false;
}

// --- AVX2 loops: the same operations, eight lanes at a time ----------------------------------

#ifdef SWARM_X86_AVX2

SWARM_AVX2 inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
SWARM_AVX2 inline __m256 load8(const uint16_t* x) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

SWARM_AVX2 inline uint32_t hmax_epu31(__m256i m) {
  __m128i v = _mm_max_epi32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
  v = _mm_max_epi32(v, _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 0, 3, 2)));
  v = _mm_max_epi32(v, _mm_shuffle_epi32(v, _MM_SHUFFLE(2, 3, 0, 1)));
  return uint32_t(_mm_cvtsi128_si32(v));
}

// max of (bits & 0x7FFFFFFF): for non-negative fp32 the integer order is the float order, and
// NaN / inf land above kMaxAbsBits, so one integer max finds absmax and catches them.
template <class In>
SWARM_AVX2 uint32_t absmax_bits_avx2(const typename In::T* x, int64_t len) {
  const __m256i mask = _mm256_set1_epi32(int(kAbsMask));
  __m256i m0 = _mm256_setzero_si256(), m1 = m0, m2 = m0, m3 = m0;
  int64_t i = 0;
  for (; i + 32 <= len; i += 32) {
    m0 = _mm256_max_epi32(m0, _mm256_and_si256(_mm256_castps_si256(load8(x + i)), mask));
    m1 = _mm256_max_epi32(m1, _mm256_and_si256(_mm256_castps_si256(load8(x + i + 8)), mask));
    m2 = _mm256_max_epi32(m2, _mm256_and_si256(_mm256_castps_si256(load8(x + i + 16)), mask));
    m3 = _mm256_max_epi32(m3, _mm256_and_si256(_mm256_castps_si256(load8(x + i + 24)), mask));
  }
  m0 = _mm256_max_epi32(_mm256_max_epi32(m0, m1), _mm256_max_epi32(m2, m3));
  return std::max(hmax_epu31(m0), absmax_bits_scalar<In>(x + i, len - i));
}

template <class In>
SWARM_AVX2 inline __m256i code8(const typename In::T* x, __m256 inv) {
  const __m256 t = _mm256_mul_ps(load8(x), inv);
  return _mm256_cvttps_epi32(_mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

template <class In>
SWARM_AVX2 void codes_avx2(const typename In::T* x, int64_t len, float inv, int8_t* codes) {
  const __m256 vinv = _mm256_set1_ps(inv);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  int64_t i = 0;
  for (; i + 32 <= len; i += 32) {
    const __m256i q0 = code8<In>(x + i, vinv), q1 = code8<In>(x + i + 8, vinv);
    const __m256i q2 = code8<In>(x + i + 16, vinv), q3 = code8<In>(x + i + 24, vinv);
    // packs work per 128-bit lane; the permute puts the eight 4-byte groups back in order.
    const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(q0, q1), _mm256_packs_epi32(q2, q3));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + i), _mm256_permutevar8x32_epi32(b, order));
  }
  codes_scalar<In>(x + i, len - i, inv, codes + i);
}

SWARM_AVX2 inline __m256 values8(__m128i c8, __m256 scale) {  // low 8 bytes of c8
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c8)), scale);
}

SWARM_AVX2 inline void acc8(float* acc, __m256 v, __m256 w) {
  _mm256_storeu_ps(acc, _mm256_add_ps(_mm256_loadu_ps(acc), _mm256_mul_ps(w, v)));
}

SWARM_AVX2 void dequant_acc_avx2(const int8_t* c, int64_t len, float scale, float w, float* acc) {
  const __m256 vs = _mm256_set1_ps(scale), vw = _mm256_set1_ps(w);
  int64_t i = 0;
  for (; i + 32 <= len; i += 32) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + i));
    const __m128i lo = _mm256_castsi256_si128(b), hi = _mm256_extracti128_si256(b, 1);
    acc8(acc + i, values8(lo, vs), vw);
    acc8(acc + i + 8, values8(_mm_srli_si128(lo, 8), vs), vw);
    acc8(acc + i + 16, values8(hi, vs), vw);
    acc8(acc + i + 24, values8(_mm_srli_si128(hi, 8), vs), vw);
  }
  dequant_acc_scalar(c + i, len - i, scale, w, acc + i);
}

SWARM_AVX2 bool dequant_avx2(const int8_t* c, int64_t len, float scale, float* out) {
  const __m256 vs = _mm256_set1_ps(scale);
  const __m256i m128 = _mm256_set1_epi8(-128);
  __m256i bad = _mm256_setzero_si256();
  int64_t i = 0;
  for (; i + 32 <= len; i += 32) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + i));
    bad = _mm256_or_si256(bad, _mm256_cmpeq_epi8(b, m128));
    const __m128i lo = _mm256_castsi256_si128(b), hi = _mm256_extracti128_si256(b, 1);
    _mm256_storeu_ps(out + i, values8(lo, vs));
    _mm256_storeu_ps(out + i + 8, values8(_mm_srli_si128(lo, 8), vs));
    _mm256_storeu_ps(out + i + 16, values8(hi, vs));
    _mm256_storeu_ps(out + i + 24, values8(_mm_srli_si128(hi, 8), vs));
  }
  const bool tail_bad = dequant_scalar(c + i, len - i, scale, out + i);
  return tail_bad || !_mm256_testz_si256(bad, bad);
}

SWARM_AVX2 bool has_code_min_avx2(const int8_t* c, int64_t len) {
  const __m256i m128 = _mm256_set1_epi8(-128);
  __m256i b0 = _mm256_setzero_si256(), b1 = b0;
  int64_t i = 0;
  for (; i + 64 <= len; i += 64) {
    b0 = _mm256_or_si256(b0, _mm256_cmpeq_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + i)), m128));
    b1 = _mm256_or_si256(b1,
                         _mm256_cmpeq_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + i + 32)), m128));
  }
  b0 = _mm256_or_si256(b0, b1);
  return !_mm256_testz_si256(b0, b0) || has_code_min_scalar(c + i, len - i);
}

// The audit sketch's runs: o[e] += s * double(x[e]) (and the same of int8 codes times their
// block's fp32 scale), four doubles a lane. The same operations per element as the scalar
// loops (no FMA: compiled with -ffp-contract=off), so the same sketch bit for bit. With Sq, the
// run's sum of squares (each square exact in double) is added to *sq: in another order than the
// scalar loop's, which the audit allows (it compares norms within a tolerance).
SWARM_AVX2 inline void sketch_add8(double* o, __m256 v, __m256d vs, __m256d& sq) {
  const __m256d a = _mm256_cvtps_pd(_mm256_castps256_ps128(v)), b = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
  _mm256_storeu_pd(o, _mm256_add_pd(_mm256_loadu_pd(o), _mm256_mul_pd(vs, a)));
  _mm256_storeu_pd(o + 4, _mm256_add_pd(_mm256_loadu_pd(o + 4), _mm256_mul_pd(vs, b)));
  sq = _mm256_add_pd(sq, _mm256_add_pd(_mm256_mul_pd(a, a), _mm256_mul_pd(b, b)));
}

SWARM_AVX2 inline double hsum(__m256d v) {
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, v);
  return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
}

SWARM_AVX2 void sketch_run_f32_avx2(double* o, const float* x, int64_t len, double s, double* sq) {
  const __m256d vs = _mm256_set1_pd(s);
  __m256d acc = _mm256_setzero_pd();
  int64_t e = 0;
  for (; e + 8 <= len; e += 8) sketch_add8(o + e, _mm256_loadu_ps(x + e), vs, acc);
  double tail = 0.0;
  for (; e < len; ++e) {
    const double v = static_cast<double>(x[e]);
    o[e] += s * v;
    tail += v * v;
  }
  if (sq != nullptr) *sq += hsum(acc) + tail;
}

SWARM_AVX2 void sketch_run_i8_avx2(double* o, const int8_t* c, int64_t len, float scale, double s, double* sq) {
  const __m256 vscale = _mm256_set1_ps(scale);
  const __m256d vs = _mm256_set1_pd(s);
  __m256d acc = _mm256_setzero_pd();
  int64_t e = 0;
  for (; e + 8 <= len; e += 8)
    sketch_add8(o + e, values8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + e)), vscale), vs, acc);
  double tail = 0.0;
  for (; e < len; ++e) {
    const double v = static_cast<double>(static_cast<float>(c[e]) * scale);
    o[e] += s * v;
    tail += v * v;
  }
  if (sq != nullptr) *sq += hsum(acc) + tail;
}

#endif  // SWARM_X86_AVX2

// --- dispatch between the two loop sets ------------------------------------------------------

template <class In>
uint32_t absmax_bits(const typename In::T* x, int64_t len) {
#ifdef SWARM_X86_AVX2
  if (g_avx2) return absmax_bits_avx2<In>(x, len);
#endif
  return absmax_bits_scalar<In>(x, len);
}

template <class In>
void block_codes(const typename In::T* x, int64_t len, float inv, int8_t* codes) {
#ifdef SWARM_X86_AVX2
  if (g_avx2) return codes_avx2<In>(x, len, inv, codes);
#endif
  codes_scalar<In>(x, len, inv, codes);
}

void block_dequant_acc(const int8_t* c, int64_t len, float scale, float w, float* acc) {
#ifdef SWARM_X86_AVX2
  if (g_avx2) return dequant_acc_avx2(c, len, scale, w, acc);
#endif
  dequant_acc_scalar(c, len, scale, w, acc);
}

bool block_dequant(const int8_t* c, int64_t len, float scale, float* out) {
#ifdef SWARM_X86_AVX2
  if (g_avx2) return dequant_avx2(c, len, scale, out);
#endif
  return dequant_scalar(c, len, scale, out);
}

void sketch_run_f32(double* o, const float* x, int64_t len, double s, double* sq) {
#ifdef SWARM_X86_AVX2
  if (g_avx2) return sketch_run_f32_avx2(o, x, len, s, sq);
#endif
  double squares = 0.0;
  for (int64_t e = 0; e < len; ++e) {
    const double v = static_cast<double>(x[e]);
    o[e] += s * v;
    squares += v * v;
  }
  if (sq != nullptr) *sq += squares;
}

void sketch_run_i8(double* o, const int8_t* c, int64_t len, float scale, double s, double* sq) {
#ifdef SWARM_X86_AVX2
  if (g_avx2) return sketch_run_i8_avx2(o, c, len, scale, s, sq);
#endif
  double squares = 0.0;
  for (int64_t e = 0; e < len; ++e) {
    const double v = static_cast<double>(static_cast<float>(c[e]) * scale);
    o[e] += s * v;
    squares += v * v;
  }
  if (sq != nullptr) *sq += squares;
}

bool block_has_code_min(const int8_t* c, int64_t len) {
#ifdef SWARM_X86_AVX2
  if (g_avx2) return has_code_min_avx2(c, len);
#endif
  return has_code_min_scalar(c, len);
}

inline bool scale_ok(float s) {
  const uint32_t b = bits_of(s);
  return b == 0 || (b >= kMinScaleBits && b <= kMaxScaleBits);
}

// --- the entry points ------------------------------------------------------------------------

template <class In>
int64_t quantize(const typename In::T* x, int64_t n, int64_t block, int8_t* codes, float* scales) {
  const int64_t nb = (n + block - 1) / block;
  std::atomic<int64_t> bad{std::numeric_limits<int64_t>::max()};
  for_blocks(nb, block, [&](int64_t b0, int64_t b1) {
    for (int64_t k = b0; k < b1; ++k) {
      const int64_t start = k * block, len = std::min(block, n - start);
      const uint32_t m = absmax_bits<In>(x + start, len);  // pass 1: absmax (block stays in L1)
      if (m > kMaxAbsBits) atomic_min(bad, k);
      if (m < kTinyBits || m > kMaxAbsBits) {
        scales[k] = 0.0f;
        std::memset(codes + start, 0, size_t(len));
        continue;
      }
      const float absmax = float_of(m);
      scales[k] = absmax / kQmax;
      block_codes<In>(x + start, len, kQmax / absmax, codes + start);  // pass 2: codes
    }
  });
  const int64_t k = bad.load();
  return k == std::numeric_limits<int64_t>::max() ? -1 : k;
}

Result first_bad_scale(const float* scales, int64_t nb) {
  for (int64_t k = 0; k < nb; ++k)
    if (!scale_ok(scales[k])) return {1, k};
  return {0, 0};
}

Result code_min_at(const int8_t* codes, int64_t n, int64_t block, int64_t k) {
  const int64_t start = k * block, end = std::min(n, start + block);
  for (int64_t i = start; i < end; ++i)
    if (codes[i] == -128) return {2, i};
  return {0, 0};  // unreachable: block k holds one
}

Result dequantize(const int8_t* codes, const float* scales, int64_t n, int64_t block, float* out) {
  const int64_t nb = (n + block - 1) / block;
  const Result r = first_bad_scale(scales, nb);
  if (r.first) return r;
  std::atomic<int64_t> bad{std::numeric_limits<int64_t>::max()};
  for_blocks(nb, block, [&](int64_t b0, int64_t b1) {
    for (int64_t k = b0; k < b1; ++k) {  // one pass: convert and look for -128 together
      const int64_t start = k * block, len = std::min(block, n - start);
      if (block_dequant(codes + start, len, scales[k], out + start)) atomic_min(bad, k);
    }
  });
  const int64_t k = bad.load();
  return k == std::numeric_limits<int64_t>::max() ? Result{0, 0} : code_min_at(codes, n, block, k);
}

Result dequantize_accumulate(float* acc, const int8_t* codes, const float* scales, int64_t n, int64_t block,
                             float w) {
  const int64_t nb = (n + block - 1) / block;
  const Result r = first_bad_scale(scales, nb);
  if (r.first) return r;
  // The whole payload is checked before acc is written, so a malformed sender leaves acc as it
  // was: one extra read of the codes (1 byte per element next to the 8 of acc). It runs in the
  // calling thread: a second parallel region (fork + join) cost more than it saved, measured on
  // a loaded 2-core machine with 1M-element chunks (0.9 vs 1.5 GB/s).
  if (block_has_code_min(codes, n)) return code_min_at(codes, n, n, 0);  // the first -128
  for_blocks(nb, block, [&](int64_t b0, int64_t b1) {
    for (int64_t k = b0; k < b1; ++k) {
      const int64_t start = k * block, len = std::min(block, n - start);
      block_dequant_acc(codes + start, len, scales[k], w, acc + start);
    }
  });
  return {0, 0};
}

int report(const Result& r, int64_t* where) {
  *where = r.second;
  return r.first;
}

}  // namespace

#define SWARM_API extern "C" __attribute__((visibility("default")))

SWARM_API int swarm_int8_simd() { return g_avx2 ? 1 : 0; }

SWARM_API int swarm_int8_set_simd(int avx2) {  // tests only: not thread-safe
  g_avx2 = avx2 != 0 && detect_avx2();
  return g_avx2 ? 1 : 0;
}

SWARM_API int64_t swarm_int8_quantize_f32(const float* x, int64_t n, int64_t block, int8_t* codes, float* scales) {
  try {
    return quantize<F32>(x, n, block, codes, scales);
  } catch (...) {
    return -2;
  }
}

SWARM_API int64_t swarm_int8_quantize_bf16(const uint16_t* x, int64_t n, int64_t block, int8_t* codes,
                                           float* scales) {
  try {
    return quantize<BF16>(x, n, block, codes, scales);
  } catch (...) {
    return -2;
  }
}

SWARM_API int swarm_int8_dequantize(const int8_t* codes, const float* scales, int64_t n, int64_t block, float* out,
                                    int64_t* where) {
  try {
    return report(dequantize(codes, scales, n, block, out), where);
  } catch (...) {
    return -1;
  }
}

SWARM_API int swarm_int8_dequantize_accumulate(float* acc, const int8_t* codes, const float* scales, int64_t n,
                                               int64_t block, float w, int64_t* where) {
  try {
    return report(dequantize_accumulate(acc, codes, scales, n, block, w), where);
  } catch (...) {
    return -1;
  }
}

// The owner audit's sketch (swarm/averaging/audit.py; reference: swarm_kernels/sketch.py).
// Element i = offset + k of a part (x[k], k < n) lies in row r = i / buckets at column
// c = i % buckets and is added, times the row's sign, to out[(c + shifts[r]) mod buckets], in
// double. Each row's stretch is two contiguous runs (before and after the wrap), so the inner
// loops have no modulo and vectorize. Rows are added in order, one element to one bucket at a
// time: the same sums, bit for bit, as the reference's out[t:t+h] += s * x[row] per row.
// Single-threaded: the callers already run one sketch per worker thread.
// `sq` (may be null): += the sum of squares of the elements, in double (the audit's norms: one
// pass over the part instead of two).
// Returns 0, or -1 on bad arguments (a shift outside [0, buckets)).
SWARM_API int swarm_sketch_f32(const float* x, int64_t n, int64_t offset, int64_t buckets, const double* signs,
                               const int64_t* shifts, double* out, double* sq) {
  if (n < 0 || offset < 0 || buckets <= 0) return -1;
  int64_t k = 0;
  while (k < n) {
    const int64_t i = offset + k;
    const int64_t r = i / buckets, c = i % buckets;
    const int64_t len = std::min<int64_t>(n - k, buckets - c);  // this row's stretch
    const int64_t t = shifts[r];
    if (t < 0 || t >= buckets) return -1;
    const double s = signs[r];
    const float* xs = x + k;
    const int64_t start = (c + t) % buckets;
    const int64_t head = std::min<int64_t>(len, buckets - start);  // up to the wrap
    sketch_run_f32(out + start, xs, head, s, sq);
    sketch_run_f32(out, xs + head, len - head, s, sq);
    k += len;
  }
  return 0;
}

// The same sketch of an int8 payload (codes, one fp32 scale per `block` codes), without decoding
// it first: element k is (float)codes[k] * scales[k / block], the very fp32 value dequantize
// writes, so the sums are those of decode-then-swarm_sketch_f32, bit for bit. It reads 1 byte
// an element instead of 4. The payload was decoded (so checked) before: no check here.
SWARM_API int swarm_sketch_i8(const int8_t* codes, const float* scales, int64_t n, int64_t block, int64_t offset,
                              int64_t buckets, const double* signs, const int64_t* shifts, double* out, double* sq) {
  if (n < 0 || offset < 0 || buckets <= 0 || block <= 0) return -1;
  // elements [k0, k0 + len) of the payload into o[0, len), times s
  auto add = [&](double* o, int64_t k0, int64_t len, double s) {
    int64_t e = 0;
    while (e < len) {
      const int64_t k = k0 + e, b = k / block;
      const int64_t end = std::min<int64_t>(len, (b + 1) * block - k0);
      sketch_run_i8(o + e, codes + k0 + e, end - e, scales[b], s, sq);
      e = end;
    }
  };
  int64_t k = 0;
  while (k < n) {
    const int64_t i = offset + k;
    const int64_t r = i / buckets, c = i % buckets;
    const int64_t len = std::min<int64_t>(n - k, buckets - c);
    const int64_t t = shifts[r];
    if (t < 0 || t >= buckets) return -1;
    const int64_t start = (c + t) % buckets;
    const int64_t head = std::min<int64_t>(len, buckets - start);
    add(out + start, k, head, signs[r]);
    add(out, k + head, len - head, signs[r]);
    k += len;
  }
  return 0;
}
