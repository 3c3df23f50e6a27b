#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define SPECGRAPH_AVX2 1
static inline float hsum8(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_hadd_ps(lo, lo);
  lo = _mm_hadd_ps(lo, lo);
  return _mm_cvtss_f32(lo);
}
#endif

#ifdef SPECGRAPH_AVX2
// The vector the float kernels use: AVX-512 where the CPU has it, else AVX2. half(v): its floats
// summed pairwise into 8 (an __m256), for reductions.
#ifdef __AVX512F__
struct FloatVec {
  using T = __m512;
  static constexpr int kWidth = 16, kRegisters = 32;  // floats per vector, vector registers
  static inline T zero() { return _mm512_setzero_ps(); }
  static inline T load(const float* p) { return _mm512_loadu_ps(p); }
  static inline T broadcast(const float* p) { return _mm512_set1_ps(*p); }
  static inline void store(float* p, T v) { _mm512_storeu_ps(p, v); }
  static inline T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static inline float sum(T v) { return _mm512_reduce_add_ps(v); }
  static inline __m256 half(T v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  }
};
#else
struct FloatVec {
  using T = __m256;
  static constexpr int kWidth = 8, kRegisters = 16;
  static inline T zero() { return _mm256_setzero_ps(); }
  static inline T load(const float* p) { return _mm256_loadu_ps(p); }
  static inline T broadcast(const float* p) { return _mm256_broadcast_ss(p); }
  static inline void store(float* p, T v) { _mm256_storeu_ps(p, v); }
  static inline T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static inline float sum(T v) { return hsum8(v); }
  static inline __m256 half(T v) { return v; }
};
#endif  // __AVX512F__
#endif  // SPECGRAPH_AVX2

// a . b over D floats (two FMA chains when D is a multiple of 16)
static inline float dot_f32(const float* a, const float* b, int64_t D) {
#ifdef SPECGRAPH_AVX2
  if (D % 16 == 0) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
      s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), s0);
      s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), s1);
    }
    return hsum8(_mm256_add_ps(s0, s1));
  }
#endif
  float dot = 0.f;
#pragma omp simd reduction(+ : dot)
  for (int64_t d = 0; d < D; ++d) dot += a[d] * b[d];
  return dot;
}

// s[u] = q . k_u over D floats for four rows at once: the four sums are reduced together (one
// horizontal reduction per four dots instead of one per dot: it dominated a decode's attention)
static inline void dot4_f32(const float* q, const float* const k[4], int64_t D, float* s) {
#ifdef SPECGRAPH_AVX2
  using V = FloatVec;
  if (D % V::kWidth == 0) {
    typename V::T a0 = V::zero(), a1 = V::zero(), a2 = V::zero(), a3 = V::zero();
    for (int64_t d = 0; d < D; d += V::kWidth) {
      const auto qv = V::load(q + d);
      a0 = V::fma(qv, V::load(k[0] + d), a0);
      a1 = V::fma(qv, V::load(k[1] + d), a1);
      a2 = V::fma(qv, V::load(k[2] + d), a2);
      a3 = V::fma(qv, V::load(k[3] + d), a3);
    }
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(V::half(a0), V::half(a1)), _mm256_hadd_ps(V::half(a2), V::half(a3)));
    _mm_storeu_ps(s, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
    return;
  }
#endif
  for (int u = 0; u < 4; ++u) s[u] = dot_f32(q, k[u], D);
}

// s[4 * g + u] = q_g . k_u for NG query heads (q_g = q + g * D) and four keys: each K vector is loaded once
// for all the heads. Each dot's arithmetic is dot4_f32's (the same lanes, FMA order and reduction), so a head
// gets the same scores in any group; AVX2 vectors only (dot4_f32 is the AVX-512 build's everywhere).
#if defined(SPECGRAPH_AVX2) && !defined(__AVX512F__)
template <int NG>
static inline void dot4_heads_avx2(const float* q, const float* const k[4], int64_t D, float* s) {
  __m256 a[NG][4];
  for (int g = 0; g < NG; ++g)
    for (int u = 0; u < 4; ++u) a[g][u] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 k0 = _mm256_loadu_ps(k[0] + d), k1 = _mm256_loadu_ps(k[1] + d), k2 = _mm256_loadu_ps(k[2] + d),
                 k3 = _mm256_loadu_ps(k[3] + d);
    for (int g = 0; g < NG; ++g) {
      const __m256 qv = _mm256_loadu_ps(q + g * D + d);
      a[g][0] = _mm256_fmadd_ps(qv, k0, a[g][0]);
      a[g][1] = _mm256_fmadd_ps(qv, k1, a[g][1]);
      a[g][2] = _mm256_fmadd_ps(qv, k2, a[g][2]);
      a[g][3] = _mm256_fmadd_ps(qv, k3, a[g][3]);
    }
  }
  for (int g = 0; g < NG; ++g) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[g][0], a[g][1]), _mm256_hadd_ps(a[g][2], a[g][3]));
    _mm_storeu_ps(s + 4 * g, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
  }
}
#endif

// dot4_f32 for the G query heads at q (q + g * D): s[4 * g + u], three heads at a time where it can
static inline void dot4_heads(const float* q, int64_t G, const float* const k[4], int64_t D, float* s) {
#if defined(SPECGRAPH_AVX2) && !defined(__AVX512F__)
  if (D % 8 == 0) {
    int64_t g = 0;
    for (; g + 3 <= G; g += 3) dot4_heads_avx2<3>(q + g * D, k, D, s + 4 * g);
    if (G - g == 2) dot4_heads_avx2<2>(q + g * D, k, D, s + 4 * g);
    if (G - g == 1) dot4_heads_avx2<1>(q + g * D, k, D, s + 4 * g);
    return;
  }
#endif
  for (int64_t g = 0; g < G; ++g) dot4_f32(q + g * D, k, D, s + 4 * g);
}

// Rows of a paged cache are scattered (a block per page, one kv head's rows strided by the others'):
// walking them one by one waits for each from memory in turn. The loops over keys prefetch the row
// kPrefetchRows keys ahead, so that many rows are in flight: attention over a cache that left the CPU
// caches (a decode step streams all the weights between two visits of a layer's cache) runs at the
// memory's streaming rate instead of its latency (SmolLM2 shapes, context 1000, one thread: 664 -> 318 us).
constexpr int64_t kPrefetchRows = 8;
static inline void prefetch_row(const float* row, int64_t D) {
  for (int64_t d = 0; d < D; d += 16) __builtin_prefetch(row + d, 0, 3);
}

