// y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for small M on AVX2 + FMA, W in fp32 or bf16.
//
// On CPUs with AVX512-BF16 (built with -march=native there), bf16 x times bf16 W takes
// another inner kernel: VDPBF16PS multiplies 32 bf16 pairs into 16 fp32 sums per
// instruction, 4x the multiply-adds of an AVX2 FMA after widening, and x needs no packing.
// A verify of 4-10 rows is then bound by streaming W from DRAM, as a 1-row decode is,
// instead of by the FMAs. Every other dtype pair, and every CPU without it, takes AVX2.
//
// Invariant: every W element is loaded from DRAM once per call, whatever M is. x is packed
// to fp32 once per call; every tile of <= 6 rows of x meets a block of W while that block
// sits in L2 (a k-block of the x tile sits in L1), so only the first x tile's sweep over a
// block touches DRAM, and that block was prefetched during the previous block's compute.
// W is read as a few long contiguous streams (see run()). Accumulation is fp32; bf16 W is
// widened by 16-bit shifts (bf16 is the top half of an fp32). Threads (torch's OpenMP pool:
// torch.get_num_threads()) own contiguous ranges of N; each output has one summation order
// whatever the thread count. The inner tiles: small_m_tiles_avx2.h, small_m_tile_dp.h.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <type_traits>
#include <utility>

#include "ops.h"
#include "small_m_tile_dp.h"
#include "small_m_tiles_avx2.h"
#include "vec.h"

