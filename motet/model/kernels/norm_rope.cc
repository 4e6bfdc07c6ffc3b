// A layer's work between its products, for XLA:CPU: root-mean-square norms (alone, or
// after the residual add before them), and the QKV projection made heads (split, q and k
// normed where the model norms them, then turned by their positions). XLA:CPU runs a norm
// as four kernels and the add as a fifth, and the split and rotation as four more; every
// kernel is a thunk a step runs and memory each compiled step holds (docs/performance.md).
// Here each is one call. Rows are short (the model's width), so a call stays on its own
// thread.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// 1 / sqrt(mean(x²) + eps) over n values. Sixteen partial sums, a vector's lanes for the
// compiler (a sum per value in turn would be one long chain), and rounding close to
// XLA's tree of sums.
float inverse_rms(const float* __restrict x, int64_t n, float eps) {
  constexpr int LANES = 16;
  float parts[LANES] = {};
  int64_t j = 0;
  for (; j + LANES <= n; j += LANES)
    for (int l = 0; l < LANES; ++l) parts[l] += x[j + l] * x[j + l];
  for (; j < n; ++j) parts[j % LANES] += x[j] * x[j];
  float squares = 0.f;
  for (float p : parts) squares += p;
  return 1.f / std::sqrt(squares / static_cast<float>(n) + eps);
}

// x · scale · w over n values, in place.
void scale_by(float* __restrict x, int64_t n, float scale, const float* __restrict w) {
  for (int64_t j = 0; j < n; ++j) x[j] = x[j] * scale * w[j];
}

// normed[r] = row / sqrt(mean(row²) + eps) · weight, row = x[r] (+ residual[r], also
// stored in sum[r]), over rows of weight's length. An empty residual: no add, and an
// empty sum.
ffi::Error RmsNorm(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> residual, ffi::Buffer<ffi::F32> weight,
                   ffi::ResultBuffer<ffi::F32> sum, ffi::ResultBuffer<ffi::F32> normed, float eps) {
  const int64_t d = static_cast<int64_t>(weight.element_count()), n = static_cast<int64_t>(x.element_count());
  const bool add = residual.element_count() != 0;
  const auto dims = x.dimensions();
  if (d == 0 || dims.size() == 0 || dims.back() != d || normed->element_count() != x.element_count())
    return ffi::Error::InvalidArgument("rms_norm: x's last axis is not the weight's length");
  if (add && (residual.element_count() != x.element_count() || sum->element_count() != x.element_count()))
    return ffi::Error::InvalidArgument("rms_norm: the residual and the sum must have x's shape");
  for (int64_t r = 0; r < n / d; ++r) {
    float* __restrict out = normed->typed_data() + r * d;
    const float* a = x.typed_data() + r * d;
    if (add) {
      const float* b = residual.typed_data() + r * d;
      float* __restrict s = sum->typed_data() + r * d;
      for (int64_t j = 0; j < d; ++j) out[j] = a[j] + b[j];
      std::memcpy(s, out, d * sizeof(float));
    } else {
      std::memcpy(out, a, d * sizeof(float));
    }
    scale_by(out, d, inverse_rms(out, d, eps), weight.typed_data());
  }
  return ffi::Error::Success();
}

enum HeadNorm : int64_t { NONE = 0, PER_HEAD = 1, ALL_HEADS = 2 };

// `heads` heads of d values at x, normed as `norm` says (weights w: [d] per head, or
// [heads · d] over them all), then each value i turned with value i + d/2.
void make_heads(float* x, int64_t heads, int64_t d, int64_t norm, const float* w, float eps, const float* cos,
                const float* sin) {
  if (norm == ALL_HEADS) scale_by(x, heads * d, inverse_rms(x, heads * d, eps), w);
  const int64_t half = d / 2;
  for (int64_t h = 0; h < heads; ++h, x += d) {
    if (norm == PER_HEAD) scale_by(x, d, inverse_rms(x, d, eps), w);
    for (int64_t i = 0; i < half; ++i) {
      const float a = x[i], b = x[half + i];
      x[i] = a * cos[i] - b * sin[i];
      x[half + i] = b * cos[i] + a * sin[i];
    }
  }
}

// proj [t, (q_heads + 2 · kv_heads) · d], positions [t], inv_freq [d/2], the norms'
// weights (empty without them) → q [t, q_heads, d], k and v [t, kv_heads, d].
ffi::Error QkvHeads(ffi::Buffer<ffi::F32> proj, ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::F32> inv_freq,
                    ffi::Buffer<ffi::F32> q_norm, ffi::Buffer<ffi::F32> k_norm, ffi::ResultBuffer<ffi::F32> q,
                    ffi::ResultBuffer<ffi::F32> k, ffi::ResultBuffer<ffi::F32> v, int64_t q_heads, int64_t kv_heads,
                    int64_t norm, float eps) {
  const int64_t tokens = static_cast<int64_t>(positions.element_count());
  const int64_t half = static_cast<int64_t>(inv_freq.element_count()), d = 2 * half;
  const int64_t q_width = q_heads * d, kv_width = kv_heads * d, width = q_width + 2 * kv_width;
  const auto dims = proj.dimensions();
  if (half == 0 || dims.size() != 2 || dims[0] != tokens || dims[1] != width)
    return ffi::Error::InvalidArgument("qkv_heads: proj must be [tokens, (q_heads + 2 * kv_heads) * 2 * len(inv_freq)]");
  if (q->element_count() != tokens * q_width || k->element_count() != tokens * kv_width ||
      v->element_count() != tokens * kv_width)
    return ffi::Error::InvalidArgument("qkv_heads: the results must hold q_heads and kv_heads heads a token");
  const int64_t q_weights = norm == PER_HEAD ? d : norm == ALL_HEADS ? q_width : 0;
  const int64_t k_weights = norm == PER_HEAD ? d : norm == ALL_HEADS ? kv_width : 0;
  if (norm < NONE || norm > ALL_HEADS || static_cast<int64_t>(q_norm.element_count()) != q_weights ||
      static_cast<int64_t>(k_norm.element_count()) != k_weights)
    return ffi::Error::InvalidArgument("qkv_heads: the norms' weights do not fit the norm asked for");
  std::vector<float> cos(half), sin(half);
  for (int64_t t = 0; t < tokens; ++t) {
    const float position = static_cast<float>(positions.typed_data()[t]);
    for (int64_t i = 0; i < half; ++i) {
      const float angle = position * inv_freq.typed_data()[i];
      cos[i] = std::cos(angle);
      sin[i] = std::sin(angle);
    }
    const float* row = proj.typed_data() + t * width;
    float* qt = q->typed_data() + t * q_width;
    float* kt = k->typed_data() + t * kv_width;
    std::memcpy(qt, row, q_width * sizeof(float));
    std::memcpy(kt, row + q_width, kv_width * sizeof(float));
    std::memcpy(v->typed_data() + t * kv_width, row + q_width + kv_width, kv_width * sizeof(float));
    make_heads(qt, q_heads, d, norm, q_norm.typed_data(), eps, cos.data(), sin.data());
    make_heads(kt, kv_heads, d, norm, k_norm.typed_data(), eps, cos.data(), sin.data());
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MotetRmsNorm, RmsNorm,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("eps"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(MotetQkvHeads, QkvHeads,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("q_heads")
                                  .Attr<int64_t>("kv_heads")
                                  .Attr<int64_t>("norm")
                                  .Attr<float>("eps"));