// out[0 .. 8 * NC) = sum_i p[i] * rows[off[i] .. off[i] + 8 * NC), the sum kept in registers (a
// compile-time count of them: indexed by a runtime count they lived on the stack, a store and a load per
// row and vector) and stored once; rows prefetched kPrefetchRows ahead (D floats each) when asked
#ifdef SPECGRAPH_AVX2
template <int NC>
static inline void weighted_rows_cols(float* out, const float* p, const float* rows, const int64_t* off, int64_t n,
                                      bool prefetch, int64_t D) {
  __m256 acc[NC];
  for (int c = 0; c < NC; ++c) acc[c] = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    if (prefetch && i + kPrefetchRows < n) prefetch_row(rows + off[i + kPrefetchRows], D);
    const __m256 pb = _mm256_set1_ps(p[i]);
    const float* r = rows + off[i];
    for (int c = 0; c < NC; ++c) acc[c] = _mm256_fmadd_ps(pb, _mm256_loadu_ps(r + 8 * c), acc[c]);
  }
  for (int c = 0; c < NC; ++c) _mm256_storeu_ps(out + 8 * c, acc[c]);
}
#endif

// out[0 .. D) = sum_i p[i] * rows[off[i] .. off[i] + D), 64 columns at a time
static inline void weighted_rows(float* out, const float* p, const float* rows, const int64_t* off, int64_t n,
                                 int64_t D) {
#ifdef SPECGRAPH_AVX2
  if (D % 8 == 0) {
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
      const bool first = d0 == 0;  // (the first pass prefetches the whole rows)
      switch (std::min<int64_t>(8, (D - d0) / 8)) {
        case 8: weighted_rows_cols<8>(out + d0, p, rows + d0, off, n, first, D); break;
        case 7: weighted_rows_cols<7>(out + d0, p, rows + d0, off, n, first, D); break;
        case 6: weighted_rows_cols<6>(out + d0, p, rows + d0, off, n, first, D); break;
        case 5: weighted_rows_cols<5>(out + d0, p, rows + d0, off, n, first, D); break;
        case 4: weighted_rows_cols<4>(out + d0, p, rows + d0, off, n, first, D); break;
        case 3: weighted_rows_cols<3>(out + d0, p, rows + d0, off, n, first, D); break;
        case 2: weighted_rows_cols<2>(out + d0, p, rows + d0, off, n, first, D); break;
        default: weighted_rows_cols<1>(out + d0, p, rows + d0, off, n, first, D); break;
      }
    }
    return;
  }
#endif
  std::fill(out, out + D, 0.f);
  for (int64_t i = 0; i < n; ++i) {
    const float* r = rows + off[i];
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) out[d] += p[i] * r[d];
  }
}

// out[g * out_stride + d] = sum_i p[g * p_stride + i] * rows[off[i] + d] for the G heads of a kv head, whose
// weights p share one key range: with AVX-512 each V row is loaded once for all of them (up to 16
// accumulators: 16 / (D / 16) heads per pass), not once per head
#if defined(__AVX512F__)
template <int C>  // D = 16 * C
static inline void weighted_rows_heads_avx512(float* out, int64_t out_stride, const float* p, int64_t p_stride,
                                              int64_t G, const float* rows, const int64_t* off, int64_t n) {
  constexpr int GB = 16 / C > 0 ? 16 / C : 1;
  for (int64_t g0 = 0; g0 < G; g0 += GB) {
    const int64_t gn = std::min<int64_t>(GB, G - g0);
    __m512 acc[GB][C];
    for (int g = 0; g < GB; ++g)
      for (int c = 0; c < C; ++c) acc[g][c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; ++i) {
      if (g0 == 0 && i + kPrefetchRows < n) prefetch_row(rows + off[i + kPrefetchRows], 16 * C);
      const float* r = rows + off[i];
      __m512 v[C];
      for (int c = 0; c < C; ++c) v[c] = _mm512_loadu_ps(r + 16 * c);
      for (int g = 0; g < GB; ++g) {
        if (g >= gn) break;
        const __m512 pb = _mm512_set1_ps(p[(g0 + g) * p_stride + i]);
        for (int c = 0; c < C; ++c) acc[g][c] = _mm512_fmadd_ps(pb, v[c], acc[g][c]);
      }
    }
    for (int g = 0; g < GB && g < gn; ++g)
      for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + (g0 + g) * out_stride + 16 * c, acc[g][c]);
  }
}
#endif

// weighted_rows for NG heads (weights p + g * p_stride, outputs out + g * out_stride) over the same rows, 32
// columns per pass: each output lane gets weighted_rows' FMAs in its order, so a head's sums do not depend on
// its group
#if defined(SPECGRAPH_AVX2) && !defined(__AVX512F__)
template <int NG>
static inline void weighted_rows_heads_avx2(float* out, int64_t out_stride, const float* p, int64_t p_stride,
                                            const float* rows, const int64_t* off, int64_t n, int64_t D) {
  for (int64_t d0 = 0; d0 < D; d0 += 32) {
    __m256 acc[NG][4];
    for (int g = 0; g < NG; ++g)
      for (int c = 0; c < 4; ++c) acc[g][c] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; ++i) {
      const float* r = rows + off[i] + d0;
      const __m256 v0 = _mm256_loadu_ps(r), v1 = _mm256_loadu_ps(r + 8), v2 = _mm256_loadu_ps(r + 16),
                   v3 = _mm256_loadu_ps(r + 24);
      for (int g = 0; g < NG; ++g) {
        const __m256 pb = _mm256_set1_ps(p[g * p_stride + i]);
        acc[g][0] = _mm256_fmadd_ps(pb, v0, acc[g][0]);
        acc[g][1] = _mm256_fmadd_ps(pb, v1, acc[g][1]);
        acc[g][2] = _mm256_fmadd_ps(pb, v2, acc[g][2]);
        acc[g][3] = _mm256_fmadd_ps(pb, v3, acc[g][3]);
      }
    }
    for (int g = 0; g < NG; ++g)
      for (int c = 0; c < 4; ++c) _mm256_storeu_ps(out + g * out_stride + d0 + 8 * c, acc[g][c]);
  }
}
#endif

