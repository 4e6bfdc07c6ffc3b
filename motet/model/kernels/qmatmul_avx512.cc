// The kernels with AVX-512 (F, BW, VL, DQ), chosen at run time where the CPU has them.
#include "qmatmul_headers.h"
#if defined(__x86_64__)
#include <immintrin.h>
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#define VW 16
#define NS avx512
namespace motet_qmatmul::avx512 {
namespace {
typedef float vf __attribute__((vector_size(64)));
inline vf int8s(const uint8_t* p) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q));
}
inline void nibbles(const uint8_t* p, vf& lo, vf& hi) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(15);
  lo = (vf)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(q, mask)));
  hi = (vf)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), mask)));
}
inline vf q4_dot(const uint8_t* p, const int16_t* x) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(15);
  const __m256i both = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), mask), _mm_and_si128(q, mask));
  const __m512i values = _mm512_cvtepu8_epi16(both);  // the block's 32 values in order
  return (vf)_mm512_cvtepi32_ps(_mm512_madd_epi16(values, _mm512_loadu_si512(x)));
}
inline vf q8_dot16(const uint8_t* p, const int16_t* x) {
  const __m256i q = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i sums = _mm256_madd_epi16(q, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
  return (vf)_mm512_cvtepi32_ps(_mm512_zextsi256_si512(sums));
}
inline vf halves(const uint16_t* p) {
  return (vf)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
}  // namespace
}  // namespace motet_qmatmul::avx512
#define MOTET_VF motet_qmatmul::avx512::vf
#define MOTET_MATVEC_DOTS "matvec_avx512.inc"
#include "qmatmul_body.inc"
#include "attend_body.inc"
#include "swiglu_body.inc"
#endif
