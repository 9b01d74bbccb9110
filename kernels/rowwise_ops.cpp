// Row-wise float32 CPU ops of a decoder layer: RMSNorm (with the residual add), SiLU-and-mul and rotary position
// embedding, each one pass over a row instead of the 5-10 separate torch ops (and their allocations) that SGLang's
// `forward_native` versions dispatch. At decoding's few rows the torch versions cost 50-140 us a call in op overhead
// for microseconds of arithmetic (30 layers call them 120 times a step).
//
// Batch-invariant by construction: a row's result depends on that row alone (and on its position), computed in one
// fixed order whatever the number of rows, the thread that computes it or the vector width. Built with
// -ffp-contract=off (kernels/fewrow_linear.py), so no multiply-add is fused behind the source's back: the
// element-wise ops round exactly as torch's separate ops do, and the AVX-512, AVX2 and scalar builds agree bit for
// bit. The RMSNorm's sum of squares is carried in 16 fixed partial sums, added in a fixed order at the end.
// References: kernels/rowwise_ops.py.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

namespace {

constexpr int64_t GRAIN = 64;  // rows per task: decoding's few rows run on the calling thread

void check_rows(const at::Tensor& t, const char* op, const char* name, int64_t cols) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, op, ": ", name,
              " must be a float32 CPU tensor, got ", t.scalar_type(), " on ", t.device());
  TORCH_CHECK(t.dim() >= 1 && t.size(-1) == cols && t.is_contiguous(), op, ": ", name,
              " must be contiguous with ", cols, " features in its last dimension, got ", t.sizes());
}

inline float sum_of_squares(const float* x, int64_t n) {
  float part[16] = {0};
  int64_t k = 0;
  for (; k + 16 <= n; k += 16)
    for (int j = 0; j < 16; ++j) part[j] += x[k + j] * x[k + j];
  for (int j = 0; k < n; ++k, ++j) part[j] += x[k] * x[k];
  for (int w = 8; w >= 1; w /= 2)
    for (int j = 0; j < w; ++j) part[j] += part[j + w];
  return part[0];
}

inline void normalize(const float* x, const float* w, float* out, int64_t n, double eps) {
  const float var = sum_of_squares(x, n) / static_cast<float>(n);
  const float r = 1.0f / std::sqrt(var + static_cast<float>(eps));
  for (int64_t k = 0; k < n; ++k) out[k] = (x[k] * r) * w[k];
}

// out = x / sqrt(mean(x^2) + eps) * weight, per row.
at::Tensor rmsnorm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t n = weight.size(0);
  check_rows(x, "rmsnorm", "x", n);
  check_rows(weight, "rmsnorm", "weight", n);
  at::Tensor out = at::empty_like(x);
  const int64_t rows = n ? x.numel() / n : 0;
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, GRAIN, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) normalize(xp + r * n, wp, op + r * n, n, eps);
  });
  return out;
}

// s = x + residual; returns (rmsnorm(s), s), per row.
std::tuple<at::Tensor, at::Tensor> add_rmsnorm(const at::Tensor& x, const at::Tensor& residual,
                                               const at::Tensor& weight, double eps) {
  const int64_t n = weight.size(0);
  check_rows(x, "add_rmsnorm", "x", n);
  check_rows(residual, "add_rmsnorm", "residual", n);
  check_rows(weight, "add_rmsnorm", "weight", n);
  TORCH_CHECK(x.sizes() == residual.sizes(), "add_rmsnorm: x ", x.sizes(), " and residual ", residual.sizes(),
              " differ");
  at::Tensor out = at::empty_like(x), sum = at::empty_like(x);
  const int64_t rows = n ? x.numel() / n : 0;
  const float *xp = x.data_ptr<float>(), *rp = residual.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float *op = out.data_ptr<float>(), *sp = sum.data_ptr<float>();
  at::parallel_for(0, rows, GRAIN, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* s = sp + r * n;
      for (int64_t k = 0; k < n; ++k) s[k] = xp[r * n + k] + rp[r * n + k];
      normalize(s, wp, op + r * n, n, eps);
    }
  });
  return {out, sum};
}

// exp(x) as Cephes' expf computes it: n = round(x log2(e)) (by the 1.5 * 2^23 rounding constant), r = x - n ln(2)
// in two parts, exp(r) = 1 + r + r^2 P(r) (degree 5), times 2^n built in the exponent bits; x clamped to [-87, 88]
// (exp(88) is finite, 2^-126 normal). Within 2 ulp of the true exp; only IEEE operations and integer bit moves, no
// libm call, so the loops below vectorize (std::exp did not: a scalar call per element, 10x the cost at 16 rows).
inline float exp_cephes(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float t = std::fma(x, 1.44269504088896341f, 12582912.0f);
  const float n = t - 12582912.0f;
  float r = std::fma(n, -0.693359375f, x);
  r = std::fma(n, 2.12194440e-4f, r);
  float p = std::fma(1.9875691500e-4f, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  const float y = std::fma(p, r * r, r) + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &t, sizeof bits);
  const int32_t e = (bits - 0x4B400000 + 127) << 23;  // t's low bits hold n
  float scale;
  std::memcpy(&scale, &e, sizeof scale);
  return y * scale;
}

