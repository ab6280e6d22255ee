// A GPU timeline without Nsight Systems (which cannot make reports on the GPU machine): a CUPTI activity
// tracer the CUDA driver loads into any program through CUDA_INJECTION64_PATH. It records every kernel,
// memcpy and memset the program runs (device start and end, stream, kernel name or bytes and direction) and
// writes them, one CSV line each, to $PRESCOPE_TRACE_OUT (default cupti-trace.csv) at exit;
// bench/profile/timeline.py turns the file into per-token busy / idle time and the time per kernel.
//
//   CUDA_INJECTION64_PATH=build/bin/libprescope-cupti-trace.so PRESCOPE_TRACE_OUT=t.csv prescope generate ...
//
// CSV columns: kind (K kernel, C memcpy, S memset), start_ns, end_ns (CUPTI's device timestamps, one clock
// for all records), stream id, bytes (C, S; 0 for K), copy kind (CUpti_ActivityMemcpyKind: 1 HtoD, 2 DtoH,
// 8 DtoD, 10 PtoP; 0 otherwise), name (K: demangled, without its argument list, in double quotes: template
// arguments hold commas).
#include <cupti.h>
#include <cxxabi.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

namespace {

// Small buffers: the records of the last, partly filled buffer reach buffer_completed only at exit (finish), by
// when the kernel names they point to may be gone with the CUDA context; in the 2026-12-06 trace of a replayed
// decode graph every record after the last full 8 MiB buffer (44% of them) had a truncated name.
constexpr size_t kBufferBytes = size_t(1) << 20;

std::mutex g_mu;
FILE *g_out = nullptr;
uint64_t g_dropped = 0;

void check(CUptiResult r, const char *what) {
    if (r == CUPTI_SUCCESS) return;
    const char *msg = nullptr;
    cuptiGetResultString(r, &msg);
    std::fprintf(stderr, "cupti-trace: %s failed: %s\n", what, msg != nullptr ? msg : "?");
}

// "void ns::(anonymous namespace)::kernel<T, 4>(Args)" -> "void ns::kernel<T, 4>": the argument list repeats
// what the name says.
std::string short_name(const char *mangled) {
    int status = 0;
    char *d = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
    std::string s = status == 0 && d != nullptr ? d : mangled;
    std::free(d);
    static const std::string anon = "(anonymous namespace)::";
    for (size_t at; (at = s.find(anon)) != std::string::npos;) s.erase(at, anon.size());
    int depth = 0;  // cut at the first '(' outside template brackets
    for (size_t i = 0; i < s.size(); ++i) {
        if (s[i] == '<') ++depth;
        if (s[i] == '>') --depth;
        if (s[i] == '(' && depth == 0 && i > 0) return s.substr(0, i);
    }
    return s;
}

void CUPTIAPI buffer_requested(uint8_t **buffer, size_t *size, size_t *max_records) {
    *buffer = static_cast<uint8_t *>(std::aligned_alloc(8, kBufferBytes));
    *size = kBufferBytes;
    *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t *buffer, size_t, size_t valid) {
    std::lock_guard<std::mutex> lock(g_mu);
    CUpti_Activity *rec = nullptr;
    while (g_out != nullptr && cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
        switch (rec->kind) {
        case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL:
        case CUPTI_ACTIVITY_KIND_KERNEL: {
            const auto *k = reinterpret_cast<const CUpti_ActivityKernel10 *>(rec);
            std::fprintf(g_out, "K,%llu,%llu,%u,0,0,\"%s\"\n", (unsigned long long)k->start, (unsigned long long)k->end,
                         k->streamId, short_name(k->name).c_str());
            break;
        }
        case CUPTI_ACTIVITY_KIND_MEMCPY: {
            const auto *c = reinterpret_cast<const CUpti_ActivityMemcpy6 *>(rec);
            std::fprintf(g_out, "C,%llu,%llu,%u,%llu,%u,\n", (unsigned long long)c->start, (unsigned long long)c->end,
                         c->streamId, (unsigned long long)c->bytes, unsigned(c->copyKind));
            break;
        }
        case CUPTI_ACTIVITY_KIND_MEMSET: {
            const auto *m = reinterpret_cast<const CUpti_ActivityMemset4 *>(rec);
            std::fprintf(g_out, "S,%llu,%llu,%u,%llu,0,\n", (unsigned long long)m->start, (unsigned long long)m->end,
                         m->streamId, (unsigned long long)m->bytes);
            break;
        }
        default: break;
        }
    }
    size_t dropped = 0;
    cuptiActivityGetNumDroppedRecords(nullptr, 0, &dropped);
    g_dropped += dropped;
    std::free(buffer);
}

void finish() {
    cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
    std::lock_guard<std::mutex> lock(g_mu);
    if (g_out == nullptr) return;
    if (g_dropped > 0) std::fprintf(stderr, "cupti-trace: %llu records dropped\n", (unsigned long long)g_dropped);
    std::fclose(g_out);
    g_out = nullptr;
}

} // namespace

/// Called by the CUDA driver when CUDA_INJECTION64_PATH names this library: opens the output file and turns
/// on the activity records. Returns 1 (the driver ignores the value).
extern "C" int InitializeInjection(void) {
    const char *path = std::getenv("PRESCOPE_TRACE_OUT");
    g_out = std::fopen(path != nullptr && path[0] != '\0' ? path : "cupti-trace.csv", "w");
    if (g_out == nullptr) {
        std::perror("cupti-trace: cannot open the output file");
        return 1;
    }
    std::fputs("kind,start_ns,end_ns,stream,bytes,copy_kind,name\n", g_out);
    check(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed), "cuptiActivityRegisterCallbacks");
    check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "enable kernels");
    check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY), "enable memcpy");
    check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET), "enable memset");
    std::atexit(finish);
    return 1;
}
