// Linears over quantized weights on CPU: specgraph::quant_linear (formats and contract in quant_linear.py).
//
// int4 weights: the activations are rounded per row and block of 32 columns to int8 codes (the
// op's contract), and each block's product is an integer dot product: the nibbles unpacked to
// bytes, AVX2 vpmaddubsw (unsigned codes x signed activations -> int16 pairs) + vpmaddwd (->
// int32), 32 products in two instructions; four weight rows' products are summed as integers and
// take one float FMA by the block's scales, their min terms (min_g * sum_g(x)) another (int4_tile).
// int8 / fp8 / bfloat16 weights: widened to float in registers (int8 by two conversions, fp8
// through float16 bits and F16C, bfloat16 by a shift) and multiplied by float activations.
// bfloat16 weights on a CPU with native bf16 dot products (AVX512_BF16 vdpbf16ps), when the
// process switch says they pay (set by measurement, cpu_kernels.choose_bf16_products): each row
// of x is split once per call into two bfloat16 parts, hi = bf16(x) and lo = bf16(x - hi), and
// hi.w + lo.w runs on vdpbf16ps (32 products per instruction, no widening): |x - hi - lo| <=
// 2^-18 |x|, so the result is within 2^-17 of |x|.|w| of the widened one. vdpbf16ps has one port
// where FMA has two, so this pays only where widening costs more than the doubled products. The
// switch holds for every row count: a row of x gets the same numbers whichever call it is in
// (batch invariance: a decode and a verify of the same token agree bit for bit).
//
// Tiling: each thread owns a range of output channels; a tile is R rows of x by NB weight rows
// (NB = 4 for one row of x and for int4, else 2), so each weight byte is loaded once per R rows (R up to 4).
// Large row counts loop over chunks of weight rows that stay in L2 while every 4-row tile of x
// passes over them. The weight streams are prefetched g_ahead bytes ahead (without it, weight rows
// streamed at 15 GB/s instead of 19). Without AVX2 the same numbers come from scalar loops.
//
// Batch invariance: an output's accumulation is the same whatever tile (R, NB) computes it, and
// threads split outputs only, so a row of x gets the same numbers in a call of any row count. The
// extension is built with -ffast-math, which let the compiler reassociate and contract each tile's
// epilogue (horizontal sums, scale, bias) differently per tile shape: 1-ulp differences between a
// decode's row and the same row in a verify. The tiles below are compiled without reassociation
// or contraction, so every tile reduces in the order written (their inner loops are intrinsics;
// int4 became about 10% faster, the other formats unchanged). The activation rounding
// (quantize_rows, above) keeps -ffast-math: it is per row, and was 12% slower without it.
namespace specgraph_qlinear {

constexpr int64_t kBlock = 32;  // activation block (quant_linear.ACT_BLOCK)
constexpr float kActMax = 127.f;  // quant_linear.ACT_MAX
constexpr int64_t kChunk = 32;  // weight rows per L2-resident chunk when x has many rows
// bytes prefetched ahead of a weight stream: process-wide, set by measurement (kernels/prefetch.py;
// SmolLM2's int8 linears on an Intel Xeon, 1 row: 5.0 ms at 2 KiB ahead, 3.6 at 8 KiB)
static int64_t g_ahead = 2048;

// Activations of one call, rounded: codes [M, K], each block's columns reordered even first (to
// line up with the weight nibbles), per-block steps [M, K / 32] and step * sum(codes) per block.
struct QuantizedRows {
  std::vector<int8_t> codes;
  std::vector<float> scale;
  std::vector<float> scaled_sum;
  std::vector<uint16_t> bf16_hi, bf16_lo;  // bfloat16 weights on native dots: x's two bf16 parts [M, K]
};

// whether bfloat16 weights run on native bf16 dot products (at every row count of x)
static bool g_bf16_dots = false;

static bool bf16_dot_available() {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
static void split_bf16_rows(const float* x, int64_t M, int64_t K, QuantizedRows* q) {
  q->bf16_hi.resize(M * K);
  q->bf16_lo.resize(M * K);
  for (int64_t i = 0; i < M * K; i += 16) {  // K % 32 == 0 (kernel_applies)
    const __m512 v = _mm512_loadu_ps(x + i);
    const __m256bh hi = _mm512_cvtneps_pbh(v);
    const __m512 hi_f = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)hi), 16));
    const __m256bh lo = _mm512_cvtneps_pbh(_mm512_sub_ps(v, hi_f));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q->bf16_hi.data() + i), (__m256i)hi);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q->bf16_lo.data() + i), (__m256i)lo);
  }
}
#endif