static inline void weighted_rows_heads(float* out, int64_t out_stride, const float* p, int64_t p_stride, int64_t G,
                                       const float* rows, const int64_t* off, int64_t n, int64_t D) {
#if defined(__AVX512F__)
  switch (D) {
    case 32: return weighted_rows_heads_avx512<2>(out, out_stride, p, p_stride, G, rows, off, n);
    case 64: return weighted_rows_heads_avx512<4>(out, out_stride, p, p_stride, G, rows, off, n);
    case 128: return weighted_rows_heads_avx512<8>(out, out_stride, p, p_stride, G, rows, off, n);
    default: break;
  }
#endif
#if defined(SPECGRAPH_AVX2) && !defined(__AVX512F__)
  if (D % 32 == 0) {  // three heads at a time, 32 columns per pass: each V vector loaded once for them
    int64_t g = 0;
    for (; g + 3 <= G; g += 3) weighted_rows_heads_avx2<3>(out + g * out_stride, out_stride, p + g * p_stride, p_stride, rows, off, n, D);
    if (G - g == 2) weighted_rows_heads_avx2<2>(out + g * out_stride, out_stride, p + g * p_stride, p_stride, rows, off, n, D);
    if (G - g == 1) weighted_rows_heads_avx2<1>(out + g * out_stride, out_stride, p + g * p_stride, p_stride, rows, off, n, D);
    return;
  }
#endif
  for (int64_t g = 0; g < G; ++g) weighted_rows(out + g * out_stride, p + g * p_stride, rows, off, n, D);
}

// k, v [N, KVH, D] contiguous; k_cache, v_cache [num_blocks, P, KVH, D] contiguous, same dtype;
// slot_mapping [N] int64: row i goes to flat slot slot_mapping[i]; slots < 0 are skipped.
void cache_write_rows(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
                      torch::Tensor slot_mapping) {
  const int64_t N = k.size(0);
  const int64_t slots = k_cache.size(0) * k_cache.size(1);
  const int64_t row_bytes = k.size(1) * k.size(2) * k.element_size();
  const int64_t* sm = slot_mapping.data_ptr<int64_t>();
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  for (int64_t i = 0; i < N; ++i) {
    const int64_t slot = sm[i];
    if (slot < 0) continue;
    TORCH_CHECK(slot < slots, "slot_mapping[", i, "] = ", slot, " is outside the cache's ", slots, " slots");
    std::memcpy(kc + slot * row_bytes, kp + i * row_bytes, row_bytes);
    std::memcpy(vc + slot * row_bytes, vp + i * row_bytes, row_bytes);
  }
}

// fn(i, block, slot in block) for keys j = kb + i .. k1 - 1 of a block table with pages of P slots: walked
// page by page (a division per key, j / P and j % P, cost about as much as the float work of a key's row)
template <class F>
static inline void for_each_key_slot(const int32_t* table, int64_t P, int64_t kb, int64_t k1, F fn) {
  for (int64_t j = kb; j < k1;) {
    const int64_t b = j / P, block = table[b], end = std::min(k1, (b + 1) * P);
    for (int64_t in = j - b * P; j < end; ++j, ++in) fn(j - kb, block, in);
  }
}

// Where a work item's K and V rows come from. Each source fills off[j - kb] with the offset (in
// floats, from the returned bases) of key j's row of kv head kvh, for keys kb .. k1 - 1.
// FloatRows: a float32 cache [num_blocks, P, KVH, D], read in place.
struct FloatRows {
  const float* k;
  const float* v;
  int64_t KVH;
  void gather(const int32_t* table, int64_t P, int64_t kvh, int64_t D, int64_t kb, int64_t k1,
              std::vector<int64_t>& off, std::vector<float>&, std::vector<float>&, const float** kbase,
              const float** vbase) const {
    off.resize(k1 - kb);
    for_each_key_slot(table, P, kb, k1, [&](int64_t i, int64_t block, int64_t in) {
      off[i] = ((block * P + in) * KVH + kvh) * D;
    });
    *kbase = k;
    *vbase = v;
  }
};

// Quantized caches (layouts in quant.py): the item's rows are dequantized once into the thread's
// buffers (nk x D floats each, L2-resident), which the float loops then read; each quantized byte
// of the item's range is read once. fp8: e4m3 bytes [num_blocks, P, KVH, D] and a float32 scale per
// (slot, kv head): value = e4m3 * scale (e4m3 -> float through float16 bits: value * 2^-8 exactly,
// 2^8 folded into the scale, as quant.dequantize_fp8). int4: bytes [num_blocks, P, KVH, D / 2]
// (element 2i the low nibble of byte i, 2i + 1 the high one) and float16 (scale, min) per group of
// a row: value = code * scale + min.
static inline void dequant_fp8_row(const uint8_t* p, float scale, float* out, int64_t D) {
  int64_t d = 0;
#ifdef SPECGRAPH_AVX2
  const __m256 s = _mm256_set1_ps(scale * 256.f);
  for (; d + 8 <= D; d += 8) {
    const __m128i u = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + d)));
    const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(u, _mm_set1_epi16(0x80)), 8),
                                   _mm_slli_epi16(_mm_and_si128(u, _mm_set1_epi16(0x7F)), 7));
    _mm256_storeu_ps(out + d, _mm256_mul_ps(_mm256_cvtph_ps(h), s));
  }
#endif
  for (; d < D; ++d) out[d] = static_cast<float>(c10::bit_cast<c10::Float8_e4m3fn>(p[d])) * scale;
}

static inline void dequant_int4_row(const uint8_t* p, const at::Half* params, int64_t group, float* out, int64_t D) {
  for (int64_t g0 = 0; g0 < D; g0 += group) {
    const float scale = static_cast<float>(params[(g0 / group) * 2]), mn = static_cast<float>(params[(g0 / group) * 2 + 1]);
    const uint8_t* b = p + g0 / 2;
    float* o = out + g0;
#pragma omp simd
    for (int64_t i = 0; i < group / 2; ++i) {
      o[2 * i] = static_cast<float>(b[i] & 15) * scale + mn;
      o[2 * i + 1] = static_cast<float>(b[i] >> 4) * scale + mn;
    }
  }
}

struct QuantRows {
  bool int4;
  const uint8_t* k;
  const uint8_t* v;
  const void* k_params;  // fp8: float [slots, KVH]; int4: at::Half [slots, KVH, D / group, 2]
  const void* v_params;
  int64_t KVH, k_group, v_group;
  void gather(const int32_t* table, int64_t P, int64_t kvh, int64_t D, int64_t kb, int64_t k1,
              std::vector<int64_t>& off, std::vector<float>& kbuf, std::vector<float>& vbuf, const float** kbase,
              const float** vbase) const {
    const int64_t nk = k1 - kb;
    off.resize(nk);
    kbuf.resize(nk * D);
    vbuf.resize(nk * D);
    for_each_key_slot(table, P, kb, k1, [&](int64_t i, int64_t block, int64_t in) {
      off[i] = i * D;
      dequant((block * P + in) * KVH + kvh, D, kbuf.data() + i * D, vbuf.data() + i * D);
    });
    *kbase = kbuf.data();
    *vbase = vbuf.data();
  }
  // the K and V rows of (slot, kv head) row slot_head, dequantized to kout / vout
  void dequant(int64_t slot_head, int64_t D, float* kout, float* vout) const {
    const int64_t row_bytes = int4 ? D / 2 : D;
    if (int4) {
      dequant_int4_row(k + slot_head * row_bytes, static_cast<const at::Half*>(k_params) + slot_head * (D / k_group) * 2,
                       k_group, kout, D);
      dequant_int4_row(v + slot_head * row_bytes, static_cast<const at::Half*>(v_params) + slot_head * (D / v_group) * 2,
                       v_group, vout, D);
    } else {
      dequant_fp8_row(k + slot_head * row_bytes, static_cast<const float*>(k_params)[slot_head], kout, D);
      dequant_fp8_row(v + slot_head * row_bytes, static_cast<const float*>(v_params)[slot_head], vout, D);
    }
  }
};

