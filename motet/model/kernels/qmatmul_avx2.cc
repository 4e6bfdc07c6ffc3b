// The kernels with AVX2 and FMA, chosen at run time where the CPU has them.
#include "qmatmul_headers.h"
#if defined(__x86_64__)
#include <immintrin.h>
#pragma GCC target("avx2,fma,f16c")
#define VW 8
#define NS avx2
namespace motet_qmatmul::avx2 {
namespace {
typedef float vf __attribute__((vector_size(32)));
inline vf int8s(const uint8_t* p) {
  const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
}
inline void nibbles(const uint8_t* p, vf& lo, vf& hi) {
  const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(15);
  lo = (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(q, mask)));
  hi = (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), mask)));
}
inline vf q4_dot(const uint8_t* p, const int16_t* x) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(15);
  const __m256i lo = _mm256_cvtepu8_epi16(_mm_and_si128(q, mask));
  const __m256i hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(q, 4), mask));
  const __m256i sums = _mm256_add_epi32(
      _mm256_madd_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))),
      _mm256_madd_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16))));
  return (vf)_mm256_cvtepi32_ps(sums);
}
inline vf q8_dot16(const uint8_t* p, const int16_t* x) {
  const __m256i q = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return (vf)_mm256_cvtepi32_ps(_mm256_madd_epi16(q, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))));
}
inline vf halves(const uint16_t* p) {
  return (vf)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
}  // namespace
}  // namespace motet_qmatmul::avx2
#define MOTET_VF motet_qmatmul::avx2::vf
#define MOTET_MATVEC_DOTS "matvec_avx2.inc"
#define MOTET_MANY_ROWS "pairs_avx2.inc"
#define MOTET_PANELS
#include "qmatmul_body.inc"
#include "attend_body.inc"
#include "swiglu_body.inc"
#endif