static QuantizedRows quantize_rows(const float* x, int64_t M, int64_t K) {
  const int64_t KB = K / kBlock;
  QuantizedRows q{std::vector<int8_t>(M * K), std::vector<float>(M * KB), std::vector<float>(M * KB)};
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < KB; ++b) {
      const float* xb = x + m * K + b * kBlock;
      int8_t* cb = q.codes.data() + m * K + b * kBlock;
      float amax = 0.f;
      for (int64_t i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
      const float inv = amax > 0.f ? kActMax / amax : 0.f;
      int sum = 0;
#ifdef SPECGRAPH_AVX2
      const __m256 vinv = _mm256_set1_ps(inv);
      __m256i c[4];
      for (int i = 0; i < 4; ++i)
        c[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + 8 * i), vinv),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      // int32 -> int8 (within +-127): the packs work per 128-bit lane, the permute restores the order
      __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
      packed = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      // even columns first: per lane 8 even bytes then 8 odd ones, then the lanes' halves regrouped
      const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                             0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
      packed = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(packed, split), 0xD8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(cb), packed);
      for (int64_t i = 0; i < kBlock; ++i) sum += cb[i];
#else
      for (int64_t i = 0; i < kBlock; ++i) {
        const int8_t code = static_cast<int8_t>(std::nearbyint(xb[i] * inv));
        cb[(i % 2) * (kBlock / 2) + i / 2] = code;
        sum += code;
      }
#endif
      q.scale[m * KB + b] = amax / kActMax;
      q.scaled_sum[m * KB + b] = amax / kActMax * static_cast<float>(sum);
    }
  }
  return q;
}

#pragma GCC push_options
#pragma GCC optimize("no-associative-math", "fp-contract=off")

#ifdef SPECGRAPH_AVX2
static inline __m256i load32(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }

// the 32 int4 codes of bytes p[0..15]: even columns in the low lane, odd ones in the high lane (the
// 16 bytes in both lanes, the high lane's 32-bit words shifted right by 4, then each byte masked)
static inline __m256i unpack_int4(const uint8_t* p) {
  const __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_and_si256(_mm256_srlv_epi32(both, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)), _mm256_set1_epi8(0x0F));
}

// The float16 (scale, min) pairs of group g of four int4 weight rows (rows[j]: row j's params),
// as floats [scale_0..3, min_0..3]: each pair is one 32-bit load, one shuffle and one conversion
// serve the four rows.
static inline __m256 int4_params(const at::Half* const rows[4], int64_t g) {
  int32_t pair[4];
  for (int j = 0; j < 4; ++j) std::memcpy(&pair[j], rows[j] + 2 * g, 4);
  const __m128i halves = _mm_setr_epi32(pair[0], pair[1], pair[2], pair[3]);  // [s0 m0 s1 m1 s2 m2 s3 m3]
  return _mm256_cvtph_ps(
      _mm_shuffle_epi8(halves, _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15)));
}

// [sum(d0), sum(d1), sum(d2), sum(d3)] of four vectors of 8 int32 (exact: integer adds)
static inline __m128i sum_lanes4(__m256i d0, __m256i d1, __m256i d2, __m256i d3) {
  const __m256i a = _mm256_add_epi32(_mm256_unpacklo_epi32(d0, d1), _mm256_unpackhi_epi32(d0, d1));
  const __m256i b = _mm256_add_epi32(_mm256_unpacklo_epi32(d2, d3), _mm256_unpackhi_epi32(d2, d3));
  const __m256i s = _mm256_add_epi32(_mm256_unpacklo_epi64(a, b), _mm256_unpackhi_epi64(a, b));
  return _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
}

