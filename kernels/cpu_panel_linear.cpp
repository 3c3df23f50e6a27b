// Batch-invariant float32 linear on CPU: specgraph_cpu::panel_linear (contract in panel_linear.py).
//
// y[m, n] = sum_k x[m, k] * w[n, k] (+ b[n]), each output a single FMA chain over k = 0, 1, ..., K-1
// in that order, started at zero, the bias added last. Nothing in that chain depends on how many
// rows x has, how they are tiled or how the work is split over threads, so a row's result is
// bitwise the same in a 1-token decode, a 12-token verify and a 300-token prefill. (GEMM libraries
// pick their blocking of k by the row count: a verify's logits then part from a decode's in their
// last bits, and a sampled or near-tied greedy token can follow.)
//
// The weights are packed once (pack_panels) into panels of kPanel output columns, k-major: panel p
// holds w[p*kPanel + c, k] at [p][k][c], zero past N. The kernel broadcasts x[m, k] and multiplies
// it into the panel's row k (contiguous vectors), so there is no horizontal reduction at all, and a
// panel is read from memory once per call and then from L1 for every further tile of rows (k is
// walked in spans, see panel_rows).
// Tiles: R rows of x by a whole panel row in registers (6 x 4 vectors with AVX-512, 6 x 2 with AVX2: the
// accumulators, the weight vectors and a broadcast within the register file). Work items are
// (panel range, row block) pairs over torch's threads. Without AVX2 the same FMA chains run as
// scalar std::fma loops.
// Prefetch: a tile of several rows spends more cycles per weight byte than the memory takes to
// deliver it, and the hardware prefetchers alone then leave the stream short (SmolLM2's linears,
// 4 rows: 25 ms against 17 for 1 row on an Intel Xeon with AVX-512); prefetching the panel a
// distance of k rows ahead brings 4 rows to 18.5 ms. The distances (one for calls of 1 row, one
// for more) are process-wide and set by measurement (kernels/prefetch.py); a prefetch
// changes no arithmetic, so the FMA chains above are the same whatever they are.
#include <cmath>

