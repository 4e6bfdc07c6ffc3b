// What qmatmul_body.inc needs, included before any target pragma.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "qmatmul.h"

// An IEEE half's bits as a float (where the instruction set has no conversion).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16, exponent = (h >> 10) & 31, mantissa = h & 1023;
  uint32_t bits;
  if (exponent == 31) {
    bits = sign | 0x7f800000u | mantissa << 13;  // inf or NaN
  } else if (exponent != 0) {
    bits = sign | (exponent + 112) << 23 | mantissa << 13;
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    int shift = 0;
    uint32_t m = mantissa;
    while (!(m & 1024)) m <<= 1, ++shift;
    bits = sign | static_cast<uint32_t>(113 - shift) << 23 | (m & 1023) << 13;
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
