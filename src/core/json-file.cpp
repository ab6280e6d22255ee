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

} // namespace prescope
