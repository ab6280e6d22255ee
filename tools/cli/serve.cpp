// prescope serve: an OpenAI-compatible HTTP server (cpp-httplib) over the batch scheduler
// (runtime/batch-scheduler.h). HTTP threads parse a request (openai-api.h), queue it and write what its
// channel brings; one engine thread runs the scheduler's steps. Endpoints, flags, defaults: docs/serve.md.
#include "cli.h"
#include "offload.h"
#include "openai-api.h"

#include "arch/arch.h"
#include "core/error.h"
#include "core/log.h"
#include "runtime/batch-scheduler.h"
#include "runtime/engine.h"
#include "runtime/tokenizer.h"

#include <httplib.h>
#include <nlohmann/json.hpp>

#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <chrono>
#include <ctime>
#include <filesystem>
#include <map>
#include <string_view>
#include <thread>

namespace prescope::cli {

namespace {

/// Whether an Authorization header value is "Bearer KEY" (the scheme case-insensitive, RFC 7235 section 2.1).
bool authorized(const std::string &header, const std::string &key) {
    constexpr std::string_view scheme = "bearer ";
    if (header.size() != scheme.size() + key.size()) return false;
    for (size_t i = 0; i < scheme.size(); ++i) {
        if (std::tolower(static_cast<unsigned char>(header[i])) != scheme[i]) return false;
    }
    return header.compare(scheme.size(), std::string::npos, key) == 0;
}

using nlohmann::json;

struct ServeArgs {
    CommonArgs common;               // -c: the total KV context, split evenly over the -np slots (as llama-server)
    std::string host = "127.0.0.1";  // --host: loopback only unless asked
    int port = 8080;                 // --port; 0: any free port (the log line says which)
    int64_t n_parallel = 1;          // -np: slots (sequences decoded together)
    std::string api_key;             // --api-key: requests need "Authorization: Bearer KEY"
    std::string alias;               // --alias: the model id clients use (default: the file name)
    int64_t max_queue = 64;          // --max-queue: requests waiting for a slot before 503
    int threads_http = 0;            // --threads-http; 0: np + max-queue + 64
    OffloadArgs offload;
};

// Time the HTTP thread waits for an event before it writes a heartbeat: writing is the only way this httplib
// (0.11) notices a client that went away, so a silent request (queued, or in a long prefill) still frees its
// slot within a few heartbeats of a disconnect (decision 0117).
constexpr auto kHeartbeat = std::chrono::milliseconds(200);

int g_stop_pipe[2] = {-1, -1};
void on_stop_signal(int) {
    const char c = 1;
    [[maybe_unused]] const ssize_t n = write(g_stop_pipe[1], &c, 1);
}

std::string dump(const json &j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

void send_error(httplib::Response &res, const ApiError &e) {
    res.status = e.status;
    res.set_content(dump(e.body()), "application/json");
}

bool is_loopback(const std::string &host) {
    return host == "127.0.0.1" || host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0;
}

// Prometheus metric and label names: [a-zA-Z_:][a-zA-Z0-9_:]* (exposition format).
std::string metric_name(std::string s) {
    for (char &c : s) {
        if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_') c = '_';
    }
    return s;
}

std::string label_value(const std::string &s) {
    std::string out;
    for (char c : s) {
        if (c == '\\' || c == '"') out += '\\';
        if (c == '\n') {
            out += "\\n";
            continue;
        }
        out += c;
    }
    return out;
}

// The engine's stats_json() as gauges prescope_engine_<path>: numbers and booleans become samples; arrays of
// objects one sample per element, labelled by its "layer" (per-layer counters) or its index; strings go into
// one prescope_engine_info sample's labels.
struct EngineGauges {
    std::map<std::string, std::vector<std::string>> samples;  // metric -> "name{labels} value" lines
    std::map<std::string, std::string> info;

    void add(const json &j, const std::string &path, const std::string &labels) {
        if (j.is_object()) {
            for (const auto &[k, v] : j.items()) {
                if (k == "layer" && !labels.empty()) continue;  // it is the label
                add(v, path + "_" + metric_name(k), labels);
            }
        } else if (j.is_array()) {
            for (size_t i = 0; i < j.size(); ++i) {
                const json &e = j[i];
                std::string l = e.is_object() && e.contains("layer") && e["layer"].is_number_integer()
                                    ? fmt::format("layer=\"{}\"", e["layer"].get<int64_t>())
                                    : fmt::format("index=\"{}\"", i);
                add(e, path, labels.empty() ? l : labels + "," + l);
            }
        } else if (j.is_number() || j.is_boolean()) {
            const double v = j.is_boolean() ? double(j.get<bool>()) : j.get<double>();
            const std::string name = "prescope_engine" + path;
            samples[name].push_back(fmt::format("{}{} {}", name, labels.empty() ? "" : "{" + labels + "}", v));
        } else if (j.is_string() && labels.empty()) {
            info[metric_name(path.substr(1))] = j.get<std::string>();
        }
    }
};

class Server {
  public:
    Server(const ServeArgs &a, const Model &model, const Tokenizer &tok, Engine &engine)
        : args_(a), model_(model), tok_(tok), engine_(engine), sched_(engine, tok, {a.max_queue, a.common.n_batch}),
          model_id_(a.alias.empty() ? std::filesystem::path(a.common.model).filename().string() : a.alias),
          created_(std::time(nullptr)) {}

    void run();

  private:
    void route();
    void generate(const httplib::Request &req, httplib::Response &res, Endpoint ep);
    std::string metrics_text();

    const ServeArgs &args_;
    const Model &model_;
    const Tokenizer &tok_;
    Engine &engine_;
    BatchScheduler sched_;
    std::string model_id_;
    std::time_t created_;
    httplib::Server http_;
    std::atomic<uint64_t> next_id_{1};
    std::atomic<uint64_t> invalid_{0};       // requests answered 400
    std::atomic<uint64_t> unauthorized_{0};  // requests answered 401
};

void Server::generate(const httplib::Request &req, httplib::Response &res, Endpoint ep) {
    ApiRequest r;
    try {
        r = parse_request(ep, req.body, {model_.file(), tok_, model_id_, sched_.slot_ctx()});
    } catch (const ApiError &e) {
        ++invalid_;
        send_error(res, e);
        return;
    }
    std::shared_ptr<RequestHandle> handle;
    try {
        handle = sched_.submit(r.generation);
    } catch (const Error &e) {
        // parse_request checks what submit() does; this is the second line of defence.
        ++invalid_;
        send_error(res, ApiError(400, e.what(), "invalid_request_error"));
        return;
    }
    if (!handle) {
        send_error(res, ApiError(503, fmt::format("The server is busy: {} requests are waiting for a slot; retry later.",
                                                  args_.max_queue),
                                 "server_error", "", "server_overloaded"));
        return;
    }
    const bool chat = ep == Endpoint::chat_completions;
    const std::string id = fmt::format("{}-{:016x}", chat ? "chatcmpl" : "cmpl", next_id_++);
    const std::time_t created = std::time(nullptr);
    const std::string model = model_id_;
    const bool include_usage = r.include_usage;
    const auto usage = [](const GenerationEvent &e) {
        return json{{"prompt_tokens", e.prompt_tokens},
                    {"completion_tokens", e.completion_tokens},
                    {"total_tokens", e.prompt_tokens + e.completion_tokens}};
    };
    const auto chunk = [=](json choice) {
        json c = {{"id", id}, {"object", chat ? "chat.completion.chunk" : "text_completion"}, {"created", created},
                  {"model", model}, {"choices", json::array({std::move(choice)})}};
        if (include_usage) c["usage"] = nullptr;
        return "data: " + dump(c) + "\n\n";
    };
    const auto text_choice = [chat](const std::string &text, const json &finish) {
        return chat ? json{{"index", 0}, {"delta", text.empty() ? json::object() : json{{"content", text}}},
                           {"logprobs", nullptr}, {"finish_reason", finish}}
                    : json{{"index", 0}, {"text", text}, {"logprobs", nullptr}, {"finish_reason", finish}};
    };
    const auto error_json = [](const GenerationEvent &e) {
        return ApiError(500, "generation failed: " + e.error, "server_error").body();
    };

    // Both kinds of response are written by a content provider on this HTTP thread, so that a failed write (the
    // client went away) cancels the request; the releaser cancels whatever did not finish.
    if (r.stream) {
        res.set_chunked_content_provider(
            "text/event-stream",
            [=](size_t, httplib::DataSink &sink) {
                if (chat) {
                    json first = {{"index", 0}, {"delta", {{"role", "assistant"}, {"content", ""}}},
                                  {"logprobs", nullptr}, {"finish_reason", nullptr}};
                    const std::string s = chunk(first);
                    if (!sink.write(s.data(), s.size())) return false;
                }
                for (;;) {
                    std::optional<GenerationEvent> e = handle->next(kHeartbeat);
                    std::string out;
                    if (!e) {
                        out = ": ping\n\n";  // an SSE comment: clients skip it
                    } else if (e->done && e->finish == FinishReason::cancelled) {
                        return false;
                    } else if (e->done && e->finish == FinishReason::error) {
                        out = "data: " + dump(error_json(*e)) + "\n\n";
                    } else {
                        if (!e->text.empty()) out = chunk(text_choice(e->text, nullptr));
                        if (e->done) {
                            out += chunk(text_choice("", finish_reason_name(e->finish)));
                            if (include_usage) {
                                json u = {{"id", id}, {"object", chat ? "chat.completion.chunk" : "text_completion"},
                                          {"created", created}, {"model", model}, {"choices", json::array()},
                                          {"usage", usage(*e)}};
                                out += "data: " + dump(u) + "\n\n";
                            }
                        }
                    }
                    if (e && e->done) out += "data: [DONE]\n\n";
                    if (!out.empty() && !sink.write(out.data(), out.size())) return false;
                    if (e && e->done) {
                        sink.done();
                        return true;
                    }
                }
            },
            [handle](bool) { handle->cancel(); });
        return;
    }
    res.set_chunked_content_provider(
        "application/json",
        [=](size_t, httplib::DataSink &sink) {
            std::string text;
            auto last_write = std::chrono::steady_clock::now();
            for (;;) {
                std::optional<GenerationEvent> e = handle->next(kHeartbeat);
                if (!e || !e->done) {
                    if (e) text += e->text;
                    // JSON allows leading whitespace: a space is a heartbeat the body's parser never sees. Written
                    // every kHeartbeat whether tokens come or not: only a write notices a client that left.
                    const auto now = std::chrono::steady_clock::now();
                    if (now - last_write >= kHeartbeat) {
                        if (!sink.write(" ", 1)) return false;
                        last_write = now;
                    }
                    continue;
                }
                text += e->text;
                if (e->finish == FinishReason::cancelled) return false;
                json body;
                if (e->finish == FinishReason::error) {
                    body = error_json(*e);
                } else {
                    const json finish = finish_reason_name(e->finish);
                    json choice = chat ? json{{"index", 0}, {"message", {{"role", "assistant"}, {"content", text}}},
                                              {"logprobs", nullptr}, {"finish_reason", finish}}
                                       : json{{"index", 0}, {"text", text}, {"logprobs", nullptr}, {"finish_reason", finish}};
                    body = {{"id", id}, {"object", chat ? "chat.completion" : "text_completion"}, {"created", created},
                            {"model", model}, {"choices", json::array({choice})}, {"usage", usage(*e)}};
                }
                const std::string s = dump(body);
                if (!sink.write(s.data(), s.size())) return false;
                sink.done();
                return true;
            }
        },
        [handle](bool) { handle->cancel(); });
}

std::string Server::metrics_text() {
    const SchedulerMetrics m = sched_.metrics();
    std::string out;
    const auto metric = [&](const char *name, const char *type, const char *help) {
        out += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
    };
    // A metric of one unlabelled sample.
    const auto scalar = [&](const char *name, const char *type, const char *help, auto value) {
        metric(name, type, help);
        out += fmt::format("{} {}\n", name, value);
    };
    metric("prescope_requests_total", "counter", "Requests by how they ended.");
    for (const auto &[result, n] : std::initializer_list<std::pair<const char *, uint64_t>>{
             {"finished", m.requests_finished}, {"cancelled", m.requests_cancelled}, {"failed", m.requests_failed},
             {"rejected", m.requests_rejected}, {"invalid", invalid_.load()}, {"unauthorized", unauthorized_.load()}}) {
        out += fmt::format("prescope_requests_total{{result=\"{}\"}} {}\n", result, n);
    }
    scalar("prescope_prompt_tokens_total", "counter", "Prompt tokens evaluated.", m.prompt_tokens);
    scalar("prescope_generated_tokens_total", "counter", "Tokens generated (end-of-generation tokens not counted).",
           m.generated_tokens);
    scalar("prescope_engine_seconds_total", "counter", "Wall time spent in the engine's batched forward passes.",
           m.engine_seconds);
    scalar("prescope_steps_total", "counter", "Batched forward passes (scheduler steps).", m.steps);
    scalar("prescope_prompt_tokens_per_second", "gauge", "Prompt tokens per second of engine time, since start.",
           m.engine_seconds > 0 ? m.prompt_tokens / m.engine_seconds : 0.0);
    scalar("prescope_generated_tokens_per_second", "gauge", "Generated tokens per second of engine time, since start.",
           m.engine_seconds > 0 ? m.generated_tokens / m.engine_seconds : 0.0);
    scalar("prescope_queue_length", "gauge", "Requests waiting for a slot.", m.queue_length);
    scalar("prescope_slots_busy", "gauge", "Slots holding a request.", m.slots_busy);
    scalar("prescope_slots", "gauge", "Slots (sequences decoded together, -np).", m.slots_total);
    const auto histogram = [&](const char *name, const char *help, const LatencyHistogram &h) {
        metric(name, "histogram", help);
        for (size_t i = 0; i < h.bounds.size(); ++i) {
            out += fmt::format("{}_bucket{{le=\"{}\"}} {}\n", name, h.bounds[i], h.counts[i]);
        }
        out += fmt::format("{}_bucket{{le=\"+Inf\"}} {}\n{}_sum {}\n{}_count {}\n", name, h.count, name, h.sum, name, h.count);
    };
    histogram("prescope_time_to_first_token_seconds", "From the request queued to its first token.", m.ttft);
    histogram("prescope_inter_token_latency_seconds", "Between two tokens of a request.", m.inter_token);

    EngineGauges g;
    g.add(sched_.engine_stats(), "", "");
    std::string info_labels = fmt::format("backend=\"{}\"", engine_.backend_name());
    for (const auto &[k, v] : g.info) info_labels += fmt::format(",{}=\"{}\"", k, label_value(v));
    metric("prescope_engine_info", "gauge", "The engine: backend and the string fields of its stats.");
    out += fmt::format("prescope_engine_info{{{}}} 1\n", info_labels);
    for (const auto &[name, lines] : g.samples) {
        out += fmt::format("# TYPE {} gauge\n", name);
        for (const std::string &l : lines) out += l + "\n";
    }
    return out;
}

void Server::route() {
    // With --api-key every endpoint but llama-server's public ones (/health, /v1/models) needs the key. Checked in
    // the handler, after httplib has read the body: a pre-routing answer would leave the body unread on a
    // keep-alive connection.
    const auto guarded = [this](httplib::Server::Handler h) {
        return [this, h](const httplib::Request &req, httplib::Response &res) {
            if (!args_.api_key.empty() && !authorized(req.get_header_value("Authorization"), args_.api_key)) {
                ++unauthorized_;
                send_error(res, ApiError(401, "Invalid API key (send the header 'Authorization: Bearer KEY').",
                                         "invalid_request_error", "", "invalid_api_key"));
                return;
            }
            h(req, res);
        };
    };
    http_.Post("/v1/completions", guarded([this](const httplib::Request &req, httplib::Response &res) {
        generate(req, res, Endpoint::completions);
    }));
    http_.Post("/v1/chat/completions", guarded([this](const httplib::Request &req, httplib::Response &res) {
        generate(req, res, Endpoint::chat_completions);
    }));
    http_.Get("/v1/models", [this](const httplib::Request &, httplib::Response &res) {
        json m = {{"id", model_id_}, {"object", "model"}, {"created", created_}, {"owned_by", "prescope"},
                  {"meta", {{"n_ctx_slot", sched_.slot_ctx()}, {"n_slots", sched_.n_slots()},
                            {"n_vocab", tok_.n_vocab()}, {"arch", model_.hp().arch}}}};
        res.set_content(dump({{"object", "list"}, {"data", json::array({m})}}), "application/json");
    });
    http_.Get("/health", [](const httplib::Request &, httplib::Response &res) {
        res.set_content(R"({"status":"ok"})", "application/json");
    });
    http_.Get("/metrics", guarded([this](const httplib::Request &, httplib::Response &res) {
        res.set_content(metrics_text(), "text/plain; version=0.0.4");
    }));
    http_.set_error_handler([](const httplib::Request &req, httplib::Response &res) {
        // Only for statuses no handler set a body for (404, 405, 413 from httplib itself).
        if (!res.body.empty()) return;
        const std::string msg = res.status == 404   ? fmt::format("Unknown endpoint {} {}.", req.method, req.path)
                                : res.status == 413 ? std::string("The request body is too large.")
                                                    : fmt::format("HTTP {}.", res.status);
        res.set_content(dump(ApiError(res.status, msg, "invalid_request_error").body()), "application/json");
    });
    http_.set_exception_handler([](const httplib::Request &, httplib::Response &res, std::exception_ptr ep) {
        std::string what = "unknown error";
        try {
            std::rethrow_exception(ep);
        } catch (const std::exception &e) {
            what = e.what();
        } catch (...) {
        }
        spdlog::error("request failed: {}", what);
        send_error(res, ApiError(500, what, "server_error"));
    });
}

void Server::run() {
    route();
    const int threads = args_.threads_http > 0 ? args_.threads_http : int(args_.n_parallel + args_.max_queue + 64);
    http_.new_task_queue = [threads] { return new httplib::ThreadPool(size_t(threads)); };
    http_.set_payload_max_length(size_t(64) << 20);
    // httplib's default socket options add SO_REUSEPORT, with which a second server binds a port in use and the
    // two share its connections silently: SO_REUSEADDR only (restarts need not wait for TIME_WAIT).
    http_.set_socket_options([](socket_t sock) {
        int yes = 1;
        setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
    });
    // Reading a request (headers and body) may take 30 s: a client that sends it slowly holds an HTTP thread only
    // that long (decision 0118). Generation itself is not under this timeout; the write timeout below covers it.
    http_.set_read_timeout(30);
    // httplib closes a keep-alive connection after 5 requests by default, and a client that reused it saw a reset
    // (the load test against the ASan build: about 12 of 300 requests failed so; none with this). Idle
    // connections still close after httplib's 5 s.
    http_.set_keep_alive_max_count(size_t(1) << 30);
    http_.set_write_timeout(600);
    int port = args_.port;
    if (port == 0) {
        port = http_.bind_to_any_port(args_.host);
        if (port < 0) fail("cannot listen on {} (any port)", args_.host);
    } else if (!http_.bind_to_port(args_.host, port)) {
        fail("cannot listen on {}:{} (address in use, or not an address of this machine)", args_.host, port);
    }
    if (!is_loopback(args_.host) && args_.api_key.empty()) {
        spdlog::warn("listening on {} without --api-key: anyone who reaches this address can use the server", args_.host);
    }
    sched_.start();
    // Said whatever the log level: scripts wait for this line (and read the port from it with --port 0).
    std::fprintf(stderr, "listening on http://%s:%d (model '%s', %lld slots of %lld tokens, n_batch %lld)\n",
                 args_.host.c_str(), port, model_id_.c_str(), (long long)sched_.n_slots(), (long long)sched_.slot_ctx(),
                 (long long)args_.common.n_batch);
    std::fflush(stderr);

    // SIGINT / SIGTERM stop the server from a thread of their own (httplib's stop() is not async-signal-safe): the
    // handler only writes a byte to a pipe that thread reads. A handler, not sigwait(), since threads that libraries
    // start before main (OpenBLAS) do not block the signals.
    if (pipe(g_stop_pipe) != 0) fail("pipe() failed: {}", std::strerror(errno));
    std::atomic<bool> stopped{false};
    std::thread signals([this, &stopped] {
        char c = 0;
        while (read(g_stop_pipe[0], &c, 1) < 0 && errno == EINTR) {
        }
        if (!stopped) spdlog::info("signal received: stopping");
        sched_.stop();  // running requests end now (an error event), so their HTTP threads finish
        http_.stop();
    });
    struct sigaction sa {};
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, nullptr);
    sigaction(SIGTERM, &sa, nullptr);
    http_.listen_after_bind();
    stopped = true;
    on_stop_signal(0);  // wakes the thread when the server stopped by itself
    signals.join();
}

void run_serve(const ServeArgs &a) {
    // A write to a socket the client closed must fail with EPIPE (the request is cancelled), not kill the process.
    signal(SIGPIPE, SIG_IGN);

    apply_common(a.common);
    const auto model = Model::load(a.common.model);
    const Tokenizer tok = Tokenizer::from_gguf(model->file());
    const int64_t total = resolve_n_ctx(*model, a.common.n_ctx);
    const int64_t slot_ctx = total / a.n_parallel;
    if (slot_ctx < 2) {
        fail("-c {} over -np {} slots leaves {} tokens per slot; each needs at least 2 (prompt and one generated)", total,
             a.n_parallel, slot_ctx);
    }
    const OffloadConfig offload = resolve_offload(a.offload);
    const std::unique_ptr<Engine> engine =
        make_engine(*model, {slot_ctx, a.common.n_batch, a.n_parallel, a.common.deterministic}, offload);
    print_startup(offload, *engine);
    Server server(a, *model, tok, *engine);
    server.run();
}

} // namespace

void register_serve(CLI::App &app) {
    auto a = std::make_shared<ServeArgs>();
    auto *cmd = app.add_subcommand("serve", "OpenAI-compatible HTTP server with continuous batching (docs/serve.md)");
    add_common_flags(*cmd, a->common);
    cmd->get_option("-c")->description("total KV context in tokens, split evenly over the -np slots (0: the model's)");
    cmd->add_option("--host", a->host, "address to listen on (loopback by default)")->capture_default_str();
    cmd->add_option("--port", a->port, "port to listen on (0: any free port)")->capture_default_str()->check(CLI::Range(0, 65535));
    cmd->add_option("--parallel", a->n_parallel, "slots: requests decoded together (-np N, as llama.cpp)")
        ->capture_default_str()
        ->check(CLI::Range(int64_t(1), int64_t(4096)));
    cmd->add_option("--api-key", a->api_key, "require 'Authorization: Bearer KEY' (except /health and /v1/models)");
    cmd->add_option("--alias", a->alias, "model id in the API (default: the model's file name)");
    cmd->add_option("--max-queue", a->max_queue, "requests waiting for a slot at most; more are answered 503")
        ->capture_default_str()
        ->check(CLI::Range(int64_t(0), int64_t(1) << 20));
    cmd->add_option("--threads-http", a->threads_http, "HTTP threads, one per open connection (0: -np + --max-queue + 64: room to answer 503, /health, /metrics)")
        ->capture_default_str()
        ->check(CLI::Range(0, 65536));
    add_offload_flags(*cmd, a->offload);
    cmd->callback([a]() { run_serve(*a); });
}

} // namespace prescope::cli
