// The kernels for any CPU: the compiler's baseline vectors (SSE2 on x86-64).
#include "qmatmul_headers.h"
#define VW 4
#define NS base
namespace motet_qmatmul::base {
namespace {
typedef float vf __attribute__((vector_size(VW * 4)));
inline vf int8s(const uint8_t* p) {
  vf v;
  for (int i = 0; i < VW; ++i) v[i] = static_cast<float>(static_cast<int8_t>(p[i]));
  return v;
}
inline void nibbles(const uint8_t* p, vf& lo, vf& hi) {
  for (int i = 0; i < VW; ++i) {
    lo[i] = static_cast<float>(p[i] & 15);
    hi[i] = static_cast<float>(p[i] >> 4);
  }
}
inline vf q4_dot(const uint8_t* p, const int16_t* x) {
  int32_t sum = 0;
  for (int i = 0; i < 16; ++i) sum += (p[i] & 15) * x[i] + (p[i] >> 4) * x[16 + i];
  vf v = {};
  v[0] = static_cast<float>(sum);
  return v;
}
inline vf q8_dot16(const uint8_t* p, const int16_t* x) {
  int32_t sum = 0;
  for (int i = 0; i < 16; ++i) sum += static_cast<int8_t>(p[i]) * x[i];
  vf v = {};
  v[0] = static_cast<float>(sum);
  return v;
}
inline vf halves(const uint16_t* p) {
  vf v;
  for (int i = 0; i < VW; ++i) v[i] = half_to_float(p[i]);
  return v;
}
}  // namespace
}  // namespace motet_qmatmul::base
#define MOTET_VF motet_qmatmul::base::vf
#include "qmatmul_body.inc"
#include "attend_body.inc"
#include "swiglu_body.inc"
