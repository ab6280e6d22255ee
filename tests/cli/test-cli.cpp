// The prescope binary on bad input: one "error: ..." line naming the file, the tensor and what was
// expected, exit code 1, no crash and no hang (each case runs under `timeout`).
#include "../common/tiny-model.h"

#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sys/wait.h>
#include <unistd.h>

namespace fs = std::filesystem;
using prescope::test::TinyModelSpec;

namespace {

struct RunResult {
    int exit_code = -1;
    std::string out;  // stdout and stderr together
};

RunResult run(const std::string &args) {
    const std::string cmd = "timeout 60 " + std::string(PRESCOPE_BINARY_DIR) + "/bin/prescope " + args + " 2>&1";
    RunResult r;
    FILE *p = popen(cmd.c_str(), "r");
    std::array<char, 4096> buf{};
    while (fgets(buf.data(), int(buf.size()), p)) r.out += buf.data();
    const int status = pclose(p);
    r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    return r;
}

// Per process: ctest runs the cases side by side, and rewriting a model another case has mapped kills it (SIGBUS).
std::string tmp(const std::string &name) {
    return (fs::temp_directory_path() / ("prescope-cli-" + std::to_string(getpid()) + "-" + name)).string();
}

std::string valid_model() {
    const std::string p = tmp("valid.gguf");
    prescope::test::write_tiny_model(p, {});
    return p;
}

std::vector<char> read_bytes(const std::string &p) {
    std::ifstream in(p, std::ios::binary);
    return {std::istreambuf_iterator<char>(in), {}};
}

void write_bytes(const std::string &p, const std::vector<char> &b) {
    std::ofstream(p, std::ios::binary).write(b.data(), std::streamsize(b.size()));
}

/// Runs `generate` on `model` and expects exit 1 with one error line containing every needle.
void expect_generate_error(const std::string &model, const std::vector<std::string> &needles,
                           const std::string &extra = "-p hello -n 4") {
    const RunResult r = run("generate -m " + model + " " + extra);
    EXPECT_EQ(r.exit_code, 1) << r.out;
    const auto pos = r.out.find("error: ");
    ASSERT_NE(pos, std::string::npos) << r.out;
    const std::string line = r.out.substr(pos, r.out.find('\n', pos) - pos);
    for (const auto &n : needles) EXPECT_NE(line.find(n), std::string::npos) << "'" << n << "' not in: " << line;
}

} // namespace

TEST(Cli, ValidModelGenerates) {
    const RunResult r = run("generate -m " + valid_model() + " -p hello -n 4 --temp 0");
    EXPECT_EQ(r.exit_code, 0) << r.out;
    EXPECT_NE(r.out.find("stats: prompt tokens 5"), std::string::npos) << r.out;
}

TEST(Cli, BadMagic) {
    auto b = read_bytes(valid_model());
    b[0] = 'Z';
    const std::string p = tmp("magic.gguf");
    write_bytes(p, b);
    expect_generate_error(p, {p, "bad magic", "'GGUF'"});
}

TEST(Cli, TruncatedFile) {
    auto b = read_bytes(valid_model());
    b.resize(200);  // cuts into the metadata
    const std::string p = tmp("trunc.gguf");
    write_bytes(p, b);
    expect_generate_error(p, {p, "truncated"});
}

TEST(Cli, TensorDataPastTheEnd) {
    auto b = read_bytes(valid_model());
    b.resize(b.size() - 100);  // the last tensor's data now ends past the end of the file
    const std::string p = tmp("pastend.gguf");
    write_bytes(p, b);
    expect_generate_error(p, {p, "tensor 'blk.1.ffn_down_exps.weight' data", "past the end of the file"});
}

TEST(Cli, MissingTensor) {
    TinyModelSpec s;
    s.edit = [](std::string &name, auto &, auto &) {
        if (name == "blk.0.attn_v.weight") name.clear();
    };
    const std::string p = tmp("missing.gguf");
    prescope::test::write_tiny_model(p, s);
    expect_generate_error(p, {p, "missing tensor 'blk.0.attn_v.weight'", "expected shape [32, 16]"});
}