// Hot/cold caches (hot_cold.py): block ids below num_hot are float32 pages [num_hot, P, KVH, D], the
// others cold page id - num_hot of a QuantRows layout. The item's rows land in the thread's buffers:
// hot rows copied, cold rows dequantized.
struct MixedRows {
  const float* k_hot;
  const float* v_hot;
  int64_t num_hot;
  QuantRows cold;
  void gather(const int32_t* table, int64_t P, int64_t kvh, int64_t D, int64_t kb, int64_t k1,
              std::vector<int64_t>& off, std::vector<float>& kbuf, std::vector<float>& vbuf, const float** kbase,
              const float** vbase) const {
    const int64_t nk = k1 - kb, KVH = cold.KVH;
    off.resize(nk);
    kbuf.resize(nk * D);
    vbuf.resize(nk * D);
    for_each_key_slot(table, P, kb, k1, [&](int64_t i, int64_t block, int64_t in) {
      off[i] = i * D;
      if (block < num_hot) {
        const int64_t row = ((block * P + in) * KVH + kvh) * D;
        std::memcpy(kbuf.data() + i * D, k_hot + row, D * sizeof(float));
        std::memcpy(vbuf.data() + i * D, v_hot + row, D * sizeof(float));
      } else {
        cold.dequant(((block - num_hot) * P + in) * KVH + kvh, D, kbuf.data() + i * D, vbuf.data() + i * D);
      }
    });
    *kbase = kbuf.data();
    *vbase = vbuf.data();
  }
};

// Keys are taken in fixed chunks of kKeyChunk (chunk c: keys c * kKeyChunk .. (c + 1) * kKeyChunk - 1). For
// each (token, head) a chunk gives a partial (max m, sum l of exp(score - m), acc = sum of exp(score - m) * V
// rows; l = 0: the token sees no key of the chunk), and the partials are folded in key order from an empty
// state. A row's arithmetic depends on its keys alone, so work may be split by chunk without changing a bit.
constexpr int64_t kKeyChunk = 64;
// steps of at most this many tokens per sequence split few items' keys over the threads (decodes, verifies)
constexpr int64_t kSplitKeysTokens = 16;
// query heads scored per pass over four K rows (a stack buffer's size)
constexpr int64_t kMaxGroup = 12;

// st = st (+) pt, both [m, l, acc[D]]
static inline void fold_partial(float* st, const float* pt, int64_t D) {
  if (pt[1] == 0.f) return;
  if (st[1] == 0.f) {
    std::memcpy(st, pt, (D + 2) * sizeof(float));
    return;
  }
  const float m = std::max(st[0], pt[0]), a = expf(st[0] - m), b = expf(pt[0] - m);
  st[0] = m;
  st[1] = st[1] * a + pt[1] * b;
  float* acc = st + 2;
  const float* add = pt + 2;
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) acc[d] = acc[d] * a + add[d] * b;
}

// out[0 .. D) = acc / l (left at 0 when no key was seen)
static inline void finish_partial(float* out, const float* st, int64_t D) {
  if (st[1] == 0.f) return;
  const float inv = 1.f / st[1];
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) out[d] = st[2 + d] * inv;
}

