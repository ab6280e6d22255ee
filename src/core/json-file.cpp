#include "core/json-file.h"

#include "core/error.h"

#include <fstream>

namespace prescope {

nlohmann::json read_json_file(const std::string &path, std::string_view what) {
    std::ifstream in(path);
    if (!in) fail("{}: cannot open {}", path, what);
    try {
        return nlohmann::json::parse(in);
    } catch (const nlohmann::json::exception &e) {
        fail("{}: not valid JSON: {}", path, e.what());
    }
}

void check_json_header(const nlohmann::json &j, std::string_view source, std::string_view format,
                       std::string_view what) {
    if (!j.is_object()) fail("{}: {} must be a JSON object", source, what);
    if (!j.contains("format") || !j["format"].is_string() || j["format"].get<std::string>() != format) {
        fail("{}: 'format' must be \"{}\"", source, format);
    }
    if (!j.contains("version") || !j["version"].is_number_integer() || j["version"].get<int64_t>() != 1) {
        fail("{}: 'version' must be 1", source);
    }
}

} // namespace prescope
