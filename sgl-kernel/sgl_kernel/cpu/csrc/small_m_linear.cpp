// y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for small M on AVX2 + FMA, W in fp32 or bf16.
//
// Invariant: every W element is loaded from DRAM once per call, whatever M is. x is packed
// to fp32 once per call; every tile of <= 6 rows of x meets a block of W while that block
// sits in L2 (a k-block of the x tile sits in L1), so only the first x tile's sweep over a
// block touches DRAM, and that block was prefetched during the previous block's compute.
// W is read as a few long contiguous streams (see run()). Accumulation is fp32; bf16 W is
// widened by 16-bit shifts (bf16 is the top half of an fp32). Threads (torch's OpenMP pool:
// torch.get_num_threads()) own contiguous ranges of N; each output has one summation order
// whatever the thread count.
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
#include "vec.h"

namespace {

using bf16 = at::BFloat16;
using sgl_cpu::vec::hsum;
using sgl_cpu::vec::to_f32;

// Cache budgets (measured on Zen 3, 32 KiB L1d and 512 KiB L2 per core): fp32 elements of
// one x tile's k-block, and bytes of one n-block of W.
constexpr int64_t kXTileFloats = 4096;
constexpr int64_t kWBlockBytes = 96 * 1024;
// Below this much work per thread (in FMAs, a weight counting as >= 4 since streaming it
// costs about that), waking another thread costs more than it saves.
constexpr int64_t kMinFmaPerThread = 1 << 18;
// From this many rows of x, one sweep over W prefetches its next tile in software.
constexpr int kPrefetchRows = 3;

// y[m * ldy + n * ldyn] (+)= sum_{k < kc} x[m * ldx + k] * w[n * ldw + k] for an MT x NT
// tile; x rows are in registers (MT), W vectors are widened one at a time, MT * NT
// accumulators: <= 16 ymm registers.
//
// bf16 W: one 256-bit load holds 16 weights; lane j has w[2j] in its low half and w[2j+1]
// in its high half, so `<< 16` gives the even weights and `& 0xffff0000` the odd ones as
// fp32. x is packed to match (per 16-block: 8 even k, then 8 odd k; see pack_x), so no
// shuffle is needed. fp32 W: 8-wide steps, x packed plainly.
//
// pf (may be null): NT rows laid out like w, to prefetch into cache while this tile computes,
// so that DRAM streaming overlaps the FMAs of the tile before it is needed.
template <int MT, int NT, typename WT>
void tile_reg(const float* __restrict x, int64_t ldx, const WT* __restrict w, int64_t ldw,
          int64_t kc, float* __restrict y, int64_t ldy, int64_t ldyn, bool accumulate,
          const WT* pf) {
  constexpr bool kBf16 = std::is_same<WT, bf16>::value;
  constexpr int kStep = kBf16 ? 16 : 8;
  __m256 acc[MT][NT];
#pragma GCC unroll 8
  for (int m = 0; m < MT; ++m)
#pragma GCC unroll 8
    for (int n = 0; n < NT; ++n) acc[m][n] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + kStep <= kc; k += kStep) {
    if (pf != nullptr && (k * sizeof(WT)) % 64 == 0) {
#pragma GCC unroll 8
      for (int n = 0; n < NT; ++n)
        _mm_prefetch(reinterpret_cast<const char*>(pf + n * ldw + k), _MM_HINT_T0);
    }
#pragma GCC unroll 2
    for (int half = 0; half < kStep / 8; ++half) {
      __m256 xv[MT];
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m) {
        xv[m] = _mm256_loadu_ps(x + m * ldx + k + 8 * half);
        // Keep x in a register: folded into each FMA it would be loaded NT times, and the
        // two load ports, not the FMA units, would bound the loop.
        asm("" : "+x"(xv[m]));
      }
#pragma GCC unroll 8
      for (int n = 0; n < NT; ++n) {
        __m256 wv;
        if constexpr (kBf16) {
          __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + n * ldw + k));
          wv = half == 0 ? _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16))
                         : _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(-65536)));
        } else {
          wv = _mm256_loadu_ps(w + n * ldw + k);
          asm("" : "+x"(wv));  // load once, not once per FMA (as for x above)
        }
#pragma GCC unroll 8
        for (int m = 0; m < MT; ++m) acc[m][n] = _mm256_fmadd_ps(xv[m], wv, acc[m][n]);
      }
    }
  }
  for (int m = 0; m < MT; ++m) {
    for (int n = 0; n < NT; ++n) {
      float s = hsum(acc[m][n]);
      for (int64_t kk = k; kk < kc; ++kk) s += x[m * ldx + kk] * to_f32(w[n * ldw + kk]);
      float& out = y[m * ldy + n * ldyn];
      out = accumulate ? out + s : s;
    }
  }
}

