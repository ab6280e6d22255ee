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

/// Checks the header every PreScope JSON document carries: an object whose "format" is `format` and whose
/// "version" is the integer 1. Throws prescope::Error "SOURCE: WHAT must be a JSON object", "SOURCE: 'format' must
/// be \"FORMAT\"" or "SOURCE: 'version' must be 1". `what` names the document ("a placement plan").
void check_json_header(const nlohmann::json &j, std::string_view source, std::string_view format,
                       std::string_view what);

} // namespace prescope