TEST(Cli, WrongShape) {
    TinyModelSpec s;
    s.edit = [](std::string &name, std::vector<uint64_t> &ne, auto &) {
        if (name == "blk.1.ffn_down_exps.weight") ne = {32, 32, 3};
    };
    const std::string p = tmp("shape.gguf");
    prescope::test::write_tiny_model(p, s);
    expect_generate_error(p, {p, "'blk.1.ffn_down_exps.weight' has shape [32, 32, 3], expected [32, 32, 4]"});
}

TEST(Cli, UnsupportedDtype) {
    TinyModelSpec s;
    s.n_embd = 256;
    s.edit = [](std::string &name, auto &, uint32_t &type) {
        if (name == "token_embd.weight") type = 19;  // iq1_s
    };
    const std::string p = tmp("dtype.gguf");
    prescope::test::write_tiny_model(p, s);
    expect_generate_error(p, {p, "'token_embd.weight' has unsupported dtype iq1_s", "supported: f32, f16, bf16, q8_0, q4_0"});
}

TEST(Cli, UnsupportedArchitecture) {
    TinyModelSpec s;
    s.arch = "mamba";
    const std::string p = tmp("arch.gguf");
    prescope::test::write_tiny_model(p, s);
    expect_generate_error(p, {p, "unsupported architecture 'mamba'"});
}

TEST(Cli, PromptLongerThanContext) {
    expect_generate_error(valid_model(), {"prompt is 11 tokens", "context of 8 tokens"}, "-p abcdefghijk -c 8");
    expect_generate_error(valid_model(), {"prompt is 8 tokens", "must also hold the generated ones"},
                          "-p abcdefgh -c 8");
}

TEST(Cli, MissingPromptFile) {
    expect_generate_error(valid_model(), {"/nonexistent/prompt.txt", "cannot read"}, "-f /nonexistent/prompt.txt");
}

TEST(Cli, PerplexityNeedsEnoughText) {
    const std::string text = tmp("short.txt");
    std::ofstream(text) << "too short";
    const RunResult r = run("perplexity -m " + valid_model() + " -f " + text + " -c 64");
    EXPECT_EQ(r.exit_code, 1) << r.out;
    EXPECT_NE(r.out.find("error: perplexity needs at least 128 tokens"), std::string::npos) << r.out;
}

TEST(Cli, PerplexityContextTooSmallToScore) {
    const std::string text = tmp("ppl.txt");
    std::ofstream(text) << "some text long enough for a few chunks of two tokens each";
    const RunResult r = run("perplexity -m " + valid_model() + " -f " + text + " -c 2");
    EXPECT_EQ(r.exit_code, 1) << r.out;
    EXPECT_NE(r.out.find("at least 3 tokens"), std::string::npos) << r.out;
}

TEST(Cli, OutputLostToAFullDeviceIsAnError) {
    for (const std::string cmd : {"inspect " + valid_model(), "generate -m " + valid_model() + " -p hello -n 2"}) {
        const RunResult r = run(cmd + " > /dev/full");
        EXPECT_EQ(r.exit_code, 1) << cmd << ": " << r.out;
    }
}

TEST(Cli, SamplingValuesOutOfRangeAreRefused) {
    for (const std::string flag : {"--top-p 2", "--min-p -1", "--temp nan", "--temp -1", "--repeat-penalty 0",
                                   "--top-k -5", "-n -5", "-t 0", "-c -1", "--seed -2"}) {
        const RunResult r = run("generate -m " + valid_model() + " -p hello " + flag);
        EXPECT_NE(r.exit_code, 0) << flag << ": " << r.out;
        EXPECT_LT(r.exit_code, 128) << flag << ": " << r.out;  // an error, not a signal
        EXPECT_NE(r.out.find(flag.substr(0, flag.find(' '))), std::string::npos) << flag << ": " << r.out;
    }
    const RunResult ok = run("generate -m " + valid_model() + " -p hello -n 2 --seed -1 --temp 0.7");
    EXPECT_EQ(ok.exit_code, 0) << ok.out;
}