// out = silu(x[..., :d]) * x[..., d:], silu(a) = a / (1 + exp(-a)) (exp_cephes), per row.
at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) % 2 == 0, "silu_and_mul: the last dimension must be even, got ", x.sizes());
  const int64_t two_d = x.size(-1), d = two_d / 2;
  check_rows(x, "silu_and_mul", "x", two_d);
  auto shape = x.sizes().vec();
  shape.back() = d;
  at::Tensor out = at::empty(shape, x.options());
  const int64_t rows = two_d ? x.numel() / two_d : 0;
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, GRAIN, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float *a = xp + r * two_d, *b = a + d;
      float* o = op + r * d;
      for (int64_t k = 0; k < d; ++k) o[k] = (a[k] / (1.0f + exp_cephes(-a[k]))) * b[k];
    }
  });
  return out;
}

// Rotary embedding of one (tokens, heads * head_size) tensor: the first rotary_dim features of each head rotated
// by the cos/sin of the token's position (cache row: rotary_dim / 2 cosines, then as many sines), the rest copied.
// neox: pairs (i, i + rotary_dim / 2); otherwise (2i, 2i + 1). o1 = x1 * cos - x2 * sin, o2 = x2 * cos + x1 * sin.
void rope_one(const at::Tensor& x, at::Tensor& out, const int64_t* pos, const float* cache, int64_t head_size,
              int64_t rotary_dim, bool neox) {
  const int64_t tokens = pos ? out.size(0) : 0, width = x.size(-1), heads = width / head_size, half = rotary_dim / 2;
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, tokens, GRAIN, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t p = pos[t];  // checked by the caller
      const float *c = cache + p * rotary_dim, *s = c + half;
      for (int64_t h = 0; h < heads; ++h) {
        const float* xi = xp + t * width + h * head_size;
        float* o = op + t * width + h * head_size;
        for (int64_t i = 0; i < half; ++i) {
          const int64_t i1 = neox ? i : 2 * i, i2 = neox ? i + half : 2 * i + 1;
          const float x1 = xi[i1], x2 = xi[i2];
          o[i1] = x1 * c[i] - x2 * s[i];
          o[i2] = x2 * c[i] + x1 * s[i];
        }
        for (int64_t i = rotary_dim; i < head_size; ++i) o[i] = xi[i];
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> rope(const at::Tensor& positions, const at::Tensor& query, const at::Tensor& key,
                                        const at::Tensor& cos_sin_cache, int64_t head_size, bool neox) {
  TORCH_CHECK(positions.device().is_cpu() && positions.scalar_type() == at::kLong && positions.is_contiguous(),
              "rope: positions must be a contiguous int64 CPU tensor, got ", positions.scalar_type());
  TORCH_CHECK(cos_sin_cache.dim() == 2 && cos_sin_cache.scalar_type() == at::kFloat && cos_sin_cache.is_contiguous(),
              "rope: the cos/sin cache must be a contiguous 2-d float32 tensor");
  const int64_t rotary_dim = cos_sin_cache.size(1), tokens = positions.numel();
  TORCH_CHECK(head_size > 0 && rotary_dim % 2 == 0 && rotary_dim <= head_size, "rope: rotary_dim ", rotary_dim,
              " must be even and at most head_size ", head_size);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos_sin_cache.size(0), "rope: position ", pos[t],
                " is outside the cos/sin cache (", cos_sin_cache.size(0), " positions)");
  at::Tensor out[2];
  const at::Tensor* in[2] = {&query, &key};
  for (int j = 0; j < 2; ++j) {
    const at::Tensor& x = *in[j];
    TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.is_contiguous(),
                "rope: query and key must be contiguous float32 CPU tensors");
    TORCH_CHECK(tokens > 0 ? x.numel() % (tokens * head_size) == 0 : x.numel() == 0, "rope: ", x.sizes(),
                " is not (", tokens, " tokens, heads x ", head_size, ")");
    const int64_t width = tokens > 0 ? x.numel() / tokens : 0;
    out[j] = at::empty_like(x);
    at::Tensor o2 = out[j].view({tokens, width});
    if (tokens > 0)
      rope_one(x.view({tokens, width}), o2, pos, cos_sin_cache.data_ptr<float>(), head_size, rotary_dim, neox);
  }
  return {out[0], out[1]};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(entmtp, m) {
  m.def("rmsnorm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rmsnorm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("rope(Tensor positions, Tensor query, Tensor key, Tensor cos_sin_cache, int head_size, bool neox) -> "
        "(Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(entmtp, CPU, m) {
  m.impl("rmsnorm", rmsnorm);
  m.impl("add_rmsnorm", add_rmsnorm);
  m.impl("silu_and_mul", silu_and_mul);
  m.impl("rope", rope);
}