// y[r, n + j] for R rows of x and the int4 weight rows n .. n + valid - 1 (valid <= 4; the missing
// rows of a short tile repeat the last one and are not stored): packed [N, K / 2], params
// [N, K / G, 2] float16 (scale, min).
// Each output accumulates, per block of 32 columns, its exact integer dot product d (the nibbles
// times the activation codes: maddubs, madd, then the four rows' eight lanes summed as integers)
// and the block's min term, in one 8-lane register per row of x: lanes 0-3 acc = fma(float(d),
// sx * scale, acc), lanes 4-7 acc = fma(ssum, min, acc); the output is their sum plus the bias.
// Every output gets the same float operations whichever lane, tile or call computes it (batch
// invariance), and scalar_output below repeats them for the builds without AVX2. On an AMD EPYC
// (AVX2, no AVX-512) the previous tile (one float FMA per 8 lanes per weight row, the float16 scales
// converted one at a time, NB = 2 for several rows of x) bound the int4 linears by instructions, not
// memory: SmolLM2's linears (the int8 LM head included) took 0.92x its time for one row of x and
// 0.75-0.77x for 2 to 16 rows (benchmarks/ab_kernel.py --scheme int4 --differ).
template <int R>
static inline void int4_tile(const QuantizedRows& q, int64_t m0, const uint8_t* w, const at::Half* params,
                             int64_t G, const float* b, float* y, int64_t K, int64_t N, int64_t n, int valid) {
  const int64_t KB = K / kBlock, NG = K / G, per_group = G / kBlock;
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256 unit = _mm256_set1_ps(1.f);
  const uint8_t* rows[4];
  const at::Half* row_params[4];
  for (int j = 0; j < 4; ++j) {
    const int64_t row = n + std::min(j, valid - 1);
    rows[j] = w + row * (K / 2);
    row_params[j] = params + row * NG * 2;
  }
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < NG; ++g) {
    const __m256 scale_min = int4_params(row_params, g);
    for (int64_t blk = g * per_group; blk < (g + 1) * per_group; ++blk) {
      __m256i wv[4];
      for (int j = 0; j < 4; ++j) {
        const uint8_t* p = rows[j] + blk * (kBlock / 2);
        wv[j] = unpack_int4(p);
        if ((blk & 3) == 0) prefetch(p + g_ahead);
      }
      for (int r = 0; r < R; ++r) {
        const __m256i xv = load32(q.codes.data() + (m0 + r) * K + blk * kBlock);
        const float sx = q.scale[(m0 + r) * KB + blk], ssum = q.scaled_sum[(m0 + r) * KB + blk];
        // codes <= 15 and |x| <= 127: each int16 pair sum is within range
        __m256i d[4];
        for (int j = 0; j < 4; ++j) d[j] = _mm256_madd_epi16(_mm256_maddubs_epi16(wv[j], xv), ones);
        const __m128 dots = _mm_cvtepi32_ps(sum_lanes4(d[0], d[1], d[2], d[3]));  // exact (|d| < 2^16)
        const __m256 terms = _mm256_insertf128_ps(_mm256_castps128_ps256(dots), _mm_set1_ps(ssum), 1);
        const __m256 factors = _mm256_mul_ps(scale_min, _mm256_blend_ps(_mm256_set1_ps(sx), unit, 0xF0));
        acc[r] = _mm256_fmadd_ps(terms, factors, acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    float out[4];
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1)));
    for (int j = 0; j < valid; ++j) y[(m0 + r) * N + n + j] = out[j] + (b ? b[n + j] : 0.f);
  }
}

// every row of x in [m0, m1) against int4 weight rows [n0, n1): tiles of up to 4 rows of x by 4 weight rows
static inline void int4_rows(const QuantizedRows& q, int64_t m0, int64_t m1, const uint8_t* w, const at::Half* params,
                             int64_t G, const float* b, float* y, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; n += 4) {
    const int valid = static_cast<int>(std::min<int64_t>(4, n1 - n));
    for (int64_t m = m0; m < m1; m += 4) {
      switch (std::min<int64_t>(4, m1 - m)) {
        case 4: int4_tile<4>(q, m, w, params, G, b, y, K, N, n, valid); break;
        case 3: int4_tile<3>(q, m, w, params, G, b, y, K, N, n, valid); break;
        case 2: int4_tile<2>(q, m, w, params, G, b, y, K, N, n, valid); break;
        case 1: int4_tile<1>(q, m, w, params, G, b, y, K, N, n, valid); break;
      }
    }
  }
}