TEST(Cli, BenchStaysWithinTheContext) {
    const RunResult r = run("bench -m " + valid_model() + " -p 200 -n 4 -c 100 -r 1");
    EXPECT_EQ(r.exit_code, 1) << r.out;
    EXPECT_NE(r.out.find("need a context of 201 tokens"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("-c 100"), std::string::npos) << r.out;
}

// The scheduler's tools: simulate on a committed trace writes one JSON row and dumps layer states that
// schedule-check replays against the ILP; calibrate writes a profile labelled with what it measured; bad input
// is one error line.
TEST(Cli, SimulateDumpsStatesThatScheduleCheckReplays) {
    const std::string states = tmp("states.jsonl"), gap = tmp("gap.json");
    const RunResult sim = run("simulate --trace " + std::string(PRESCOPE_SOURCE_DIR) +
                              "/traces/demo-test.pstrace --shape qwen3-30b-a3b --budget 1GiB -p 8 -n 8 "
                              "--dump-layer-states " + states);
    ASSERT_EQ(sim.exit_code, 0) << sim.out;
    EXPECT_NE(sim.out.find("\"simulated\":true"), std::string::npos) << sim.out;
    EXPECT_NE(sim.out.find("cost model:"), std::string::npos) << sim.out;
    const RunResult check = run("schedule-check " + states + " --json " + gap);
    ASSERT_EQ(check.exit_code, 0) << check.out;
    EXPECT_NE(check.out.find("within 5% of the optimum"), std::string::npos) << check.out;
    EXPECT_TRUE(fs::exists(gap));
    std::ofstream(states, std::ios::app) << "{\"layer\": 1}\n";
    const RunResult bad = run("schedule-check " + states);
    EXPECT_EQ(bad.exit_code, 1) << bad.out;
    EXPECT_NE(bad.out.find("error: " + states + ":"), std::string::npos) << bad.out;
    fs::remove(states);
    fs::remove(gap);
}

TEST(Cli, SimulateAndCalibrateRefuseBadInput) {
    const std::string trace = std::string(PRESCOPE_SOURCE_DIR) + "/traces/demo-test.pstrace";
    RunResult r = run("simulate --trace " + trace + " --shape llama-70b");
    EXPECT_EQ(r.exit_code, 1) << r.out;
    EXPECT_NE(r.out.find("unknown expert shape 'llama-70b'"), std::string::npos) << r.out;
    r = run("simulate --trace " + trace + " --truth cpu=-1");
    EXPECT_EQ(r.exit_code, 1) << r.out;
    EXPECT_NE(r.out.find("--truth"), std::string::npos) << r.out;
    r = run("simulate --trace " + trace + " --budget 1KiB");
    EXPECT_EQ(r.exit_code, 1) << r.out;
    EXPECT_NE(r.out.find("need at least"), std::string::npos) << r.out;
    const std::string profile = tmp("profile.json");
    std::ofstream(profile) << "{\"format\": \"prescope-cost-profile\", \"version\": 2}";
    r = run("simulate --trace " + trace + " --profile " + profile);
    EXPECT_EQ(r.exit_code, 1) << r.out;
    EXPECT_NE(r.out.find(profile + ": 'version' must be 1"), std::string::npos) << r.out;
    fs::remove(profile);
}

TEST(Cli, CalibrateWritesAProfileSayingWhatWasMeasured) {
    const std::string model = valid_model(), out = tmp("calibrated.json");
    const RunResult r = run("calibrate -m " + model + " -o " + out + " -t 1 --budget-s 0.2");
    ASSERT_EQ(r.exit_code, 0) << r.out;
    std::ifstream in(out);
    const std::string text{std::istreambuf_iterator<char>(in), {}};
    EXPECT_NE(text.find("CPU terms measured"), std::string::npos) << text;
    EXPECT_NE(text.find("cpu_us_by_tokens"), std::string::npos) << text;
    // A machine without a GPU keeps the reference's GPU terms and says so.
    if (r.out.find("no GPU measurement") != std::string::npos) {
        EXPECT_NE(text.find("not measured"), std::string::npos) << text;
    }
    // The profile drives a simulation of the model's expert shape (the trace gives the routing).
    const RunResult sim = run("simulate --trace " + std::string(PRESCOPE_SOURCE_DIR) +
                              "/traces/demo-test.pstrace -m " + model + " --profile " + out + " -p 0 -n 4 -t 1");
    EXPECT_EQ(sim.exit_code, 0) << sim.out;
    EXPECT_NE(sim.out.find("measured"), std::string::npos) << sim.out;
    fs::remove(out);
}
