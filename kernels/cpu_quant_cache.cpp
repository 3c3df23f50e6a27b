// Quantized cache writes on CPU: specgraph_cpu::cache_write_fp8 / _int4 (layouts in quant.py), bit-exact
// with quant_cache_write.py's references: the same float32 operations in the same order. Two things
// keep -ffast-math (the extension's flag) from changing a bit: every division is _mm_div_ss (a
// builtin, never rewritten into a multiplication by the reciprocal), and float16 conversions are
// F16C's cvtss2sh / cvtsh_ss (round to nearest even), not arithmetic tricks the optimizer may fold
// (CPUs without AVX2/F16C take c10's conversions and a volatile divisor instead).
// One work item per (token, kv head) row; padding slots (< 0) are skipped.

namespace specgraph_qcache {

constexpr float kFp8Max = 448.f;  // quant.FP8_MAX
constexpr float kFp16Max = 65504.f;  // quant.FP16_MAX
constexpr float kInt4MaxCode = 15.f;  // quant.INT4_MAX_CODE

#ifdef SPECGRAPH_AVX2
static inline float div_rn(float a, float b) { return _mm_cvtss_f32(_mm_div_ss(_mm_set_ss(a), _mm_set_ss(b))); }
static inline uint16_t to_half_bits(float x) { return _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT); }
static inline float from_half_bits(uint16_t h) { return _cvtsh_ss(h); }
#else  // (a volatile divisor: no reciprocal can be shared between divisions)
static inline float div_rn(float a, float b) {
  volatile float divisor = b;
  return a / divisor;
}
static inline uint16_t to_half_bits(float x) { return c10::Half(x).x; }
static inline float from_half_bits(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }
#endif

// the largest float16 <= x and the smallest float16 >= x (x within +-65504), as bits
static inline uint16_t half_round_down(float x) {
  uint16_t h = to_half_bits(x);
  if (from_half_bits(h) > x) h = h == 0x0000 ? 0x8001 : (h & 0x8000) ? h + 1 : h - 1;  // one step toward -inf
  return h;
}
static inline uint16_t half_round_up(float x) {
  uint16_t h = to_half_bits(x);
  if (from_half_bits(h) < x) h = h == 0x8000 ? 0x0001 : (h & 0x8000) ? h - 1 : h + 1;  // one step toward +inf
  return h;
}

// quant.quantize_fp8 of one row: scale = amax / 448 (1 when 0), e4m3 = rne(clamp(x / scale))
static void fp8_row(const float* x, int64_t D, uint8_t* out, float* scale_out) {
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(x[d]));
  float scale = div_rn(amax, kFp8Max);
  if (!(scale > 0.f)) scale = 1.f;
  for (int64_t d = 0; d < D; ++d) {
    const float y = std::min(std::max(div_rn(x[d], scale), -kFp8Max), kFp8Max);
    out[d] = c10::Float8_e4m3fn(y).x;
  }
  *scale_out = scale;
}

// quant.quantize_int4 of one row, groups of G: (scale, min) float16 per group, codes 0..15 packed
// two per byte (element 2i in the low nibble of byte i)
static void int4_row(const float* x, int64_t D, int64_t G, uint8_t* out, uint16_t* params) {
  float xs[256];  // one group, clamped (G <= D <= 256: checked by the caller)
  for (int64_t g0 = 0; g0 < D; g0 += G) {
    float lo = kFp16Max, hi = -kFp16Max;
    for (int64_t i = 0; i < G; ++i) {
      xs[i] = std::min(std::max(x[g0 + i], -kFp16Max), kFp16Max);
      lo = std::min(lo, xs[i]);
      hi = std::max(hi, xs[i]);
    }
    const uint16_t min16 = half_round_down(lo);
    const float mn = from_half_bits(min16);
    const uint16_t scale16 = half_round_up(div_rn(hi - mn, kInt4MaxCode));
    const float scale = from_half_bits(scale16);
    const float divisor = scale > 0.f ? scale : 1.f;
    for (int64_t i = 0; i < G; i += 2) {
      const float c0 = std::min(std::max(std::nearbyint(div_rn(xs[i] - mn, divisor)), 0.f), kInt4MaxCode);
      const float c1 = std::min(std::max(std::nearbyint(div_rn(xs[i + 1] - mn, divisor)), 0.f), kInt4MaxCode);
      out[(g0 + i) / 2] = static_cast<uint8_t>(c0) | static_cast<uint8_t>(static_cast<uint8_t>(c1) << 4);
    }
    params[(g0 / G) * 2] = scale16;
    params[(g0 / G) * 2 + 1] = min16;
  }
}