// q [N, H, D], k_cache/v_cache [num_blocks, P, KVH, D] (float32, contiguous), block_tables [S, MB]
// int32, seq_lens [S] int32, query_start_loc [S + 1] int32, positions [N] int64 -> out [N, H, D].
// Token i (position p) of sequence s sees keys lo .. hi - 1: hi = min(p + 1, seq_lens[s]), lo = 0, or
// with a sliding window (window > 0) lo = max(0, p - window + 1). The variant (paged_attention.py,
// "variant"): score = scale * q.k, then softcap * tanh(score / softcap) when softcap > 0, then plus
// alibi_slopes[head] * (j - p) when slopes (float32 [H]) are given; softmax over the visible keys.
// One work item per (sequence, kv head): each cached K/V row of that head in the union of the
// sequence's visible ranges is read once and used by every query token and head of its group that
// sees it; keys before that union are never touched (a windowed decode reads `window` keys at any
// context). Keys go in fixed chunks (kKeyChunk, an online softmax folded in key order), so an item's
// work can be split over threads by chunk as well as by query head without changing a row's bits:
// a batch-1 decode's 3 items (SmolLM2) used to put one thread on two items' rows and the other
// reading the same rows again for its heads (2 threads no faster than 1 at 1,000 keys); by chunk
// each row is read once and both threads stream their own keys (1.2-1.3x faster at 200-4,000 keys).
// Token trees (tree_mask.py): with tree_mask (int32 [N, TW], contiguous) token t of sequence s (base =
// seq_lens[s] - T, key j's position kp = j below base, else positions[t0 + j - base]) reads keys
// lo .. hi - 1 with hi = min(base + t + 1, seq_lens[s]) and, with a window, lo = min(p - window + 1, base)
// (clamped to [0, hi]; new keys are tested one by one). Within that range a key is visible iff kp <= p,
// kp > p - window (window > 0), and j < base or its bit r = j - base of the token's row is set (r >= 32
// TW: set). Hidden keys score float lowest (finite under -ffast-math: exp gives 0, no NaN); a token
// that sees no key outputs 0; ALiBi's bias is slope * (kp - p). Without tree_mask none of it runs.
// Rows: where the K/V rows come from (FloatRows, QuantRows); P, KVH and num_blocks: the cache's geometry.
template <class Rows>
static torch::Tensor attend_rows(torch::Tensor q, const Rows& rows, int64_t P, int64_t KVH, int64_t num_blocks,
                                 torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor query_start_loc,
                                 torch::Tensor positions, double scale, int64_t window, double softcap,
                                 c10::optional<torch::Tensor> alibi_slopes, c10::optional<torch::Tensor> tree_mask) {
  const int64_t N = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t G = H / KVH, S = seq_lens.size(0), MB = block_tables.size(1);
  TORCH_CHECK(window >= 0 && softcap >= 0.0, "window and softcap must be >= 0; got ", window, " and ", softcap);
  const float* slopes = nullptr;
  if (alibi_slopes.has_value()) {
    TORCH_CHECK(alibi_slopes->scalar_type() == torch::kFloat && alibi_slopes->dim() == 1 &&
                alibi_slopes->size(0) == H && alibi_slopes->is_contiguous() && alibi_slopes->device().is_cpu(),
                "alibi_slopes must be a contiguous float32 CPU tensor [num_heads=", H, "]");
    slopes = alibi_slopes->data_ptr<float>();
  }
  const int32_t* tm = nullptr;
  int64_t TW = 0;
  if (tree_mask.has_value()) {
    TORCH_CHECK(tree_mask->scalar_type() == torch::kInt && tree_mask->dim() == 2 && tree_mask->size(0) == N &&
                tree_mask->size(1) >= 1 && tree_mask->is_contiguous() && tree_mask->device().is_cpu(),
                "tree_mask must be a contiguous int32 CPU tensor [N=", N, ", W>=1]; got ", tree_mask->scalar_type(), " ",
                tree_mask->sizes(), tree_mask->is_contiguous() ? "" : " (not contiguous)", " on ", tree_mask->device());
    tm = tree_mask->data_ptr<int32_t>();
    TW = tree_mask->size(1);
  }
  auto out = torch::zeros({N, H, D}, q.options());
  const float* qp = q.data_ptr<float>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const float cap = static_cast<float>(softcap), inv_cap = softcap > 0.0 ? static_cast<float>(1.0 / softcap) : 0.f;
  const int64_t PW = D + 2;  // a partial: (max, sum, acc[D])
  // Work splits (none changes a row's arithmetic, see above): a unit is a (sequence, kv head) item, or
  // a slice of its query heads (few items of long steps: a prefill chunk), or one key chunk of an item
  // (few items of short steps: a batch-1 decode or verify), whose partials land in `parts` and are
  // folded after all units end.
  const int64_t items = S * KVH, threads = at::get_num_threads();
  int64_t longest_step = 0, longest_seq = 0;
  for (int64_t s = 0; s < S; ++s) {
    longest_step = std::max<int64_t>(longest_step, std::min<int64_t>(qsl[s + 1], N) - std::max<int64_t>(qsl[s], 0));
    longest_seq = std::max<int64_t>(longest_seq, lens[s]);
  }
  const bool split_keys = items < 2 * threads && longest_step <= kSplitKeysTokens;
  const int64_t NC = split_keys ? std::max<int64_t>(1, (std::min(longest_seq, MB * P) + kKeyChunk - 1) / kKeyChunk) : 1;
  const int64_t HS = split_keys || items >= 2 * threads ? 1 : std::min<int64_t>(G, (2 * threads + items - 1) / items);
  const int64_t TP = std::max<int64_t>(longest_step, 1);
  // [item, chunk, token, head, PW], the calling thread's buffer (reused: no page faults per call; the
  // units reach it through this pointer, a thread_local named in them would be their own thread's)
  static thread_local std::vector<float> parts_buffer;
  if (split_keys && parts_buffer.size() < static_cast<size_t>(items * NC * TP * G * PW))
    parts_buffer.resize(items * NC * TP * G * PW);
  float* const parts = parts_buffer.data();
  at::parallel_for(0, items * HS * NC, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, kbuf, vbuf, kdist, part, state;  // kdist: a tree token's kp - p per key
    std::vector<int64_t> lo, hi, off;
    std::vector<uint8_t> vis;  // a tree token's visible keys in the chunk's part of its range
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t item = unit / (HS * NC), slice = unit / NC % HS, chunk = unit % NC;
      const int64_t s = item / KVH, kvh = item % KVH, h0 = kvh * G;  // the kv head's query heads h0 .. h0 + G - 1
      const int64_t g_lo = G * slice / HS, g_hi = G * (slice + 1) / HS;  // this unit's: h0 + g_lo .. h0 + g_hi - 1
      const int64_t t0 = std::max<int64_t>(qsl[s], 0), t1 = std::min<int64_t>(qsl[s + 1], N);
      const int64_t T = t1 - t0;
      float* unit_parts = split_keys ? parts + (item * NC + chunk) * TP * G * PW : nullptr;
      if (split_keys)  // (an empty partial: sum 0)
        for (int64_t i = 0; i < TP * G; ++i) unit_parts[i * PW + 1] = 0.f;
      if (T <= 0 || g_lo == g_hi) continue;
      lo.assign(T, 0);
      hi.assign(T, 0);
      // the keys the step reads: [k0, k1), the union of the tokens' visible ranges
      int64_t k0 = INT64_MAX, k1 = 0;
      const int64_t base = lens[s] - T;  // a tree's first new key
      for (int64_t t = 0; t < T; ++t) {
        const int64_t p = pos[t0 + t];
        hi[t] = std::max<int64_t>(std::min<int64_t>(tm ? base + t + 1 : p + 1, lens[s]), 0);
        if (window > 0)
          lo[t] = std::min(std::max<int64_t>(tm ? std::min(p - window + 1, base) : p - window + 1, 0), hi[t]);
        if (lo[t] < hi[t]) {
          k0 = std::min(k0, lo[t]);
          k1 = std::max(k1, hi[t]);
        }
      }
      if (k1 == 0) continue;  // no visible key (bad input): output 0, as the other kernels do
      TORCH_CHECK(k1 <= MB * P, "sequence ", s, " has ", k1, " visible keys but its block table row holds ",
                  MB * P, " slots");
      const int32_t* table = bt + s * MB;
      const int64_t c_lo = split_keys ? chunk : k0 / kKeyChunk, c_hi = split_keys ? chunk + 1 : (k1 + kKeyChunk - 1) / kKeyChunk;
      const int64_t r0 = std::max(k0, c_lo * kKeyChunk), r1 = std::min(k1, c_hi * kKeyChunk);  // the unit's keys
      if (r0 >= r1) continue;  // (a chunk outside the item's keys: its partials stay empty)
      for (int64_t b = r0 / P; b < (r1 + P - 1) / P; ++b)
        TORCH_CHECK(table[b] >= 0 && table[b] < num_blocks, "block_tables[", s, ", ", b, "] = ", table[b],
                    " is outside the cache's ", num_blocks, " blocks");
      if (!split_keys) {  // the running fold of the item's chunks, per (token, head of the unit)
        state.assign(T * G * PW, 0.f);
        part.resize(T * G * PW);
      }
      // offsets (floats, from kp / vp) of this kv head's rows of the unit's keys r0 .. r1 - 1
      const float *kp, *vp;
      rows.gather(table, P, kvh, D, r0, r1, off, kbuf, vbuf, &kp, &vp);
      // the plain path (no window: every range starts at key 0) is compiled without the window's tests
      auto attend = [&](auto windowed) {
        constexpr bool W = decltype(windowed)::value;
        for (int64_t c = c_lo; c < c_hi; ++c) {
          float* pc = split_keys ? unit_parts : part.data();  // [token, head, PW]
          const int64_t j0 = std::max(r0, c * kKeyChunk), j1 = std::min(r1, (c + 1) * kKeyChunk);
          for (int64_t i = 0; i < T * G; ++i) pc[i * PW + 1] = 0.f;
          if (j0 < j1) {
            const int64_t nk = j1 - j0;
            // scores[(t * G + g) * nk + j - j0] for query head h0 + g; each key row read once
            scores.resize(T * G * nk);
            // keys four at a time (a short last block repeats its last row); a token skips the blocks it
            // sees none of, and the scores it gets for keys outside its range are never read. K rows are
            // prefetched kPrefetchRows ahead across chunks (a chunk's first rows are not waited for), and
            // each key's V row as its K row is read: the chunk's V pass below finds them in cache.
            for (int64_t j = j0; j < j1; j += 4) {
              const int64_t nb = std::min<int64_t>(4, j1 - j);
              const float* kh[4];
              for (int64_t u = 0; u < 4; ++u) {
                const int64_t jj = std::min(j + u, j1 - 1);
                kh[u] = kp + off[jj - r0];
                if (jj + kPrefetchRows < r1) prefetch_row(kp + off[jj + kPrefetchRows - r0], D);
                if (u < nb) prefetch_row(vp + off[jj - r0], D);
              }
              for (int64_t t = 0; t < T; ++t) {
                if (j >= hi[t] || (W && j + nb <= lo[t])) continue;
                float s4[4 * kMaxGroup];
                for (int64_t g = g_lo; g < g_hi; g += kMaxGroup) {
                  const int64_t ng = std::min<int64_t>(kMaxGroup, g_hi - g);
                  dot4_heads(qp + ((t0 + t) * H + h0 + g) * D, ng, kh, D, s4);
                  for (int64_t e = 0; e < ng; ++e) {
                    float* row = scores.data() + (t * G + g + e) * nk + j - j0;
                    for (int64_t u = 0; u < nb; ++u) row[u] = s4[4 * e + u] * sc;
                  }
                }
              }
            }
            for (int64_t t = 0; t < T; ++t) {
              const int64_t a = std::max(lo[t], j0), n = std::min(hi[t], j1) - a, p = pos[t0 + t];
              if (n <= 0) continue;
              if (tm) {  // the tree rule (above) for keys a .. a + n - 1
                const uint32_t* row = reinterpret_cast<const uint32_t*>(tm + (t0 + t) * TW);
                kdist.resize(n);
                vis.resize(n);
                bool any = false;
                for (int64_t i = 0; i < n; ++i) {
                  const int64_t j = a + i, r = j - base, kp = r < 0 ? j : pos[t0 + r];
                  vis[i] = kp <= p && (window == 0 || kp > p - window) &&
                           (r < 0 || r >= 32 * TW || ((row[r / 32] >> (r % 32)) & 1u));
                  kdist[i] = static_cast<float>(kp - p);
                  any = any || vis[i];
                }
                if (!any) continue;
              }
              for (int64_t g = g_lo; g < g_hi; ++g) {
                const int64_t head = h0 + g;
                float* sg = scores.data() + (t * G + g) * nk + (a - j0);  // sg[i]: key a + i
                if (cap > 0.f) {
#pragma omp simd
                  for (int64_t i = 0; i < n; ++i) sg[i] = cap * tanhf(sg[i] * inv_cap);
                }
                if (slopes) {
                  const float slope = slopes[head], d0 = static_cast<float>(a - p);  // j - p at i = 0
                  if (tm) {
                    for (int64_t i = 0; i < n; ++i) sg[i] += slope * kdist[i];
                  } else {
#pragma omp simd
                    for (int64_t i = 0; i < n; ++i) sg[i] += slope * (d0 + static_cast<float>(i));
                  }
                }
                if (tm)
                  for (int64_t i = 0; i < n; ++i)
                    if (!vis[i]) sg[i] = std::numeric_limits<float>::lowest();
                const float mx = *std::max_element(sg, sg + n);
                float sum = 0.f;
#pragma omp simd reduction(+ : sum)
                for (int64_t i = 0; i < n; ++i) {
                  sg[i] = expf(sg[i] - mx);  // vectorized (glibc libmvec) under -ffast-math
                  sum += sg[i];
                }
                pc[(t * G + g) * PW] = mx;
                pc[(t * G + g) * PW + 1] = sum;
              }
              // the token's visible keys of the chunk are one range: each head's V rows weighted
              weighted_rows_heads(pc + (t * G + g_lo) * PW + 2, PW, scores.data() + (t * G + g_lo) * nk + (a - j0), nk,
                                  g_hi - g_lo, vp, off.data() + (a - r0), n, D);
            }
          }
          if (!split_keys)
            for (int64_t t = 0; t < T; ++t)
              for (int64_t g = g_lo; g < g_hi; ++g) fold_partial(state.data() + (t * G + g) * PW, pc + (t * G + g) * PW, D);
        }
      };
      if (window > 0)
        attend(std::true_type{});
      else
        attend(std::false_type{});
      if (!split_keys)
        for (int64_t t = 0; t < T; ++t)
          for (int64_t g = g_lo; g < g_hi; ++g)
            finish_partial(op + ((t0 + t) * H + h0 + g) * D, state.data() + (t * G + g) * PW, D);
    }
  });
  if (split_keys) {  // each (token, head)'s chunk partials folded in key order, as one unit folds them
    at::parallel_for(0, items, std::max<int64_t>(1, 32768 / (NC * TP * G * PW)), [&](int64_t begin, int64_t end) {
      std::vector<float> state(PW);
      for (int64_t item = begin; item < end; ++item) {
        const int64_t s = item / KVH, h0 = item % KVH * G;
        const int64_t t0 = std::max<int64_t>(qsl[s], 0), T = std::min<int64_t>(qsl[s + 1], N) - t0;
        for (int64_t t = 0; t < T; ++t)
          for (int64_t g = 0; g < G; ++g) {
            state[1] = 0.f;
            for (int64_t c = 0; c < NC; ++c)
              fold_partial(state.data(), parts + (((item * NC + c) * TP + t) * G + g) * PW, D);
            finish_partial(op + ((t0 + t) * H + h0 + g) * D, state.data(), D);
          }
      }
    });
  }
  return out;
}

