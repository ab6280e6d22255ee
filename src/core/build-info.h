// What this binary was built from and with (prescope --version; bench rows).
#pragma once

namespace prescope {

struct BuildInfo {
    const char *commit;       // git commit of the source tree, 12 hex digits ("-dirty" with local changes), or "unknown"
    const char *commit_date;  // its date, YYYY-MM-DD, or ""
    const char *compiler;     // "GNU 12.2.0"
    const char *build_type;   // CMAKE_BUILD_TYPE
    const char *cuda;         // "CUDA 13.0.88, architectures 90", or "" in builds without the CUDA backend
};

/// Filled in at build time (cmake/build-info.cmake).
const BuildInfo &build_info();

} // namespace prescope
