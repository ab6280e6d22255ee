// Byte-size parsing and printing (units as GNU coreutils reads them).
#include "offload/byte-size.h"

#include "core/error.h"

#include <array>
#include <cctype>
#include <charconv>
#include <cmath>

namespace prescope {

uint64_t parse_byte_size(std::string_view text, std::string_view what) {
    auto bad = [&]() {
        fail("invalid size '{}' for {}: expected a number with an optional unit "
             "(B; KB, MB, GB, TB = powers of 1000; K, M, G, T, KiB, MiB, GiB, TiB = powers of 1024)",
             text, what);
    };
    size_t i = 0;
    while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.')) ++i;
    if (i == 0) bad();
    double value = 0;
    auto [end, ec] = std::from_chars(text.data(), text.data() + i, value);
    if (ec != std::errc() || end != text.data() + i) bad();

    size_t u = i;
    while (u < text.size() && text[u] == ' ') ++u;
    std::string unit;
    for (; u < text.size(); ++u) unit += char(std::tolower(static_cast<unsigned char>(text[u])));

    struct Unit {
        const char *name;
        double scale;
    };
    static constexpr std::array<Unit, 14> kUnits{{
        {"", 1},         {"b", 1},
        {"kb", 1e3},     {"mb", 1e6},     {"gb", 1e9},     {"tb", 1e12},
        {"k", 0x1p10},   {"m", 0x1p20},   {"g", 0x1p30},   {"t", 0x1p40},
        {"kib", 0x1p10}, {"mib", 0x1p20}, {"gib", 0x1p30}, {"tib", 0x1p40},
    }};
    double scale = 0;
    for (const Unit &k : kUnits) {
        if (unit == k.name) scale = k.scale;
    }
    if (scale == 0) bad();
    double bytes = std::floor(value * scale);
    if (!(bytes < 0x1p64)) bad();
    return uint64_t(bytes);
}

std::string format_byte_size(uint64_t n_bytes) {
    static constexpr std::array<const char *, 5> kNames{"B", "KiB", "MiB", "GiB", "TiB"};
    if (n_bytes < 1024) return fmt::format("{} B", n_bytes);
    double v = double(n_bytes);
    size_t k = 0;
    while (v >= 1024 && k + 1 < kNames.size()) {
        v /= 1024;
        ++k;
    }
    return fmt::format("{:.2f} {}", v, kNames[k]);
}

} // namespace prescope