torch::Tensor paged_attention_short(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                    torch::Tensor block_tables, torch::Tensor seq_lens,
                                    torch::Tensor query_start_loc, torch::Tensor positions, double scale,
                                    int64_t window, double softcap, c10::optional<torch::Tensor> alibi_slopes,
                                    c10::optional<torch::Tensor> tree_mask) {
  const FloatRows rows{k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), k_cache.size(2)};
  return attend_rows(q, rows, k_cache.size(1), k_cache.size(2), k_cache.size(0), block_tables, seq_lens,
                     query_start_loc, positions, scale, window, softcap, alibi_slopes, tree_mask);
}

// The same over a quantized layer cache (k_cache, v_cache, k_scale, v_scale; quant.py), scheme "fp8"
// or "int4"; the caller has validated the layout (quant.fp8_layout / int4_layout).
torch::Tensor paged_attention_quant_short(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                          torch::Tensor k_scale, torch::Tensor v_scale, torch::Tensor block_tables,
                                          torch::Tensor seq_lens, torch::Tensor query_start_loc,
                                          torch::Tensor positions, double scale, int64_t window, double softcap,
                                          c10::optional<torch::Tensor> alibi_slopes,
                                          c10::optional<torch::Tensor> tree_mask, std::string scheme) {
  const bool int4 = scheme == "int4";
  TORCH_CHECK(int4 || scheme == "fp8", "paged_attention_quant_short: scheme must be fp8 or int4; got ", scheme);
  const int64_t D = q.size(2), KVH = k_cache.size(2);
  QuantRows rows{int4, static_cast<const uint8_t*>(k_cache.data_ptr()), static_cast<const uint8_t*>(v_cache.data_ptr()),
                 k_scale.data_ptr(), v_scale.data_ptr(), KVH, 0, 0};
  if (int4) {
    rows.k_group = D / k_scale.size(3);
    rows.v_group = D / v_scale.size(3);
  }
  return attend_rows(q, rows, k_cache.size(1), KVH, k_cache.size(0), block_tables, seq_lens, query_start_loc,
                     positions, scale, window, softcap, alibi_slopes, tree_mask);
}

