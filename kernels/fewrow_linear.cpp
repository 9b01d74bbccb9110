// Few-row linear layer for float32 on the CPU: y[r, o] = sum_k x[r, k] * w[o, k] (+ bias[o]).
//
// Built for decoding, where a step multiplies a handful of rows (one token per request, or the nodes of a
// verified tree) by weights far larger than the cache, so the cost is reading the weights. The weight is
// packed once into blocks of BW output features, k-major inside a block:
//     packed[b, k, j] = w[b * BW + j, k]        (zero past the last feature)
// and a tile of rows streams a pair of blocks once, contiguously (on AVX-512 up to 8 rows in one tile), so
// 2-8 rows cost little more than one.
//
// Batch-invariant by construction: every output is one chain of fused multiply-adds in k order,
//     acc = 0;  for k in 0 .. K-1:  acc = fma(x[r, k], w[o, k], acc);   y[r, o] = acc + bias[o]
// carried in one vector lane, whatever the number of rows, the tile (r, o) falls in, the thread that computes
// it or the vector width. So a row computed alone is bit-identical to the same row computed among others (a
// verified tree's root gets plain decoding's result exactly), and the AVX-512, AVX2 and scalar builds agree
// with each other bit for bit. Threads split the blocks of output features, never the sum over k.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#define FEWROW_ISA "avx512"
namespace {
constexpr int64_t LANES = 16;
constexpr int NR_MAX = 8;  // 8 rows x 2 vectors = 16 accumulators of 32 registers
// Two blocks at once (four vectors per row, so more chains and two weight streams in flight): every row count
// up to PAIR_ONE in one tile, more in tiles of PAIR_TILE. Measured on SmolLM2's 30 layers and output layer
// (Xeon, AVX-512, 2 threads): 2-8 rows cost 1.03-1.15x one row this way, 1.15-1.30x with one block per tile.
constexpr int PAIR_ONE = 8;
constexpr int PAIR_TILE = 6;
using vec = __m512;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline vec vbroadcast(const float* p) { return _mm512_set1_ps(*p); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline void vput(float* p, vec v) { _mm512_storeu_ps(p, v); }
inline void vstore(float* p, vec v, const float* bias, int64_t n) {
  if (n >= LANES) {
    if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias));
    _mm512_storeu_ps(p, v);
  } else if (n > 0) {
    const __mmask16 m = static_cast<__mmask16>((1u << n) - 1u);
    if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, bias));
    _mm512_mask_storeu_ps(p, m, v);
  }
}
}  // namespace
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define FEWROW_ISA "avx2"
namespace {
constexpr int64_t LANES = 8;
constexpr int NR_MAX = 4;  // 4 rows x 2 vectors = 8 accumulators of 16 registers
constexpr int PAIR_ONE = 1;  // two blocks at once for one row only (16 registers)
constexpr int PAIR_TILE = 1;
using vec = __m256;
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline vec vbroadcast(const float* p) { return _mm256_broadcast_ss(p); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline void vput(float* p, vec v) { _mm256_storeu_ps(p, v); }
inline void vstore(float* p, vec v, const float* bias, int64_t n) {
  alignas(32) float t[8];
  _mm256_store_ps(t, v);
  for (int64_t i = 0; i < std::min<int64_t>(n, LANES); ++i) p[i] = bias ? t[i] + bias[i] : t[i];
}
}  // namespace
#else
#define FEWROW_ISA "scalar"
namespace {
constexpr int64_t LANES = 8;
constexpr int NR_MAX = 4;
constexpr int PAIR_ONE = 1;
constexpr int PAIR_TILE = 1;
struct vec {
  float v[8];
};
inline vec vzero() { return vec{{0, 0, 0, 0, 0, 0, 0, 0}}; }
inline vec vload(const float* p) {
  vec r;
  for (int i = 0; i < 8; ++i) r.v[i] = p[i];
  return r;
}
inline vec vbroadcast(const float* p) {
  vec r;
  for (int i = 0; i < 8; ++i) r.v[i] = *p;
  return r;
}
inline vec vfma(vec a, vec b, vec c) {
  for (int i = 0; i < 8; ++i) c.v[i] = __builtin_fmaf(a.v[i], b.v[i], c.v[i]);
  return c;
}
inline void vput(float* p, vec v) {
  for (int i = 0; i < 8; ++i) p[i] = v.v[i];
}
inline void vstore(float* p, vec v, const float* bias, int64_t n) {
  for (int64_t i = 0; i < std::min<int64_t>(n, LANES); ++i) p[i] = bias ? v.v[i] + bias[i] : v.v[i];
}
}  // namespace
#endif

namespace {

constexpr int64_t BW = 2 * LANES;  // output features per packed block (two vectors)
constexpr int64_t PREFETCH_K = 16;  // the first row tile prefetches the block this many k steps ahead
// More rows than one tile holds: k in chunks of KC, every tile of rows over one chunk before the next, each
// tile's chains carried from chunk to chunk in memory (the same fused multiply-adds in the same k order, so the
// same bits). A pair's chunk (KC x 2 BW floats, 32 KB on AVX-512) then comes from memory for the first tile and
// from L1 for the others, where whole blocks (147-393 KB on SmolLM2) came from L2 for every tile.
constexpr int64_t KC = 128;

// NR rows against NB blocks over k in [k0, k1): the chains start from `part` (NR x 2 NB vectors; from zero when k0
// is 0) and go back to it, or, when k1 is K, to y (+ bias).
template <int NR, int NB>
inline void tile_part(const float* x, int64_t ldx, const float* wp, int64_t K, int64_t k0, int64_t k1, float* part,
                      float* y, int64_t ldy, const float* bias, int64_t valid, bool prefetch) {
  vec acc[NR][2 * NB];
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < 2 * NB; ++j) acc[r][j] = k0 ? vload(part + (r * 2 * NB + j) * LANES) : vzero();
  const int64_t block = K * BW;
  for (int64_t k = k0; k < k1; ++k) {
    vec w[2 * NB];
    for (int b = 0; b < NB; ++b) {
      const float* p = wp + b * block + k * BW;
      w[2 * b] = vload(p);
      w[2 * b + 1] = vload(p + LANES);
      if (prefetch) {
        __builtin_prefetch(p + PREFETCH_K * BW, 0, 3);
        if (BW * 4 > 64) __builtin_prefetch(p + PREFETCH_K * BW + 16, 0, 3);
      }
    }
    for (int r = 0; r < NR; ++r) {
      const vec xv = vbroadcast(x + r * ldx + k);
      for (int j = 0; j < 2 * NB; ++j) acc[r][j] = vfma(xv, w[j], acc[r][j]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < 2 * NB; ++j) {
      if (k1 == K)
        vstore(y + r * ldy + j * LANES, acc[r][j], bias ? bias + j * LANES : nullptr, valid - j * LANES);
      else
        vput(part + (r * 2 * NB + j) * LANES, acc[r][j]);
    }
}

// NR rows against NB consecutive blocks (NB * BW features, `valid` of them real): every k in one go.
template <int NR, int NB>
inline void tile(const float* x, int64_t ldx, const float* wp, int64_t K, float* y, int64_t ldy,
                 const float* bias, int64_t valid, bool prefetch) {
  tile_part<NR, NB>(x, ldx, wp, K, 0, K, nullptr, y, ldy, bias, valid, prefetch);
}

template <int NB, int NR>
inline void rest_part(const float* x, int64_t ldx, int64_t left, const float* wp, int64_t K, int64_t k0, int64_t k1,
                      float* part, float* y, int64_t ldy, const float* bias, int64_t valid, bool prefetch) {
  if constexpr (NR > 0) {
    if (left == NR) return tile_part<NR, NB>(x, ldx, wp, K, k0, k1, part, y, ldy, bias, valid, prefetch);
    rest_part<NB, NR - 1>(x, ldx, left, wp, K, k0, k1, part, y, ldy, bias, valid, prefetch);
  }
}

template <int NB, int NR>
inline void rest(const float* x, int64_t ldx, int64_t left, const float* wp, int64_t K, float* y, int64_t ldy,
                 const float* bias, int64_t valid, bool prefetch) {
  if constexpr (NR > 0) {
    if (left == NR) return tile<NR, NB>(x, ldx, wp, K, y, ldy, bias, valid, prefetch);
    rest<NB, NR - 1>(x, ldx, left, wp, K, y, ldy, bias, valid, prefetch);
  }
}

// Every row against NB blocks: rows in tiles of NR_MAX, then the ones left over.
template <int NB>
inline void rows(const float* x, int64_t ldx, int64_t R, const float* wp, int64_t K, float* y, int64_t ldy,
                 const float* bias, int64_t valid) {
  int64_t r = 0;
  bool prefetch = true;  // only the first tile reads the block from memory
  for (; r + NR_MAX <= R; r += NR_MAX, prefetch = false)
    tile<NR_MAX, NB>(x + r * ldx, ldx, wp, K, y + r * ldy, ldy, bias, valid, prefetch);
  if (r < R) rest<NB, NR_MAX - 1>(x + r * ldx, ldx, R - r, wp, K, y + r * ldy, ldy, bias, valid, prefetch);
}

// Every row against a pair of blocks: all rows in one tile up to PAIR_ONE, else tiles of PAIR_TILE (the first
// reads the pair from memory, the others from L2).
// `part`: room for R rows' chains (R x 4 vectors).
inline void pair_rows(const float* x, int64_t ldx, int64_t R, const float* wp, int64_t K, float* y, int64_t ldy,
                      const float* bias, int64_t valid, float* part) {
  if (R <= PAIR_ONE) return rest<2, PAIR_ONE>(x, ldx, R, wp, K, y, ldy, bias, valid, true);
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    const int64_t k1 = std::min<int64_t>(K, k0 + KC);
    bool prefetch = true;
    for (int64_t r = 0; r < R; r += PAIR_TILE, prefetch = false) {
      const int64_t n = std::min<int64_t>(PAIR_TILE, R - r);
      rest_part<2, PAIR_TILE>(x + r * ldx, ldx, n, wp, K, k0, k1, part + r * 4 * LANES, y + r * ldy, ldy, bias,
                              valid, prefetch);
    }
  }
}

at::Tensor fewrow_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.dim() == 2,
              "fewrow_pack: the weight must be a 2-d float32 CPU tensor, got ", weight.scalar_type(), " ",
              weight.sizes());
  const int64_t N = weight.size(0), K = weight.size(1), nb = (N + BW - 1) / BW;
  at::Tensor packed = at::zeros({nb, K, BW}, weight.options());
  const at::Tensor w = weight.contiguous();
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t j = 0; j < BW && b * BW + j < N; ++j)
        for (int64_t k = 0; k < K; ++k) dst[(b * K + k) * BW + j] = src[(b * BW + j) * K + k];
  });
  return packed;
}

