// IEEE binary16 and bfloat16 <-> float conversions, round-to-nearest-even.
// Reductions widen each element to float, combine, and round once per
// combine step, which is what gloo's half reductions do as well.
#pragma once

#include <cstdint>
#include <cstring>

namespace fsdp_ext::comm {

inline float bits_to_float(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

inline uint32_t float_to_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

inline float bfloat16_to_float(uint16_t value) {
  return bits_to_float(static_cast<uint32_t>(value) << 16);
}

inline uint16_t float_to_bfloat16(float value) {
  uint32_t bits = float_to_bits(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    return static_cast<uint16_t>((bits >> 16) | 0x40);  // quiet NaN
  }
  const uint32_t rounding_bias = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding_bias) >> 16);
}

inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {
    if (mantissa == 0) return bits_to_float(sign);
    // Subnormal half: normalise into a float.
    int shift = 0;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      ++shift;
    }
    mantissa &= 0x3ffu;
    const uint32_t float_exponent = static_cast<uint32_t>(127 - 15 + 1 - shift);
    return bits_to_float(sign | (float_exponent << 23) | (mantissa << 13));
  }
  if (exponent == 0x1f) {
    return bits_to_float(sign | 0x7f800000u | (mantissa << 13));
  }
  return bits_to_float(sign | ((exponent + 127 - 15) << 23) | (mantissa << 13));
}

inline uint16_t float_to_half(float value) {
  const uint32_t bits = float_to_bits(value);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs_bits = bits & 0x7fffffffu;
  if (abs_bits > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);
  if (abs_bits >= 0x477ff000u) {
    // Rounds to >= 65520: overflow to infinity (or it already is one).
    return static_cast<uint16_t>(sign | 0x7c00u);
  }
  if (abs_bits < 0x38800000u) {
    // Result is a half subnormal (or zero): add 0.5 so the FPU does the
    // round-to-nearest-even at the right bit position.
    const float magic = bits_to_float(0x3f000000u);  // 0.5f
    const float shifted = bits_to_float(abs_bits) + magic;
    return static_cast<uint16_t>(sign | (float_to_bits(shifted) - 0x3f000000u));
  }
  const uint32_t mantissa_odd = (abs_bits >> 13) & 1u;
  uint32_t rounded = abs_bits + 0xfffu + mantissa_odd;
  rounded -= (127u - 15u) << 23;
  return static_cast<uint16_t>(sign | (rounded >> 13));
}

}  // namespace fsdp_ext::comm