// Tiles of 5-6 x rows (one W row, NT = 1): x comes from L1 as an FMA memory operand, so the
// accumulators fit the 16 ymm registers, with separate even/odd accumulators (2 * MT
// independent FMA chains). 5-6 rows used to take two passes (a 4-row tile, then the rest) at
// ~2x a 4-row call; one pass of these: 1536 x 17920 bf16 at 5 rows 5.8 -> 3.9 ms (a verify of
// a 4-step chain). From 7 rows the FMA units bound both schemes and 4-row passes win.
template <int MT, typename WT>
void tile_wide(const float* __restrict x, int64_t ldx, const WT* __restrict w, int64_t kc,
               float* __restrict y, int64_t ldy, bool accumulate, const WT* pf) {
  constexpr bool kBf16 = std::is_same<WT, bf16>::value;
  constexpr int kStep = kBf16 ? 16 : 8;
  constexpr int kHalves = (kBf16 && MT <= 6) ? 2 : 1;  // accumulator sets
  __m256 acc[kHalves][MT];
#pragma GCC unroll 8
  for (int h = 0; h < kHalves; ++h)
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) acc[h][m] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + kStep <= kc; k += kStep) {
    if (pf != nullptr && (k * sizeof(WT)) % 64 == 0)
      _mm_prefetch(reinterpret_cast<const char*>(pf + k), _MM_HINT_T0);
    if constexpr (kBf16) {
      __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k));
      __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
      __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(-65536)));
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m) {
        acc[0][m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * ldx + k), we, acc[0][m]);
        acc[kHalves - 1][m] =
            _mm256_fmadd_ps(_mm256_loadu_ps(x + m * ldx + k + 8), wo, acc[kHalves - 1][m]);
      }
    } else {
      __m256 wv = _mm256_loadu_ps(w + k);
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m)
        acc[0][m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * ldx + k), wv, acc[0][m]);
    }
  }
  for (int m = 0; m < MT; ++m) {
    __m256 a = acc[0][m];
    if constexpr (kHalves == 2) a = _mm256_add_ps(a, acc[1][m]);
    float s = hsum(a);
    for (int64_t kk = k; kk < kc; ++kk) s += x[m * ldx + kk] * to_f32(w[kk]);
    float& out = y[m * ldy];
    out = accumulate ? out + s : s;
  }
}

template <int MT, int NT, typename WT>
void tile(const float* __restrict x, int64_t ldx, const WT* __restrict w, int64_t ldw,
          int64_t kc, float* __restrict y, int64_t ldy, int64_t ldyn, bool accumulate,
          const WT* pf) {
  if constexpr (MT <= 4) {
    tile_reg<MT, NT, WT>(x, ldx, w, ldw, kc, y, ldy, ldyn, accumulate, pf);
  } else {
    static_assert(NT == 1, "tiles of more than 4 rows take one W row");
    tile_wide<MT, WT>(x, ldx, w, kc, y, ldy, accumulate, pf);
  }
}

constexpr int kMaxMT = 6;
constexpr int kMaxNT = 8;
// W rows per tile for an x tile of mt rows (measured on Zen 3: 4x2 and 3x3 reach ~75% of the
// FMA peak from cache; 1x8 and 2x5 keep >= 8 independent FMA chains for tiny M). A tile of
// mt rows never has more W rows than this; fewer at the ends of runs.
constexpr int kNtFor[kMaxMT + 1] = {0, 8, 5, 3, 2, 1, 1};

template <typename WT>
using TileFn = void (*)(const float*, int64_t, const WT*, int64_t, int64_t, float*, int64_t,
                        int64_t, bool, const WT*);

template <typename WT, int MT, int NT>
constexpr TileFn<WT> tile_or_null() {
  if constexpr (NT <= kNtFor[MT]) return &tile<MT, NT, WT>;
  return nullptr;  // never used: not compiled
}

template <typename WT, int MT, int... NTs>
constexpr std::array<TileFn<WT>, kMaxNT + 1> row_of(std::integer_sequence<int, NTs...>) {
  return {nullptr, tile_or_null<WT, MT, NTs + 1>()...};
}