// 8 weights widened to float: bfloat16 by a shift; fp8 (e4m3) bits moved into float16 fields
// (the float16 number is value * 2^-8 exactly, subnormals included; 2^8 goes into the scale)
// (load16: the same for 16 weights, where the compiler targets AVX-512)
struct Bf16Weights {
  using T = at::BFloat16;
  static inline __m256 load8(const T* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
#ifdef __AVX512F__
  static inline __m512 load16(const T* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
#endif
};
struct Int8Weights {
  using T = int8_t;
  static inline __m256 load8(const T* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
#ifdef __AVX512F__
  static inline __m512 load16(const T* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
#endif
};
struct Fp8Weights {
  using T = uint8_t;
  static inline __m256 load8(const T* p) {
    const __m128i u = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(u, _mm_set1_epi16(0x80)), 8),
                                   _mm_slli_epi16(_mm_and_si128(u, _mm_set1_epi16(0x7F)), 7));
    return _mm256_cvtph_ps(h);
  }
#ifdef __AVX512F__
  static inline __m512 load16(const T* p) {
    const __m256i u = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(u, _mm256_set1_epi16(0x80)), 8),
                                      _mm256_slli_epi16(_mm256_and_si256(u, _mm256_set1_epi16(0x7F)), 7));
    return _mm512_cvtph_ps(h);
  }
#endif
};

// A vector width for the widening loop: 8 floats (AVX2) or, where the compiler targets AVX-512,
// 16 (on a compute-bound widening, about 1.3x the 8-wide loop).
struct Lanes8 {
  using V = __m256;
  static constexpr int64_t kWidth = 8;
  static inline V zero() { return _mm256_setzero_ps(); }
  static inline V load(const float* p) { return _mm256_loadu_ps(p); }
  static inline V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static inline float sum(V v) { return hsum8(v); }
  template <class W>
  static inline V widen(const typename W::T* p) { return W::load8(p); }
};
#ifdef __AVX512F__
struct Lanes16 {
  using V = __m512;
  static constexpr int64_t kWidth = 16;
  static inline V zero() { return _mm512_setzero_ps(); }
  static inline V load(const float* p) { return _mm512_loadu_ps(p); }
  static inline V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static inline float sum(V v) { return _mm512_reduce_add_ps(v); }
  template <class W>
  static inline V widen(const typename W::T* p) { return W::load16(p); }
};
#endif

