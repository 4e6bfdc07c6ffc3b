// The AVX-512 kernels with VNNI besides, chosen at run time where the CPU has it: the
// same kernels, the products of many rows of x as integer pairs (pairs_vnni.inc), and
// every product over a matrix held as panels (panels_vnni.inc).
#include "qmatmul_headers.h"
#if defined(__x86_64__)
#include <immintrin.h>
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
#define NS avx512vnni
#define MOTET_VNNI
#define MOTET_MANY_ROWS "pairs_vnni.inc"
#define MOTET_PANELS
#include "avx512_body.inc"
#endif