namespace {

using namespace sgl_cpu::small_m;  // the inner tiles

// Cache budgets (measured on Zen 3, 32 KiB L1d and 512 KiB L2 per core): fp32 elements of
// one x tile's k-block, and bytes of one n-block of W.
constexpr int64_t kXTileFloats = 4096;
constexpr int64_t kWBlockBytes = 96 * 1024;
// Below this much work per thread (in FMAs, a weight counting as >= 4 since streaming it
// costs about that), waking another thread costs more than it saves.
constexpr int64_t kMinFmaPerThread = 1 << 18;

constexpr int kMaxMT = 6;   // rows of x one AVX2 sweep over W takes
constexpr int kMaxMTDp = 10;  // ... and one AVX512-BF16 sweep
constexpr int kMaxNT = 8;
// W rows per tile for an x tile of mt rows (measured on Zen 3: 4x2 and 3x3 reach ~75% of the
// FMA peak from cache; 1x8 and 2x5 keep >= 8 independent FMA chains for tiny M). A tile of
// mt rows never has more W rows than this; fewer at the ends of runs.
constexpr int kNtFor[kMaxMT + 1] = {0, 8, 5, 3, 2, 1, 1};
// The same for the AVX512-BF16 tile (32 zmm registers: MT * NT accumulators + MT x + W).
// Up to 10 rows sweep W once: verifying a 10-token n-gram draft costs one read of W.
constexpr int kNtForDp[kMaxMTDp + 1] = {0, 8, 6, 4, 4, 4, 3, 3, 2, 2, 2};

template <typename XT, typename WT>
using TileFn = void (*)(const XT*, int64_t, const WT*, int64_t, int64_t, float*, int64_t,
                        int64_t, bool, const WT*, int64_t);

// The two inner kernels: x packed to fp32 (AVX2), or bf16 x with bf16 W (AVX512-BF16).
template <typename WT>
struct Avx2Kind {
  using XT = float;
  static constexpr const int* nt_for = kNtFor;
  static constexpr int max_mt = kMaxMT;  // more rows: passes of multi_mt rows over W blocks
  static constexpr int multi_mt = 4;
  static constexpr int64_t k_align = 16;  // pack_x's bf16 interleave blocks
  // One sweep of >= prefetch_rows rows of x prefetches W this many bytes ahead in each
  // stream (at least one row): the next tile's rows.
  static constexpr int prefetch_rows = 3;
  static constexpr int64_t prefetch_bytes = 0;
  static constexpr int64_t single_kb = 0;
  template <int MT, int NT>
  static constexpr TileFn<XT, WT> fn() { return &tile<MT, NT, WT>; }
};

#ifdef SGL_CPU_DP
struct DpKind {
  using XT = bf16;
  static constexpr const int* nt_for = kNtForDp;
  static constexpr int max_mt = kMaxMTDp;
  static constexpr int multi_mt = 8;
  static constexpr int64_t k_align = 32;
  // Every sweep prefetches ~8 KiB ahead in each stream, into L2 (measured on Zen 4, 2
  // threads, medians of 6 interleaved rounds: 151936 x 896 at 10 rows 14.4 -> 10.5 ms, 9728 x
  // 896 0.88 -> 0.72 ms, 1 row 9.6 -> 8.8 ms; one row ahead into L1 left the FMAs and the
  // DRAM reads serialised, as in tile_reg's case).
  static constexpr int prefetch_rows = 1;
  static constexpr int64_t prefetch_bytes = 8192;
  static constexpr int64_t single_kb = 1024;
  template <int MT, int NT>
  static constexpr TileFn<XT, bf16> fn() { return &tile_dp<MT, NT>; }
};
#endif

template <typename Kind, typename WT, int MT, int NT>
constexpr TileFn<typename Kind::XT, WT> tile_or_null() {
  if constexpr (NT <= Kind::nt_for[MT]) return Kind::template fn<MT, NT>();
  return nullptr;  // never used: not compiled
}

template <typename Kind, typename WT, int MT, int... NTs>
constexpr std::array<TileFn<typename Kind::XT, WT>, kMaxNT + 1> row_of(
    std::integer_sequence<int, NTs...>) {
  return {nullptr, tile_or_null<Kind, WT, MT, NTs + 1>()...};
}

// Tiles<Kind, WT>::rows[mt][nt] is Kind's tile<mt, nt> for 1 <= mt <= Kind::max_mt,
// 1 <= nt <= Kind::nt_for[mt].
template <typename Kind, typename WT>
struct Tiles {
  using Row = std::array<TileFn<typename Kind::XT, WT>, kMaxNT + 1>;
  template <int... MTs>
  static constexpr std::array<Row, Kind::max_mt + 1> table(std::integer_sequence<int, MTs...>) {
    return {Row{}, row_of<Kind, WT, MTs + 1>(std::make_integer_sequence<int, kMaxNT>{})...};
  }
  std::array<Row, Kind::max_mt + 1> rows =
      table(std::make_integer_sequence<int, Kind::max_mt>{});
};

// x [M, K] (row stride ldx) -> fp32 [M, K]; for bf16 W each full 16-block of k is stored as
// its 8 even then its 8 odd elements (the order tile() widens bf16 W in), the tail plainly.
template <typename XT>
void pack_x(const XT* x, int64_t M, int64_t K, int64_t ldx, bool interleave, float* out) {
  const int64_t k16 = interleave ? K / 16 * 16 : 0;
  const int64_t grain = std::max<int64_t>(1, kMinFmaPerThread / std::max<int64_t>(K, 1));
  at::parallel_for(0, M, grain, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const XT* src = x + m * ldx;
      float* dst = out + m * K;
      for (int64_t k = 0; k < k16; k += 16) {
        for (int j = 0; j < 8; ++j) {
          dst[k + j] = to_f32(src[k + 2 * j]);
          dst[k + 8 + j] = to_f32(src[k + 2 * j + 1]);
        }
      }
      for (int64_t k = k16; k < K; ++k) dst[k] = to_f32(src[k]);
    }
  });
}