// The same over a hot/cold layer cache (k_hot, v_hot float32; k_cold, v_cold, k_scale, v_scale of scheme
// "fp8" or "int4"; hot_cold.py); the caller has validated the layout (hot_cold.mixed_layout).
torch::Tensor paged_attention_mixed_short(torch::Tensor q, torch::Tensor k_hot, torch::Tensor v_hot,
                                          torch::Tensor k_cold, torch::Tensor v_cold, torch::Tensor k_scale,
                                          torch::Tensor v_scale, torch::Tensor block_tables, torch::Tensor seq_lens,
                                          torch::Tensor query_start_loc, torch::Tensor positions, double scale,
                                          int64_t window, double softcap, c10::optional<torch::Tensor> alibi_slopes,
                                          c10::optional<torch::Tensor> tree_mask, std::string scheme) {
  const bool int4 = scheme == "int4";
  TORCH_CHECK(int4 || scheme == "fp8", "paged_attention_mixed_short: scheme must be fp8 or int4; got ", scheme);
  TORCH_CHECK(k_hot.scalar_type() == torch::kFloat && v_hot.scalar_type() == torch::kFloat && k_hot.is_contiguous() &&
              v_hot.is_contiguous(), "paged_attention_mixed_short: hot pages must be contiguous float32");
  const int64_t D = q.size(2), KVH = k_cold.size(2);
  MixedRows rows{k_hot.data_ptr<float>(), v_hot.data_ptr<float>(), k_hot.size(0),
                 QuantRows{int4, static_cast<const uint8_t*>(k_cold.data_ptr()),
                           static_cast<const uint8_t*>(v_cold.data_ptr()), k_scale.data_ptr(), v_scale.data_ptr(), KVH,
                           0, 0}};
  if (int4) {
    rows.cold.k_group = D / k_scale.size(3);
    rows.cold.v_group = D / v_scale.size(3);
  }
  return attend_rows(q, rows, k_cold.size(1), KVH, k_hot.size(0) + k_cold.size(0), block_tables, seq_lens,
                     query_start_loc, positions, scale, window, softcap, alibi_slopes, tree_mask);
}

// Native ops for compiled graphs: no Python on the path when the C++ kernels apply; otherwise the
// specgraph:: custom op (the kernel registry) runs the call. Same arguments and results.
// The variant and the tree mask run in the kernel too; an invalid one goes to the dispatcher, whose
// check says why. kernel_options: the kernel's forms of the slopes (float32) and mask (contiguous).
static bool options_fit(const torch::Tensor& q, int64_t window, double softcap,
                        const c10::optional<torch::Tensor>& alibi_slopes, const c10::optional<torch::Tensor>& tree_mask) {
  return window >= 0 && softcap >= 0.0 && q.dim() == 3 &&
         (!alibi_slopes.has_value() || (alibi_slopes->dim() == 1 && alibi_slopes->size(0) == q.size(1) &&
                                        alibi_slopes->is_floating_point() && alibi_slopes->device().is_cpu())) &&
         (!tree_mask.has_value() || (tree_mask->scalar_type() == torch::kInt && tree_mask->dim() == 2 &&
                                     tree_mask->size(0) == q.size(0) && tree_mask->size(1) >= 1 &&
                                     tree_mask->device().is_cpu()));
}

static std::pair<c10::optional<torch::Tensor>, c10::optional<torch::Tensor>> kernel_options(
    const c10::optional<torch::Tensor>& alibi_slopes, const c10::optional<torch::Tensor>& tree_mask) {
  c10::optional<torch::Tensor> slopes, mask;
  if (alibi_slopes.has_value()) slopes = alibi_slopes->to(torch::kFloat).contiguous();
  if (tree_mask.has_value()) mask = tree_mask->contiguous();
  return {slopes, mask};
}

torch::Tensor native_paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens,
                                     torch::Tensor query_start_loc, torch::Tensor positions, double scale,
                                     int64_t window, double softcap, c10::optional<torch::Tensor> alibi_slopes,
                                     c10::optional<torch::Tensor> tree_mask) {
  const bool fits = options_fit(q, window, softcap, alibi_slopes, tree_mask) && q.scalar_type() == torch::kFloat &&
                    k_cache.scalar_type() == torch::kFloat &&
                    v_cache.scalar_type() == torch::kFloat && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                    block_tables.scalar_type() == torch::kInt && seq_lens.scalar_type() == torch::kInt &&
                    query_start_loc.scalar_type() == torch::kInt && positions.scalar_type() == torch::kLong;
  if (fits) {
    const auto [slopes, mask] = kernel_options(alibi_slopes, tree_mask);
    return paged_attention_short(q.contiguous(), k_cache, v_cache, block_tables.contiguous(), seq_lens.contiguous(),
                                 query_start_loc.contiguous(), positions.contiguous(), scale, window, softcap, slopes,
                                 mask);
  }
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("specgraph::paged_attention", "")
      .typed<torch::Tensor(torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor,
                           torch::Tensor, double, int64_t, double, c10::optional<torch::Tensor>,
                           c10::optional<torch::Tensor>)>();
  return op.call(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, positions, scale, window, softcap,
                 alibi_slopes, tree_mask);
}