namespace specgraph_panel {

// Output columns per panel: 4 AVX-512 vectors (256 bytes a row of k), 2 AVX2 vectors (64 bytes: one cache
// line), 64 floats for the scalar loops. The AVX2 panel was 8 vectors wide, so a tile held 1 row (8
// accumulators and 8 weight vectors fill the 16 registers) and a verify's further rows re-read every panel
// row from L1; 2 vectors let a tile hold 6 rows, so up to 6 rows of x take each weight from memory once
// with all their FMAs under the stream. SmolLM2's linears, 2 threads, an AMD EPYC with AVX2, interleaved
// medians (benchmarks/ab_kernel.py): 1 row 24.7 -> 24.3 ms, 2 rows 28.5 -> 22.9, 4 rows 27.6 -> 22.9,
// 6 rows 35.1 -> 28.8, 8 rows 40.8 -> 35.6, 12 rows 48.2 -> 36.6, 64 rows 163 -> 148; bitwise the same.
#ifdef SPECGRAPH_AVX2
constexpr int64_t kPanel = FloatVec::kWidth * (FloatVec::kRegisters >= 32 ? 4 : 2);
#else
constexpr int64_t kPanel = 64;
#endif
constexpr int64_t kRowBlock = 64;  // rows of x per work item

// prefetch distances in panel rows of k (0: none) for a row block of x of 1 row, of rows one register tile
// holds (kTileRows: every k walked once by one tile), and of more (k walked in L1 spans by several tiles). The
// classes want their own: on an AMD EPYC with AVX2 (weights in huge pages, SmolLM2's linears) 3 and 4 rows
// ran 5-10% faster at 16 rows ahead than at 32, where 8 and 12 rows ran alike from 16 to 48; one distance
// for both, timed over 4 and 8 rows together, came out 16 on one build and 32 on another.
static int64_t g_ahead_single = 0, g_ahead_tile = 16, g_ahead_spans = 16;

#ifdef SPECGRAPH_AVX2
using Vec = FloatVec;
constexpr int kWidth = Vec::kWidth;
// A tile spans a whole panel row, so every call reads the panel in address order, one row of k after the
// other. (Tiles of part of a panel row read each row's left part over all of k, then its right part: with
// the 8-vector AVX2 panel, 2 x 4 tiles were slower than 1 x 8 on an AMD EPYC, 1 row 20.0 -> 22.3 ms.)
constexpr int kVecs = kPanel / kWidth;  // panel vectors per tile
constexpr int kTileRows = std::max(1, (Vec::kRegisters - kVecs - 2) / kVecs);  // 6 (AVX-512 and AVX2)

constexpr int kLines = kPanel * 4 / 64;  // 64-byte lines per panel row of k

// Which lines a tile prefetches while it computes: lines [first, first + count) of the panel row `ahead`
// rows of k beyond the one it multiplies (count 0: none).
struct Prefetch {
  int64_t ahead = 0;
  int first = 0, count = 0;
};

// acc += x[:, k] * panel row k for k in [k0, k1), for rows [0, R) of x (row stride K), each row's chain in
// order of k; meanwhile the lines `pf` names are prefetched
template <int R, bool Prefetching>
static inline void fma_rows(typename Vec::T (&acc)[R][kVecs], const float* x, const float* wp, int64_t K, int64_t k0,
                            int64_t k1, const Prefetch& pf) {
  wp += k0 * kPanel;
  for (int64_t k = k0; k < k1; ++k, wp += kPanel) {
    if constexpr (Prefetching) {
      for (int line = pf.first; line < pf.first + pf.count; ++line)
        _mm_prefetch(reinterpret_cast<const char*>(wp + pf.ahead * kPanel + line * 16), _MM_HINT_T0);
    }
    typename Vec::T wv[kVecs];
    for (int j = 0; j < kVecs; ++j) wv[j] = Vec::load(wp + j * kWidth);
    for (int r = 0; r < R; ++r) {
      const auto xb = Vec::broadcast(x + r * K + k);
      for (int j = 0; j < kVecs; ++j) acc[r][j] = Vec::fma(wv[j], xb, acc[r][j]);
    }
  }
}

// rows [0, R) of x (row stride K) times one panel, over k in [k0, k1), onto the accumulators in acc (R rows
// of kPanel; zero when k0 is 0)
template <int R>
static inline void tile_span(float* acc, const float* x, const float* panel, int64_t K, int64_t k0, int64_t k1,
                             const Prefetch& pf) {
  typename Vec::T a[R][kVecs];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kVecs; ++j) a[r][j] = k0 == 0 ? Vec::zero() : Vec::load(acc + (r * kVecs + j) * kWidth);
  // (no prefetch past the panel)
  const int64_t split = pf.ahead > 0 && pf.count > 0 ? std::clamp<int64_t>(K - pf.ahead, k0, k1) : k0;
  fma_rows<R, true>(a, x, panel, K, k0, split, pf);
  fma_rows<R, false>(a, x, panel, K, split, k1, pf);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kVecs; ++j) Vec::store(acc + (r * kVecs + j) * kWidth, a[r][j]);
}

// the first `rows` (<= kTileRows) rows of x, as tile_span
template <int R>
static inline void rows_span(int64_t rows, float* acc, const float* x, const float* panel, int64_t K, int64_t k0,
                             int64_t k1, const Prefetch& pf) {
  if constexpr (R > 0) {
    if (rows == R) tile_span<R>(acc, x, panel, K, k0, k1, pf);
    else rows_span<R - 1>(rows, acc, x, panel, K, k0, k1, pf);
  }
}

