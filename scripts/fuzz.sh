#!/usr/bin/env bash
# Fuzzes PreScope's readers with libFuzzer (tests/fuzz, docs/fuzzing.md): builds the targets with clang,
# AddressSanitizer and UndefinedBehaviorSanitizer in build-fuzz, then runs each for SECONDS.
#
#   scripts/fuzz.sh [-t SECONDS] [-j PARALLEL] [--seeds] [TARGET...]
#
# -t: seconds per target (default 60). -j: targets run side by side (default 1). --seeds: rewrite the committed
# seed corpora (tests/fuzz/corpus) first. TARGET: fuzz-gguf, fuzz-trace, fuzz-predictor, fuzz-config,
# fuzz-tokenizer, fuzz-chat, fuzz-expert-groups (default: all). Each target grows its corpus in build-fuzz/corpus/TARGET (starting
# from the committed seeds and tests/fuzz/regressions/TARGET, inputs that once found a bug) and writes what it
# finds to build-fuzz/findings/TARGET/. Prints one line per target (executions, executions/s, corpus size,
# findings) and exits 1 when any target found something.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=60
parallel=1
seeds=0
targets=()
while [ $# -gt 0 ]; do
    case "$1" in
        -t) seconds="$2"; shift 2 ;;
        -j) parallel="$2"; shift 2 ;;
        --seeds) seeds=1; shift ;;
        -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
        *) targets+=("$1"); shift ;;
    esac
done
all=(fuzz-gguf fuzz-trace fuzz-predictor fuzz-config fuzz-tokenizer fuzz-chat fuzz-expert-groups)
if [ ${#targets[@]} -eq 0 ]; then targets=("${all[@]}"); fi

B=build-fuzz
if [ ! -f "$B/build.ninja" ]; then
    cmake -S . -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_COMPILER=clang \
        -DCMAKE_CXX_COMPILER=clang++ -DPRESCOPE_CUDA=OFF -DPRESCOPE_BUILD_TESTS=OFF -DPRESCOPE_BUILD_BENCH=OFF \
        -DPRESCOPE_FUZZ=ON -DPRESCOPE_SANITIZE_ADDRESS=ON -DPRESCOPE_SANITIZE_UNDEFINED=ON > /dev/null
fi
ninja -C "$B" -j"$(nproc)" "${targets[@]}" fuzz-seeds
if [ "$seeds" = 1 ]; then "$B/fuzz/fuzz-seeds" tests/fuzz/corpus; fi

# Longest input per target: a little above its largest seed (tiny GGUF models are the big ones).
max_len() {
    case "$1" in
        fuzz-gguf) echo 131072 ;;
        fuzz-predictor|fuzz-trace) echo 16384 ;;
        *) echo 4096 ;;
    esac
}

run_one() {
    local t="$1" log="$B/findings/$1.log"
    mkdir -p "$B/corpus/$t" "$B/findings/$t"
    # Inputs that once found something (tests/fuzz/regressions) run first, with the seeds.
    local regressions=""
    if [ -d "tests/fuzz/regressions/$t" ]; then regressions="tests/fuzz/regressions/$t"; fi
    # One thread for OpenMP/OpenBLAS inside the target; leaks and undefined behaviour count as findings.
    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE \
    ASAN_OPTIONS=detect_leaks=1:allocator_may_return_null=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
        "$B/fuzz/$t" "$B/corpus/$t" "tests/fuzz/corpus/$t" $regressions -max_total_time="$seconds" -max_len="$(max_len "$t")" \
        -timeout=20 -rss_limit_mb=4096 -print_final_stats=1 -artifact_prefix="$B/findings/$t/" > "$log" 2>&1 || true
    local execs rate units found
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
    rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
    units=$(find "$B/corpus/$t" -type f | wc -l)
    found=$(find "$B/findings/$t" -type f | wc -l)
    printf '%-16s %10s executions %7s/s  corpus %5s  findings %s\n' "$t" "${execs:-?}" "${rate:-?}" "$units" "$found"
    if [ "$found" != 0 ]; then
        echo "  $t: see $log and $B/findings/$t/"
        return 1
    fi
}

mkdir -p "$B/findings"
status=0
pids=()
for t in "${targets[@]}"; do
    run_one "$t" > "$B/findings/$t.summary" 2>&1 &
    pids+=($!)
    if [ ${#pids[@]} -ge "$parallel" ]; then
        wait "${pids[0]}" || status=1
        pids=("${pids[@]:1}")
    fi
done
for p in "${pids[@]}"; do wait "$p" || status=1; done
for t in "${targets[@]}"; do cat "$B/findings/$t.summary"; done
exit $status
