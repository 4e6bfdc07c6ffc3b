// The kernels with AVX-512 (F, BW, VL, DQ), chosen at run time where the CPU has them.
#include "qmatmul_headers.h"
#if defined(__x86_64__)
#include <immintrin.h>
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#define NS avx512
#include "avx512_body.inc"
#endif