// Tiles<WT>::rows[mt][nt] is tile<mt, nt, WT> for 1 <= mt <= kMaxMT, 1 <= nt <= kNtFor[mt].
template <typename WT>
struct Tiles {
  std::array<TileFn<WT>, kMaxNT + 1> rows[kMaxMT + 1] = {
      {}, row_of<WT, 1>(std::make_integer_sequence<int, kMaxNT>{}),
      row_of<WT, 2>(std::make_integer_sequence<int, kMaxNT>{}),
      row_of<WT, 3>(std::make_integer_sequence<int, kMaxNT>{}),
      row_of<WT, 4>(std::make_integer_sequence<int, kMaxNT>{}),
      row_of<WT, 5>(std::make_integer_sequence<int, kMaxNT>{}),
      row_of<WT, 6>(std::make_integer_sequence<int, kMaxNT>{})};
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

template <typename WT, typename OT, typename BT>
void run(const float* x, int64_t M, int64_t K, const WT* w, int64_t N, const BT* bias, OT* out,
         float* acc) {
  static const Tiles<WT> tiles;
  // x tiles: as many of mt rows as fit, then one of the remaining M % mt rows; each
  // takes its own NT, and the W streams below come in multiples of both NTs.
  // one pass of a wide tile for 5-6 rows, else passes of <= 4-row tiles (see tile_wide)
  const int mt = static_cast<int>(M <= kMaxMT ? M : 4);
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
  // k-blocks start at multiples of 16 (the bf16 packing of x) and split K evenly.
  const int64_t kb_max = std::max<int64_t>(16, (kXTileFloats / mt) / 16 * 16);
  const int64_t k_blocks = passes == 1 ? 1 : (K + kb_max - 1) / kb_max;
  const int64_t kb = k_blocks == 1 ? K : ((K + k_blocks - 1) / k_blocks + 15) / 16 * 16;
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
              // of >= 3 rows: the next tile's rows (one row on in each stream). There the
              // FMAs keep the core busy enough that the hardware prefetchers fell behind:
              // 896 x 4864 bf16 at 4 rows took about the sum of its FMA time and its DRAM
              // time (0.48 ms vs 0.22 + 0.31), not the larger of them.
              const int64_t ahead = passes > 1 ? nbv : 1;
              const bool fetch = (passes > 1 ? t % passes == pass : mt >= kPrefetchRows) &&
                                 i + ahead < q && row + ahead + (ntile - 1) * q < n1;
              const WT* pf = fetch ? w + (row + ahead) * K + k0 : nullptr;
              tiles.rows[mtile][ntile](x + m * K + k0, K, w + row * K + k0, q * K, kc,
                                       acc + m * N + row, N, q, k0 > 0, pf);
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

template <typename WT, typename OT>
void dispatch_bias(const float* x, int64_t M, int64_t K, const WT* w, int64_t N,
                   const c10::optional<at::Tensor>& bias, OT* out, float* acc) {
  if (!bias.has_value()) {
    run<WT, OT, float>(x, M, K, w, N, nullptr, out, acc);
  } else if (bias->scalar_type() == at::kFloat) {
    run<WT, OT, float>(x, M, K, w, N, bias->data_ptr<float>(), out, acc);
  } else {
    run<WT, OT, bf16>(x, M, K, w, N, bias->data_ptr<bf16>(), out, acc);
  }
}

template <typename WT>
void dispatch_out(const float* x, int64_t M, int64_t K, const WT* w, int64_t N,
                  const c10::optional<at::Tensor>& bias, at::Tensor& out) {
  if (out.scalar_type() == at::kFloat) {
    float* y = out.data_ptr<float>();  // accumulate in place: the epilogue reads and writes one slot
    dispatch_bias<WT, float>(x, M, K, w, N, bias, y, y);
  } else {
    at::Tensor acc = at::empty({M, N}, out.options().dtype(at::kFloat));
    dispatch_bias<WT, bf16>(x, M, K, w, N, bias, out.data_ptr<bf16>(), acc.data_ptr<float>());
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
  at::Tensor xf = at::empty({M, K}, x.options().dtype(at::kFloat));
  const bool interleave = weight.scalar_type() == at::kBFloat16;
  if (xc.scalar_type() == at::kFloat) {
    pack_x<float>(xc.data_ptr<float>(), M, K, K, interleave, xf.data_ptr<float>());
  } else {
    pack_x<bf16>(xc.data_ptr<bf16>(), M, K, K, interleave, xf.data_ptr<float>());
  }
  at::Tensor w = weight.contiguous();  // a copy only for a non-contiguous view
  if (w.scalar_type() == at::kFloat) {
    dispatch_out<float>(xf.data_ptr<float>(), M, K, w.data_ptr<float>(), N, b, out);
  } else {
    dispatch_out<bf16>(xf.data_ptr<float>(), M, K, w.data_ptr<bf16>(), N, b, out);
  }
  return out;
}

}  // namespace sgl_cpu