// y[r, n + j] for R rows of float x and NB weight rows (int8 / fp8 / bfloat16), times the row's
// scale (or 1), L::kWidth weights per instruction
template <class L, class W, int R, int NB>
static inline void widened_lanes(const float* x, int64_t m0, const typename W::T* w, const float* ws, float unit,
                                 const float* b, float* y, int64_t K, int64_t N, int64_t n) {
  typename L::V acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = L::zero();
  for (int64_t k = 0; k < K; k += L::kWidth) {
    typename L::V wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = L::template widen<W>(w + (n + j) * K + k);
    if (k % (64 / sizeof(typename W::T)) == 0)  // one prefetch per 64-byte line
      for (int j = 0; j < NB; ++j) prefetch(reinterpret_cast<const char*>(w + (n + j) * K + k) + g_ahead);
    for (int r = 0; r < R; ++r) {
      const typename L::V xv = L::load(x + (m0 + r) * K + k);
      for (int j = 0; j < NB; ++j) acc[r][j] = L::fma(wv[j], xv, acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j)
      y[(m0 + r) * N + n + j] = L::sum(acc[r][j]) * (ws ? ws[n + j] * unit : 1.f) + (b ? b[n + j] : 0.f);
}

template <class W, int R, int NB>
static inline void widened_tile(const float* x, int64_t m0, const typename W::T* w, const float* ws, float unit,
                                const float* b, float* y, int64_t K, int64_t N, int64_t n) {
#ifdef __AVX512F__
  if (K % 16 == 0) return widened_lanes<Lanes16, W, R, NB>(x, m0, w, ws, unit, b, y, K, N, n);
#endif
  widened_lanes<Lanes8, W, R, NB>(x, m0, w, ws, unit, b, y, K, N, n);
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// y[r, n + j] for R rows of x (as its two bf16 parts) and NB bfloat16 weight rows, on vdpbf16ps
template <int R, int NB>
static inline void bf16_dot_tile(const QuantizedRows& q, int64_t m0, const at::BFloat16* w, const float* b, float* y,
                                 int64_t K, int64_t N, int64_t n) {
  __m512 acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {  // 32 weights = one 64-byte line per row
    __m512bh wv[NB];
    for (int j = 0; j < NB; ++j) {
      const at::BFloat16* p = w + (n + j) * K + k;
      wv[j] = (__m512bh)_mm512_loadu_si512(p);
      prefetch(reinterpret_cast<const char*>(p) + g_ahead);
    }
    for (int r = 0; r < R; ++r) {
      const __m512bh hi = (__m512bh)_mm512_loadu_si512(q.bf16_hi.data() + (m0 + r) * K + k);
      const __m512bh lo = (__m512bh)_mm512_loadu_si512(q.bf16_lo.data() + (m0 + r) * K + k);
      for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[r][j], lo, wv[j]), hi, wv[j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) y[(m0 + r) * N + n + j] = _mm512_reduce_add_ps(acc[r][j]) + (b ? b[n + j] : 0.f);
}
#endif
#endif

// One call's weights: the storage and its scales (int8/fp8: float32 per row; int4: float16
// (scale, min) per group of G columns; bfloat16: none).
struct Weights {
  enum Kind { kInt8, kInt4, kFp8, kBf16 } kind;
  const void* data;
  const float* row_scale;
  const at::Half* params;
  int64_t G;
};

// Scalar path (no AVX2; and int8 / fp8 / bfloat16: a range's odd last weight row), one output at a time:
// int4 with int4_tile's float operations exactly (bit for bit, tests/test_quantize_weights.py builds it
// with -mno-avx2); the widened formats with the same products summed in another order.
static float scalar_output(const Weights& wt, const float* x, const QuantizedRows& q, int64_t m, int64_t K,
                           int64_t n) {
  const int64_t KB = K / kBlock;
  if (wt.kind == Weights::kInt4) {
    float acc = 0.f, min_acc = 0.f;
    for (int64_t blk = 0; blk < KB; ++blk) {
      const int8_t* xc = q.codes.data() + m * K + blk * kBlock;  // even columns first
      const uint8_t* p = static_cast<const uint8_t*>(wt.data) + n * (K / 2) + blk * (kBlock / 2);
      int dot = 0;
      for (int64_t i = 0; i < kBlock / 2; ++i) dot += (p[i] & 0x0F) * xc[i] + (p[i] >> 4) * xc[kBlock / 2 + i];
      const at::Half* pg = wt.params + (n * (K / wt.G) + blk * kBlock / wt.G) * 2;
      acc = std::fma(static_cast<float>(dot), static_cast<float>(pg[0]) * q.scale[m * KB + blk], acc);
      min_acc = std::fma(q.scaled_sum[m * KB + blk], static_cast<float>(pg[1]), min_acc);
    }
    return acc + min_acc;
  }
  float out = 0.f;
  for (int64_t k = 0; k < K; ++k) {
    const float wv = wt.kind == Weights::kBf16   ? static_cast<float>(static_cast<const at::BFloat16*>(wt.data)[n * K + k])
                     : wt.kind == Weights::kInt8 ? static_cast<float>(static_cast<const int8_t*>(wt.data)[n * K + k])
                         : static_cast<float>(static_cast<const c10::Float8_e4m3fn*>(wt.data)[n * K + k]);
    out += wv * x[m * K + k];
  }
  return wt.kind == Weights::kBf16 ? out : out * wt.row_scale[n];
}

#ifdef SPECGRAPH_AVX2
template <int R, int NB>
static inline void tile(const Weights& wt, const float* x, const QuantizedRows& q, int64_t m0, const float* b,
                        float* y, int64_t K, int64_t N, int64_t n) {
  switch (wt.kind) {
    case Weights::kInt8:
      widened_tile<Int8Weights, R, NB>(x, m0, static_cast<const int8_t*>(wt.data), wt.row_scale, 1.f, b, y, K, N, n);
      break;
    case Weights::kInt4:  // (int4_rows)
      break;
    case Weights::kFp8:
      widened_tile<Fp8Weights, R, NB>(x, m0, static_cast<const uint8_t*>(wt.data), wt.row_scale, 256.f, b, y, K,
                                      N, n);
      break;
    case Weights::kBf16:
#if defined(__AVX512BF16__) && defined(__AVX512F__)
      if (!q.bf16_hi.empty()) return bf16_dot_tile<R, NB>(q, m0, static_cast<const at::BFloat16*>(wt.data), b, y, K, N, n);
#endif
      widened_tile<Bf16Weights, R, NB>(x, m0, static_cast<const at::BFloat16*>(wt.data), nullptr, 1.f, b, y, K, N,
                                       n);
      break;
  }
}

// every row of x against weight rows [n0, n1), NB = 2 at a time (int4: int4_rows)
static void rows_range(const Weights& wt, const float* x, const QuantizedRows& q, int64_t m0, int64_t m1,
                       const float* b, float* y, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  if (wt.kind == Weights::kInt4)
    return int4_rows(q, m0, m1, static_cast<const uint8_t*>(wt.data), wt.params, wt.G, b, y, K, N, n0, n1);
  int64_t n = n0;
  if (m1 - m0 == 1)
    for (; n + 4 <= n1; n += 4) tile<1, 4>(wt, x, q, m0, b, y, K, N, n);
  for (; n + 2 <= n1; n += 2) {
    int64_t m = m0;
    for (; m + 4 <= m1; m += 4) tile<4, 2>(wt, x, q, m, b, y, K, N, n);
    switch (m1 - m) {
      case 3: tile<3, 2>(wt, x, q, m, b, y, K, N, n); break;
      case 2: tile<2, 2>(wt, x, q, m, b, y, K, N, n); break;
      case 1: tile<1, 2>(wt, x, q, m, b, y, K, N, n); break;
    }
  }
  for (; n < n1; ++n)
    for (int64_t m = m0; m < m1; ++m) y[m * N + n] = scalar_output(wt, x, q, m, K, n) + (b ? b[n] : 0.f);
}
#endif

static void outputs_range(const Weights& wt, const float* x, const QuantizedRows& q, int64_t M, const float* b,
                          float* y, int64_t K, int64_t N, int64_t n0, int64_t n1) {
#ifdef SPECGRAPH_AVX2
  const bool aligned = wt.kind == Weights::kInt4 || K % 8 == 0;
  if (aligned) {
    if (M <= 4) {
      rows_range(wt, x, q, 0, M, b, y, K, N, n0, n1);
    } else {  // a chunk of weight rows stays in L2 while every 4-row tile of x passes over it
      for (int64_t c = n0; c < n1; c += kChunk)
        for (int64_t m = 0; m < M; m += 4)
          rows_range(wt, x, q, m, std::min(m + 4, M), b, y, K, N, c, std::min(c + kChunk, n1));
    }
    return;
  }
#endif
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m) y[m * N + n] = scalar_output(wt, x, q, m, K, n) + (b ? b[n] : 0.f);
}

static bool parse_scheme(c10::string_view scheme, Weights::Kind* kind) {
  if (scheme == "int8") *kind = Weights::kInt8;
  else if (scheme == "int4") *kind = Weights::kInt4;
  else if (scheme == "fp8") *kind = Weights::kFp8;
  else if (scheme == "bfloat16") *kind = Weights::kBf16;
  else return false;
  return true;
}

// whether the kernel takes this call (else the specgraph:: op, whose checks name any problem)
static bool kernel_applies(const torch::Tensor& x, const torch::Tensor& weight, const c10::optional<torch::Tensor>& scales,
                           const c10::optional<torch::Tensor>& bias, c10::string_view scheme) {
  Weights::Kind kind;
  if (!parse_scheme(scheme, &kind) || !x.device().is_cpu() || x.scalar_type() != torch::kFloat || x.dim() < 1 ||
      weight.dim() != 2 || !weight.is_contiguous())
    return false;
  const int64_t N = weight.size(0), K = kind == Weights::kInt4 ? 2 * weight.size(1) : weight.size(1);
  if (x.size(-1) != K) return false;
  if (bias.has_value() && (bias->scalar_type() != torch::kFloat || bias->dim() != 1 || bias->size(0) != N))
    return false;
  switch (kind) {
    case Weights::kInt8:
    case Weights::kFp8:
      return weight.scalar_type() == (kind == Weights::kInt8 ? torch::kChar : torch::kFloat8_e4m3fn) &&
             scales.has_value() &&
             scales->scalar_type() == torch::kFloat && scales->dim() == 1 && scales->size(0) == N &&
             scales->is_contiguous();
    case Weights::kInt4: {
      if (weight.scalar_type() != torch::kByte || K % kBlock || !scales.has_value() || scales->dim() != 3 ||
          scales->scalar_type() != torch::kHalf || scales->size(0) != N || scales->size(2) != 2 ||
          !scales->is_contiguous() || scales->size(1) == 0 || K % scales->size(1))
        return false;
      const int64_t G = K / scales->size(1);
      return G == 32 || G == 64;
    }
    case Weights::kBf16:
      return weight.scalar_type() == torch::kBFloat16 && !scales.has_value();
  }
  return false;
}

static torch::Tensor run(const torch::Tensor& x, const torch::Tensor& weight, const c10::optional<torch::Tensor>& scales,
                         const c10::optional<torch::Tensor>& bias, c10::string_view scheme) {
  Weights wt{};
  parse_scheme(scheme, &wt.kind);
  auto xs = x.reshape({-1, x.size(-1)}).contiguous();
  const int64_t M = xs.size(0), K = xs.size(1), N = weight.size(0);
  wt.data = weight.data_ptr();
  if (wt.kind == Weights::kInt8 || wt.kind == Weights::kFp8) wt.row_scale = scales->data_ptr<float>();
  if (wt.kind == Weights::kInt4) {
    wt.params = scales->data_ptr<at::Half>();
    wt.G = K / scales->size(1);
  }
  torch::Tensor bc = bias.has_value() ? bias->contiguous() : torch::Tensor();
  const float* bp = bias.has_value() ? bc.data_ptr<float>() : nullptr;
  const float* xp = xs.data_ptr<float>();
  QuantizedRows q = wt.kind == Weights::kInt4 ? quantize_rows(xp, M, K) : QuantizedRows{};
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  if (wt.kind == Weights::kBf16 && g_bf16_dots && K % 32 == 0)
    split_bf16_rows(xp, M, K, &q);
#endif
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  auto y = torch::empty({M, N}, x.options());
  float* yp = y.data_ptr<float>();
  const int64_t T = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), N / 64));
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      // even range boundaries, so every tile holds two weight rows
      const int64_t n0 = (N * t / T) & ~int64_t(1), n1 = t + 1 == T ? N : (N * (t + 1) / T) & ~int64_t(1);
      outputs_range(wt, xp, q, M, bp, yp, K, N, n0, n1);
    }
  });
  return y.view(out_shape);
}

}  // namespace specgraph_qlinear