// k is walked in spans of kSpan panel rows (16 KiB: they stay in L1), every tile of rows taking a span
// before the next span is read: the panel comes from memory once and the further tiles of rows read it
// from L1, where tiles that each walked all of k read it again from L2. On an Intel Xeon with AVX-512
// (SmolLM2's linears, 2 threads, interleaved medians; 1 row 20.4 ms): 7 rows 25.2 -> 23.1 ms, 8 rows
// 26.5 -> 24.6, 12 rows 29.5 -> 26.6, 64 rows 79 -> 75; spans of 32 to 128 rows time alike. The
// accumulators wait in `acc` between spans; a float stored and loaded is the same float, so each
// output's FMA chain is unchanged.
// The first tile of a span prefetches `ahead` rows of k ahead (measured, kernels/prefetch.py); the next
// kLines tiles, which read the span from L1, each prefetch one line of every row of the next span, so the
// memory works while they compute. SmolLM2's linears, 2 threads, an AMD EPYC with AVX2 (the 8-vector panel then),
// interleaved medians:
// 2 rows 23.0 -> 22.2 ms, 4 rows 29.0 -> 27.2, 8 rows 35.8 -> 31.6, 64 rows 163 -> 137, 256 rows 648 -> 537,
// 1 row alike (not yet measured with AVX-512, where only 7 rows and more have a second tile).
constexpr int64_t kSpan = 16384 / (kPanel * 4);  // panel rows of k in 16 KiB

// the distance for a row block of M rows
static int64_t prefetch_ahead(int64_t M) {
  return M == 1 ? g_ahead_single : M <= kTileRows ? g_ahead_tile : g_ahead_spans;
}

static void panel_rows(const float* x, const float* panel, const float* b, float* y, int64_t M, int64_t K,
                       int64_t N, int64_t col) {
  alignas(64) float acc[kRowBlock * kPanel];
  const int64_t ahead = std::min(prefetch_ahead(M), K);
  const int64_t span = M <= kTileRows ? K : kSpan;  // one tile: no need to split k
  for (int64_t k0 = 0; k0 < K; k0 += span) {
    const int64_t k1 = std::min(K, k0 + span);
    for (int64_t m = 0, tile = 0; m < M; m += kTileRows, ++tile) {
      const Prefetch pf = tile == 0 ? Prefetch{ahead, 0, kLines}
                          : tile <= kLines ? Prefetch{span, int(tile - 1), 1} : Prefetch{};
      rows_span<kTileRows>(std::min<int64_t>(kTileRows, M - m), acc + m * kPanel, x + m * K, panel, K, k0, k1, pf);
    }
  }
  for (int64_t r = 0; r < M; ++r)
    for (int64_t c = col; c < std::min(N, col + kPanel); ++c)
      y[r * N + c] = acc[r * kPanel + c - col] + (b ? b[c] : 0.f);
}
#else
static void panel_rows(const float* x, const float* panel, const float* b, float* y, int64_t M, int64_t K,
                       int64_t N, int64_t col) {
  const int64_t cols = std::min<int64_t>(kPanel, N - col);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < cols; ++c) {
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc = std::fma(panel[k * kPanel + c], x[m * K + k], acc);
      y[m * N + col + c] = acc + (b ? b[col + c] : 0.f);
    }
}
#endif

}  // namespace specgraph_panel