at::Tensor fewrow_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                         int64_t out_features) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "fewrow_linear: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat,
              "fewrow_linear: float32 only, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "fewrow_linear: x must be (rows, K) with contiguous rows");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == BW && packed.is_contiguous(),
              "fewrow_linear: the weight must come from fewrow_pack (blocks of ", BW, ")");
  const int64_t R = x.size(0), K = x.size(1), nb = packed.size(0), N = out_features;
  TORCH_CHECK(packed.size(1) == K, "fewrow_linear: x has ", K, " features, the weight takes ", packed.size(1));
  TORCH_CHECK(N > (nb - 1) * BW && N <= nb * BW, "fewrow_linear: ", N, " output features do not fit ", nb,
              " blocks of ", BW);
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == N &&
                    bias->stride(0) == 1,
                "fewrow_linear: the bias must be a contiguous float32 vector of ", N);
    b = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({R, N}, x.options());
  if (R == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  at::parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {
    int64_t i = b0;
    std::vector<float> part(R > PAIR_ONE ? R * 4 * LANES : 0);
    if (R <= PAIR_ONE || PAIR_TILE > 1)  // two blocks at once where the registers allow (see PAIR_ONE)
      for (; i + 2 <= b1; i += 2)
        pair_rows(xp, ldx, R, wp + i * K * BW, K, yp + i * BW, N, b ? b + i * BW : nullptr,
                  std::min<int64_t>(2 * BW, N - i * BW), part.data());
    for (; i < b1; ++i)  // a block left over: one block at a time, in tiles of NR_MAX
      rows<1>(xp, ldx, R, wp + i * K * BW, K, yp + i * BW, N, b ? b + i * BW : nullptr,
              std::min<int64_t>(BW, N - i * BW));
  });
  return y;
}

std::string fewrow_isa() { return FEWROW_ISA; }
int64_t fewrow_block() { return BW; }

}  // namespace

TORCH_LIBRARY(entmtp, m) {
  m.def("fewrow_pack(Tensor weight) -> Tensor");
  m.def("fewrow_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
  m.def("fewrow_isa() -> str", &fewrow_isa);
  m.def("fewrow_block() -> int", &fewrow_block);
}

TORCH_LIBRARY_IMPL(entmtp, CPU, m) {
  m.impl("fewrow_pack", fewrow_pack);
  m.impl("fewrow_linear", fewrow_linear);
}