#pragma GCC pop_options

// specgraph_cpu::quant_linear, the twin of specgraph::quant_linear: the kernel where it applies,
// otherwise the specgraph:: op (its registry), with the same arguments and result.
torch::Tensor native_quant_linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> scales,
                                  c10::optional<torch::Tensor> bias, c10::string_view scheme) {
  if (specgraph_qlinear::kernel_applies(x, weight, scales, bias, scheme))
    return specgraph_qlinear::run(x, weight, scales, bias, scheme);
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("specgraph::quant_linear", "")
      .typed<torch::Tensor(torch::Tensor, torch::Tensor, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>,
                           c10::string_view)>();
  return op.call(x, weight, scales, bias, scheme);
}

// for the registry's "cpp" implementation (Python checks the arguments first)
torch::Tensor quant_linear_cpu(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> scales,
                               c10::optional<torch::Tensor> bias, std::string scheme) {
  TORCH_CHECK(specgraph_qlinear::kernel_applies(x, weight, scales, bias, scheme),
              "quant_linear_cpu: arguments the C++ kernel does not take");
  return specgraph_qlinear::run(x, weight, scales, bias, scheme);
}

// sets how many bytes ahead the weight streams are prefetched; returns the previous distance
int64_t set_quant_prefetch(int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "set_quant_prefetch: the distance must be >= 0 bytes; got ", bytes);
  const int64_t previous = specgraph_qlinear::g_ahead;
  specgraph_qlinear::g_ahead = bytes;
  return previous;
}

// the process switch for bfloat16 weights: native bf16 dot products at every row count of x, or
// widening (a build without the instructions always widens); returns the previous value
bool set_bf16_dots(bool on) {
  const bool previous = specgraph_qlinear::g_bf16_dots;
  specgraph_qlinear::g_bf16_dots = on && specgraph_qlinear::bf16_dot_available();
  return previous;
}

bool bf16_dot_available() { return specgraph_qlinear::bf16_dot_available(); }

bool quant_linear_applies(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> scales,
                          c10::optional<torch::Tensor> bias, std::string scheme) {
  return specgraph_qlinear::kernel_applies(x, weight, scales, bias, scheme);
}

TORCH_LIBRARY_FRAGMENT(specgraph_cpu, m) {
  m.def("quant_linear(Tensor x, Tensor weight, Tensor? scales, Tensor? bias, str scheme) -> Tensor");
}

TORCH_LIBRARY_IMPL(specgraph_cpu, CPU, m) {
  m.impl("quant_linear", &native_quant_linear);
}