// w [N, K] float32 -> panels [ceil(N / 64), K, 64] (zero past N)
torch::Tensor pack_panels(torch::Tensor w) {
  using namespace specgraph_panel;
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kFloat, "pack_panels: a float32 weight [N, K]; got ",
              w.scalar_type(), " with shape ", w.sizes());
  const int64_t N = w.size(0), K = w.size(1), P = (N + kPanel - 1) / kPanel;
  auto padded = torch::zeros({P * kPanel, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({P, kPanel, K}).transpose(1, 2).contiguous();
}

torch::Tensor panel_linear(torch::Tensor x, torch::Tensor panels, c10::optional<torch::Tensor> bias, int64_t n) {
  using namespace specgraph_panel;
  TORCH_CHECK(x.scalar_type() == torch::kFloat && panels.scalar_type() == torch::kFloat && panels.dim() == 3 &&
              panels.size(2) == kPanel && x.dim() >= 1 && x.size(-1) == panels.size(1) &&
              n > (panels.size(0) - 1) * kPanel && n <= panels.size(0) * kPanel,
              "panel_linear: float32 x [..., K] and panels [ceil(n / 64), K, 64] from pack_panels; got x ",
              x.scalar_type(), " ", x.sizes(), ", panels ", panels.scalar_type(), " ", panels.sizes(), ", n ", n);
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == torch::kFloat),
              "panel_linear: bias must be float32 [", n, "]");
  auto xs = x.reshape({-1, x.size(-1)}).contiguous();
  auto pc = panels.contiguous();
  const int64_t M = xs.size(0), K = xs.size(1), P = pc.size(0);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = n;
  auto y = torch::empty({M, n}, x.options());
  torch::Tensor bc = bias.has_value() ? bias->contiguous() : torch::Tensor();
  const float* bp = bias.has_value() ? bc.data_ptr<float>() : nullptr;
  const float* xp = xs.data_ptr<float>();
  const float* wp = pc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (M == 0) return y.view(out_shape);
  // Row blocks of equal size (within a row), at most kRowBlock rows each. Items: (row block, panel); a thread's
  // items are contiguous, so it walks its panels once per row block. Blocks of kRowBlock rows and a short last
  // one left the threads uneven shares: 65 rows on 2 threads gave one thread 64 rows and the other 1, so a
  // prompt of 65 to 127 tokens took as long as one of 128 (SmolLM2's linears on an AMD EPYC: 64 rows 7.6 ms a
  // layer, 65 rows 14.6, 128 rows 14.9). A row's result does not depend on its block (see panel_rows).
  const int64_t row_blocks = (M + kRowBlock - 1) / kRowBlock;
  const int64_t block_rows = (M + row_blocks - 1) / row_blocks;
  at::parallel_for(0, row_blocks * P, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t rb = i / P, p = i % P, m0 = rb * block_rows, rows = std::min<int64_t>(block_rows, M - m0);
      panel_rows(xp + m0 * K, wp + p * K * kPanel, bp, yp + m0 * n, rows, K, n, p * kPanel);
    }
  });
  return y.view(out_shape);
}

// sets the prefetch distances (panel rows of k ahead, 0: none) for row blocks of 1 row, of one register tile's
// rows and of more (see g_ahead_single); returns the previous three
std::vector<int64_t> set_panel_prefetch(int64_t single, int64_t tile, int64_t spans) {
  using namespace specgraph_panel;
  TORCH_CHECK(single >= 0 && tile >= 0 && spans >= 0, "set_panel_prefetch: distances must be >= 0; got ", single,
              ", ", tile, ", ", spans);
  std::vector<int64_t> previous{g_ahead_single, g_ahead_tile, g_ahead_spans};
  g_ahead_single = single;
  g_ahead_tile = tile;
  g_ahead_spans = spans;
  return previous;
}

TORCH_LIBRARY_FRAGMENT(specgraph_cpu, m) {
  m.def("pack_panels(Tensor w) -> Tensor");
  m.def("panel_linear(Tensor x, Tensor panels, Tensor? bias, int n) -> Tensor");
  m.def("panel_width() -> int");
}

// output columns per panel of this build (pack_panels' last dimension)
int64_t panel_width() { return specgraph_panel::kPanel; }

TORCH_LIBRARY_IMPL(specgraph_cpu, CatchAll, m) { m.impl("panel_width", &panel_width); }

TORCH_LIBRARY_IMPL(specgraph_cpu, CPU, m) {
  m.impl("pack_panels", &pack_panels);
  m.impl("panel_linear", &panel_linear);
}