// whether the C++ write takes the call: float32 rows [N, KVH, D] and the layout quant.py defines
static bool write_fits(const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& k_cache,
                       const torch::Tensor& v_cache, const torch::Tensor& k_scale, const torch::Tensor& v_scale,
                       const torch::Tensor& slot_mapping, bool int4) {
  if (k.dim() != 3 || !k.sizes().equals(v.sizes()) || k.scalar_type() != torch::kFloat ||
      v.scalar_type() != torch::kFloat || !k.device().is_cpu() || k_cache.dim() != 4 ||
      !k_cache.sizes().equals(v_cache.sizes()) || !k_cache.is_contiguous() || !v_cache.is_contiguous() ||
      !k_scale.is_contiguous() || !v_scale.is_contiguous() || slot_mapping.dim() != 1 ||
      slot_mapping.scalar_type() != torch::kLong || slot_mapping.size(0) != k.size(0) || k.size(1) != k_cache.size(2))
    return false;
  const int64_t D = k.size(2);
  if (!int4)
    return k_cache.scalar_type() == torch::kFloat8_e4m3fn && v_cache.scalar_type() == torch::kFloat8_e4m3fn &&
           k_cache.size(3) == D && k_scale.scalar_type() == torch::kFloat && v_scale.scalar_type() == torch::kFloat &&
           k_scale.sizes().equals(k_cache.sizes().slice(0, 3)) && v_scale.sizes().equals(k_cache.sizes().slice(0, 3));
  if (k_cache.scalar_type() != torch::kByte || v_cache.scalar_type() != torch::kByte || 2 * k_cache.size(3) != D ||
      D > 256)
    return false;
  for (const auto* t : {&k_scale, &v_scale})
    if (t->scalar_type() != torch::kHalf || t->dim() != 5 || !t->sizes().slice(0, 3).equals(k_cache.sizes().slice(0, 3)) ||
        t->size(4) != 2 || t->size(3) == 0 || D % t->size(3) || (D / t->size(3)) % 2)
      return false;
  return true;
}

static void write(const torch::Tensor& k_in, const torch::Tensor& v_in, torch::Tensor& k_cache, torch::Tensor& v_cache,
                  torch::Tensor& k_scale, torch::Tensor& v_scale, const torch::Tensor& slot_mapping, bool int4) {
  const auto k = k_in.contiguous(), v = v_in.contiguous();
  const int64_t N = k.size(0), KVH = k.size(1), D = k.size(2);
  const int64_t slots = k_cache.size(0) * k_cache.size(1), row_bytes = k_cache.size(3);
  const int64_t* sm = slot_mapping.data_ptr<int64_t>();
  for (int64_t i = 0; i < N; ++i)
    TORCH_CHECK(sm[i] < slots, "slot_mapping[", i, "] = ", sm[i], " is outside the cache's ", slots, " slots");
  const int64_t kg = int4 ? D / k_scale.size(3) : 0, vg = int4 ? D / v_scale.size(3) : 0;
  at::parallel_for(0, N * KVH, 16, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = item / KVH, h = item % KVH, slot = sm[i];
      if (slot < 0) continue;
      const int64_t row = slot * KVH + h;  // (slot, kv head) row of the cache
      const float* kx = k.data_ptr<float>() + item * D;
      const float* vx = v.data_ptr<float>() + item * D;
      uint8_t* kc = static_cast<uint8_t*>(k_cache.data_ptr()) + row * row_bytes;
      uint8_t* vc = static_cast<uint8_t*>(v_cache.data_ptr()) + row * row_bytes;
      if (int4) {
        int4_row(kx, D, kg, kc, reinterpret_cast<uint16_t*>(k_scale.data_ptr<at::Half>()) + row * (D / kg) * 2);
        int4_row(vx, D, vg, vc, reinterpret_cast<uint16_t*>(v_scale.data_ptr<at::Half>()) + row * (D / vg) * 2);
      } else {
        fp8_row(kx, D, kc, k_scale.data_ptr<float>() + row);
        fp8_row(vx, D, vc, v_scale.data_ptr<float>() + row);
      }
    }
  });
}

}  // namespace specgraph_qcache

// the native twins of specgraph::cache_write_fp8 / _int4: the C++ write where it fits, else the specgraph op
template <bool Int4>
void native_quant_cache_write(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor k_scale, torch::Tensor v_scale, torch::Tensor slot_mapping) {
  if (specgraph_qcache::write_fits(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping, Int4)) {
    specgraph_qcache::write(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping, Int4);
    return;
  }
  static auto op = c10::Dispatcher::singleton()
      .findSchemaOrThrow(Int4 ? "specgraph::cache_write_int4" : "specgraph::cache_write_fp8", "")
      .typed<void(torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor,
                  torch::Tensor)>();
  op.call(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping);
}

// for the registry's "cpp" implementation (Python validates the arguments first)
bool quant_cache_write_applies(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
                               torch::Tensor k_scale, torch::Tensor v_scale, torch::Tensor slot_mapping,
                               std::string scheme) {
  return specgraph_qcache::write_fits(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping, scheme == "int4");
}

void quant_cache_write_cpu(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor k_scale, torch::Tensor v_scale, torch::Tensor slot_mapping, std::string scheme) {
  const bool int4 = scheme == "int4";
  TORCH_CHECK(specgraph_qcache::write_fits(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping, int4),
              "quant_cache_write_cpu: arguments the C++ write does not take");
  specgraph_qcache::write(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping, int4);
}

TORCH_LIBRARY_FRAGMENT(specgraph_cpu, m) {
  m.def("cache_write_fp8(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor(c!) k_scale, "
        "Tensor(d!) v_scale, Tensor slot_mapping) -> ()");
  m.def("cache_write_int4(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor(c!) k_scale, "
        "Tensor(d!) v_scale, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(specgraph_cpu, CPU, m) {
  m.impl("cache_write_fp8", &native_quant_cache_write<false>);
  m.impl("cache_write_int4", &native_quant_cache_write<true>);
}