template <typename Kind, typename WT, typename OT, typename BT>
void run(const typename Kind::XT* x, int64_t M, int64_t K, const WT* w, int64_t N,
         const BT* bias, OT* out, float* acc) {
  static const Tiles<Kind, WT> tiles;
  constexpr const int* kNtFor = Kind::nt_for;
  constexpr int64_t kAlign = Kind::k_align;
  // x tiles: as many of mt rows as fit, then one of the remaining M % mt rows; each
  // takes its own NT, and the W streams below come in multiples of both NTs.
  // AVX2: one pass of a wide tile for 5-6 rows, else passes of <= 4-row tiles (see tile_wide);
  // AVX512-BF16: one pass for up to 10 rows, else passes of 8.
  const int mt = static_cast<int>(M <= Kind::max_mt ? M : Kind::multi_mt);
  const int mt_rest = static_cast<int>(M % mt);
  const int nt = kNtFor[mt], nt_rest = mt_rest ? kNtFor[mt_rest] : nt;
  const int64_t unit = std::lcm(nt, nt_rest);
  const int64_t passes = (M + mt - 1) / mt;  // x tiles, each sweeping the same W block
  // W streams: a thread's rows are cut into S contiguous runs of q rows, and a W tile takes
  // its NT rows from NT different runs at the same offset i (rows q apart). Each run is
  // then read front to back as one long contiguous stream, which the hardware prefetchers
  // follow far better than NT adjacent rows that end after K elements (measured on Zen 3:
  // 1.3-1.7x the bandwidth of one x tile for K < 2048). One x tile: S = NT streams; several:
  // at least 4, which measured best there.
  const int64_t S = passes == 1 ? unit : unit * ((4 + unit - 1) / unit);
  // Cache blocking (several x tiles only; one tile just streams W past x): a k-block of an x
  // tile (mt x kb fp32) stays in L1 while it meets every W tile of a block of nbv offsets
  // (S * nbv rows x kb of W), which comes from DRAM once and from L2 for later x tiles.
  // k-blocks start at multiples of kAlign (the kernel's k step) and split K evenly.
  const int64_t kb_max = std::max<int64_t>(kAlign, (kXTileFloats / mt) / kAlign * kAlign);
  auto even_blocks = [&](int64_t nb) {  // width of nb blocks splitting K evenly
    return nb == 1 ? K : ((K + nb - 1) / nb + kAlign - 1) / kAlign * kAlign;
  };
  // One sweep with a long K (a down projection): x's rows spill L1 and each W tile reloaded
  // them from L2, so several rows take k-blocks of <= Kind::single_kb (x's block in L1). One
  // row streams whole W rows (blocks made its W streams choppy: 896 x 4864 0.29 -> 0.37 ms)
  // and reduces its sums over the same blocks inside the tile (red): the same bits either way.
  const int64_t single_kb = Kind::single_kb;
  const int64_t single_blocks =
      passes == 1 && single_kb > 0 && K > 2 * single_kb ? (K + single_kb - 1) / single_kb : 1;
  const int64_t red = single_blocks > 1 && M == 1 ? even_blocks(single_blocks) : 0;
  const int64_t k_blocks = passes > 1 ? (K + kb_max - 1) / kb_max : (red ? 1 : single_blocks);
  const int64_t kb = even_blocks(k_blocks);
  const int64_t unit_fmas = unit * K * std::max<int64_t>(M, 4);
  const int64_t grain = std::max<int64_t>(1, kMinFmaPerThread / unit_fmas);
  at::parallel_for(0, (N + unit - 1) / unit, grain, [&](int64_t u0, int64_t u1) {
    const int64_t n0 = u0 * unit, n1 = std::min(N, u1 * unit);
    const int64_t rows = n1 - n0, q = (rows + S - 1) / S;
    const int64_t nbv = passes == 1 ? q
        : std::max<int64_t>(1, kWBlockBytes / (S * kb * int64_t(sizeof(WT))));
    for (int64_t k0 = 0; k0 < K; k0 += kb) {
      const int64_t kc = std::min(kb, K - k0);
      for (int64_t i0 = 0; i0 < q; i0 += nbv) {
        const int64_t i1 = std::min(q, i0 + nbv);
        for (int64_t m = 0, pass = 0; m < M; m += mt, ++pass) {
          const int mtile = static_cast<int>(std::min<int64_t>(mt, M - m));
          const int step = mtile == mt ? nt : nt_rest;
          int64_t t = 0;  // W tiles of this block, in sweep order
          for (int64_t i = i0; i < i1; ++i) {
            const int64_t runs = std::min<int64_t>(S, (rows - i + q - 1) / q);  // runs > i
            for (int64_t j = 0; j < runs; j += step, ++t) {
              const int ntile = static_cast<int>(std::min<int64_t>(step, runs - j));
              const int64_t row = n0 + i + j * q;
              // The next block is prefetched while this one computes, spread over the x
              // tiles' sweeps: sweep p fetches the tiles t with t % passes == p. One sweep
              // of >= Kind::prefetch_rows rows: rows Kind::prefetch_bytes on in each stream
              // (at least the next tile's). There the
              // FMAs keep the core busy enough that the hardware prefetchers fell behind:
              // 896 x 4864 bf16 at 4 rows took about the sum of its FMA time and its DRAM
              // time (0.48 ms vs 0.22 + 0.31), not the larger of them.
              const int64_t ahead = passes > 1 ? nbv : std::max<int64_t>(
                  1, Kind::prefetch_bytes / (kc * int64_t(sizeof(WT))));
              const bool fetch = (passes > 1 ? t % passes == pass : mt >= Kind::prefetch_rows) &&
                                 i + ahead < q && row + ahead + (ntile - 1) * q < n1;
              const WT* pf = fetch ? w + (row + ahead) * K + k0 : nullptr;
              tiles.rows[mtile][ntile](x + m * K + k0, K, w + row * K + k0, q * K, kc,
                                       acc + m * N + row, N, q, k0 > 0, pf, red);
            }
          }
        }
      }
    }
    // Epilogue on this thread's columns: bias, then rounding to the output dtype.
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t n = n0; n < n1; ++n) {
        float v = acc[m * N + n];
        if (bias != nullptr) v += to_f32(bias[n]);
        out[m * N + n] = static_cast<OT>(v);
      }
    }
  });
}

