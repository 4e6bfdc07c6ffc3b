// The AVX-512 kernels with VNNI besides, chosen at run time where the CPU has it: the
// same kernels, and the products of many rows of x as integer pairs (pairs_vnni.inc).
#include "qmatmul_headers.h"
#if defined(__x86_64__)
#include <immintrin.h>
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
#define NS avx512vnni
#define MOTET_VNNI
#define MOTET_MANY_ROWS "pairs_vnni.inc"
#include "avx512_body.inc"
#endif
