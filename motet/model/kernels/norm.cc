// Root-mean-square norms for XLA:CPU, alone or after the residual add before them. XLA:CPU
// runs one norm as four kernels (a multiply, a windowed sum, the rsqrt, the scaling) and
// the add as a fifth; every kernel is a thunk a step runs and about 0.1 MB that each
// compiled step holds. Here it is one call. Rows are short (the model's width), so the
// call stays on its own thread.
#include <cmath>
#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

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
  const float* w = weight.typed_data();
  for (int64_t r = 0; r < n / d; ++r) {
    const float* a = x.typed_data() + r * d;
    float* out = normed->typed_data() + r * d;
    // eight partial sums: the compiler keeps them in a vector, and the rounding stays
    // close to XLA's tree of sums
    float parts[8] = {};
    if (add) {
      const float* b = residual.typed_data() + r * d;
      float* s = sum->typed_data() + r * d;
      for (int64_t j = 0; j < d; ++j) {
        s[j] = out[j] = a[j] + b[j];
        parts[j % 8] += out[j] * out[j];
      }
    } else {
      for (int64_t j = 0; j < d; ++j) {
        out[j] = a[j];
        parts[j % 8] += a[j] * a[j];
      }
    }
    float squares = 0.f;
    for (float p : parts) squares += p;
    const float scale = 1.f / std::sqrt(squares / static_cast<float>(d) + eps);
    for (int64_t j = 0; j < d; ++j) out[j] = out[j] * scale * w[j];
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