template <typename Kind, typename WT, typename OT>
void dispatch_bias(const typename Kind::XT* x, int64_t M, int64_t K, const WT* w, int64_t N,
                   const c10::optional<at::Tensor>& bias, OT* out, float* acc) {
  if (!bias.has_value()) {
    run<Kind, WT, OT, float>(x, M, K, w, N, nullptr, out, acc);
  } else if (bias->scalar_type() == at::kFloat) {
    run<Kind, WT, OT, float>(x, M, K, w, N, bias->data_ptr<float>(), out, acc);
  } else {
    run<Kind, WT, OT, bf16>(x, M, K, w, N, bias->data_ptr<bf16>(), out, acc);
  }
}

template <typename Kind, typename WT>
void dispatch_out(const typename Kind::XT* x, int64_t M, int64_t K, const WT* w, int64_t N,
                  const c10::optional<at::Tensor>& bias, at::Tensor& out) {
  if (out.scalar_type() == at::kFloat) {
    float* y = out.data_ptr<float>();  // accumulate in place: the epilogue reads and writes one slot
    dispatch_bias<Kind, WT, float>(x, M, K, w, N, bias, y, y);
  } else {
    at::Tensor acc = at::empty({M, N}, out.options().dtype(at::kFloat));
    dispatch_bias<Kind, WT, bf16>(x, M, K, w, N, bias, out.data_ptr<bf16>(),
                                  acc.data_ptr<float>());
  }
}

}  // namespace

namespace sgl_cpu {

// x: [M, K] fp32 or bf16; weight: [N, K] fp32 or bf16; bias: [N] or None. Returns [M, N] in
// x's dtype.
at::Tensor small_m_linear(const at::Tensor& x, const at::Tensor& weight,
                          const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "small_m_linear: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "small_m_linear: x [M, K], weight [N, K]");
  TORCH_CHECK(x.size(1) == weight.size(1), "small_m_linear: K of x and weight differ");
  auto is_ok = [](at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16; };
  TORCH_CHECK(is_ok(x.scalar_type()) && is_ok(weight.scalar_type()),
              "small_m_linear: float32 or bfloat16 only");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  c10::optional<at::Tensor> b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "small_m_linear: bias must be [N]");
    TORCH_CHECK(is_ok(bias->scalar_type()), "small_m_linear: bias float32 or bfloat16");
    b = bias->contiguous();
  }
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  if (K == 0) return b.has_value() ? b->to(x.scalar_type()).expand({M, N}).contiguous() : out.zero_();
  at::Tensor xc = x.contiguous();
  at::Tensor w = weight.contiguous();  // a copy only for a non-contiguous view
#ifdef SGL_CPU_DP
  if (xc.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16) {
    dispatch_out<DpKind, bf16>(xc.data_ptr<bf16>(), M, K, w.data_ptr<bf16>(), N, b, out);
    return out;
  }
#endif
  at::Tensor xf = at::empty({M, K}, x.options().dtype(at::kFloat));
  const bool interleave = weight.scalar_type() == at::kBFloat16;
  if (xc.scalar_type() == at::kFloat) {
    pack_x<float>(xc.data_ptr<float>(), M, K, K, interleave, xf.data_ptr<float>());
  } else {
    pack_x<bf16>(xc.data_ptr<bf16>(), M, K, K, interleave, xf.data_ptr<float>());
  }
  if (w.scalar_type() == at::kFloat) {
    dispatch_out<Avx2Kind<float>, float>(xf.data_ptr<float>(), M, K, w.data_ptr<float>(), N, b,
                                         out);
  } else {
    dispatch_out<Avx2Kind<bf16>, bf16>(xf.data_ptr<float>(), M, K, w.data_ptr<bf16>(), N, b,
                                       out);
  }
  return out;
}

std::string linear_isa() {
#ifdef SGL_CPU_DP
  return "avx512bf16";
#else
  return "avx2";
#endif
}

}  // namespace sgl_cpu
