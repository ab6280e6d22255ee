// Byte sizes as users write them ("12GiB", "512MiB", "1.5GB") for --gpu-expert-budget and gpu_cache.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace prescope {

/// Parses a non-negative byte size: a decimal number with an optional unit, case-insensitive, spaces
/// allowed before the unit. Units follow GNU coreutils (dd, df): B = 1; KB, MB, GB, TB = powers of 1000;
/// K, M, G, T and KiB, MiB, GiB, TiB = powers of 1024. Fractions round down to whole bytes.
/// Throws prescope::Error naming `what` (e.g. "--gpu-expert-budget") on anything else.
uint64_t parse_byte_size(std::string_view text, std::string_view what);

/// Human-readable size with a binary unit and two decimals ("12.00 GiB", "9.38 MiB", "512 B").
std::string format_byte_size(uint64_t n_bytes);

} // namespace prescope