// the native twins of specgraph::paged_attention_fp8 / _int4: the kernel where the layout is the
// one quant.py defines (float32 q) and it pays, else the specgraph op (whose checks name any problem)
static bool quant_attention_fits(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                                 const torch::Tensor& k_scale, const torch::Tensor& v_scale, bool int4) {
  if (q.dim() != 3 || q.scalar_type() != torch::kFloat || k_cache.dim() != 4 || !k_cache.sizes().equals(v_cache.sizes()) ||
      !k_cache.is_contiguous() || !v_cache.is_contiguous() || !k_scale.is_contiguous() || !v_scale.is_contiguous() ||
      !q.device().is_cpu() || !k_cache.device().is_cpu())
    return false;
  const int64_t KVH = k_cache.size(2), D = q.size(2);
  if (KVH == 0 || q.size(1) % KVH) return false;
  if (!int4)
    return k_cache.scalar_type() == torch::kFloat8_e4m3fn && v_cache.scalar_type() == torch::kFloat8_e4m3fn &&
           k_cache.size(3) == D && k_scale.scalar_type() == torch::kFloat && v_scale.scalar_type() == torch::kFloat &&
           k_scale.sizes().equals(k_cache.sizes().slice(0, 3)) && v_scale.sizes().equals(k_cache.sizes().slice(0, 3));
  if (k_cache.scalar_type() != torch::kByte || v_cache.scalar_type() != torch::kByte || 2 * k_cache.size(3) != D)
    return false;
  for (const auto* t : {&k_scale, &v_scale}) {
    if (t->scalar_type() != torch::kHalf || t->dim() != 5 || !t->sizes().slice(0, 3).equals(k_cache.sizes().slice(0, 3)) ||
        t->size(4) != 2 || t->size(3) == 0 || D % t->size(3) || (D / t->size(3)) % 2)
      return false;
  }
  return true;
}

template <bool Int4>
torch::Tensor native_quant_paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                           torch::Tensor k_scale, torch::Tensor v_scale, torch::Tensor block_tables,
                                           torch::Tensor seq_lens, torch::Tensor query_start_loc, torch::Tensor positions,
                                           double scale, int64_t window, double softcap,
                                           c10::optional<torch::Tensor> alibi_slopes,
                                           c10::optional<torch::Tensor> tree_mask) {
  const bool fits = options_fit(q, window, softcap, alibi_slopes, tree_mask) &&
                    quant_attention_fits(q, k_cache, v_cache, k_scale, v_scale, Int4) &&
                    block_tables.scalar_type() == torch::kInt && seq_lens.scalar_type() == torch::kInt &&
                    query_start_loc.scalar_type() == torch::kInt && positions.scalar_type() == torch::kLong;
  if (fits) {
    const auto [slopes, mask] = kernel_options(alibi_slopes, tree_mask);
    return paged_attention_quant_short(q.contiguous(), k_cache, v_cache, k_scale, v_scale, block_tables.contiguous(),
                                       seq_lens.contiguous(), query_start_loc.contiguous(), positions.contiguous(),
                                       scale, window, softcap, slopes, mask, Int4 ? "int4" : "fp8");
  }
  static auto op = c10::Dispatcher::singleton()
      .findSchemaOrThrow(Int4 ? "specgraph::paged_attention_int4" : "specgraph::paged_attention_fp8", "")
      .typed<torch::Tensor(torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor,
                           torch::Tensor, torch::Tensor, torch::Tensor, double, int64_t, double,
                           c10::optional<torch::Tensor>, c10::optional<torch::Tensor>)>();
  return op.call(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, query_start_loc, positions, scale,
                 window, softcap, alibi_slopes, tree_mask);
}

// whether the quantized kernel takes a call (for the registry's "cpp" implementation)
bool quant_attention_applies(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k_scale,
                             torch::Tensor v_scale, std::string scheme) {
  return quant_attention_fits(q, k_cache, v_cache, k_scale, v_scale, scheme == "int4");
}

void native_cache_write(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
                        torch::Tensor slot_mapping) {
  const auto dt = k_cache.scalar_type();
  if (k.scalar_type() == dt && v.scalar_type() == dt && v_cache.scalar_type() == dt && k_cache.is_contiguous() &&
      v_cache.is_contiguous() && slot_mapping.scalar_type() == torch::kLong && k.dim() == 3 && v.sizes() == k.sizes() &&
      k_cache.dim() == 4 && k.size(1) == k_cache.size(2) && k.size(2) == k_cache.size(3) &&
      slot_mapping.dim() == 1 && slot_mapping.size(0) == k.size(0)) {
    cache_write_rows(k.contiguous(), v.contiguous(), k_cache, v_cache, slot_mapping.contiguous());
    return;
  }
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("specgraph::cache_write", "")
      .typed<void(torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor)>();
  op.call(k, v, k_cache, v_cache, slot_mapping);
}

TORCH_LIBRARY(specgraph_cpu, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "Tensor query_start_loc, Tensor positions, float scale, int window=0, float softcap=0.0, "
        "Tensor? alibi_slopes=None, Tensor? tree_mask=None) -> Tensor");
  m.def("cache_write(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
#define SPECGRAPH_QUANT_ATTENTION_SCHEMA(scheme)                                                                   \
  "paged_attention_" scheme "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor k_scale, Tensor v_scale, "          \
  "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, Tensor positions, float scale, int window=0, "   \
  "float softcap=0.0, Tensor? alibi_slopes=None, Tensor? tree_mask=None) -> Tensor"
  m.def(SPECGRAPH_QUANT_ATTENTION_SCHEMA("fp8"));
  m.def(SPECGRAPH_QUANT_ATTENTION_SCHEMA("int4"));
#undef SPECGRAPH_QUANT_ATTENTION_SCHEMA
}

TORCH_LIBRARY_IMPL(specgraph_cpu, CPU, m) {
  m.impl("paged_attention", &native_paged_attention);
  m.impl("cache_write", &native_cache_write);
  m.impl("paged_attention_fp8", &native_quant_paged_attention<false>);
  m.impl("paged_attention_int4", &native_quant_paged_attention<true>);
}
