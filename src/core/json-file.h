// Reading a whole JSON document from a file, with the project's one-line errors.
#pragma once

#include <nlohmann/json.hpp>

#include <string>
#include <string_view>

namespace prescope {

/// The JSON document in `path`. Throws prescope::Error "PATH: cannot open WHAT" when the file cannot be read and
/// "PATH: not valid JSON: ..." (with the parser's position) when it does not parse. `what` names the file's role
/// ("the cost profile", "placement plan").
nlohmann::json read_json_file(const std::string &path, std::string_view what);

} // namespace prescope
