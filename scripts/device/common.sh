# Shared by the device scripts (sourced): carried Debian packages and the CUDA build. Expects say() and OUT.

RUN_LIBS=""

# Unpacks carried .deb files (e.g. libpcre2-dev, libzstd-dev, libutf8proc-dev, which the GPU machine may lack)
# into /tmp/prescope-debroot and points the compiler, pkg-config and CMake at them. Only our binaries load
# the carried runtime libraries (run_bin); the machine's own tools keep theirs.
setup_carried_debs() {
    local dir=$1
    compgen -G "$dir/*.deb" > /dev/null || return 0
    local root=/tmp/prescope-debroot
    mkdir -p "$root"
    for f in "$dir"/*.deb; do dpkg-deb -x "$f" "$root"; done
    local libdir=$root/usr/lib/x86_64-linux-gnu
    find "$root" -name '*.pc' -exec sed -i "s|^prefix=/usr\$|prefix=$root/usr|" {} +
    for l in "$libdir"/*.so; do  # a -dev symlink whose runtime package was not carried: use the machine's
        [ -L "$l" ] && [ ! -e "$l" ] || continue
        local soname sys
        soname=$(basename "$(readlink "$l")" | sed -E 's/^(lib[^.]+\.so\.[0-9]+).*/\1/')
        sys=$(ls /usr/lib/x86_64-linux-gnu/"$soname"* 2> /dev/null | head -1)
        [ -n "$sys" ] && ln -sf "$sys" "$l"
    done
    export PKG_CONFIG_PATH=$libdir/pkgconfig:$root/usr/share/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
    export CMAKE_PREFIX_PATH=$root/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}
    export CPATH=$root/usr/include${CPATH:+:$CPATH}
    export LIBRARY_PATH=$libdir${LIBRARY_PATH:+:$LIBRARY_PATH}
    # The carried libraries' own dependencies (libglpk's libamd, libcolamd) are found there too at link time.
    export LDFLAGS="-Wl,-rpath-link,$libdir${LDFLAGS:+ $LDFLAGS}"
    RUN_LIBS=$libdir
    say "unpacked $(ls "$dir"/*.deb | wc -l) carried packages into $root"
}

run_bin() {
    if [ -n "$RUN_LIBS" ]; then LD_LIBRARY_PATH=$RUN_LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} "$@"; else "$@"; fi
}

# run_traced CSV cmd...: runs cmd (as run_bin) under the CUPTI tracer of build-gpu (bench/profile/cupti-trace.cpp,
# target prescope-cupti-trace), which writes every kernel and copy to CSV.
run_traced() {
    local csv=$1 cupti
    shift
    cupti=$(dirname "$(find / -name 'libcupti.so*' -not -path '/proc/*' 2> /dev/null | head -1)")
    CUDA_INJECTION64_PATH=$PWD/build-gpu/bin/libprescope-cupti-trace.so PRESCOPE_TRACE_OUT=$csv \
        LD_LIBRARY_PATH=$cupti${RUN_LIBS:+:$RUN_LIBS}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} "$@"
}

# Installs the wheels of folder $1 (the gguf wheel the GPU machine lacks, for the model writer) into /tmp/site and
# puts that on PYTHONPATH; nothing when the folder holds none.
setup_carried_wheels() {
    local dir=$1
    compgen -G "$dir/*.whl" > /dev/null || return 0
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$dir"/*.whl 2> /dev/null && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
}

# Writes the random-weight benchmark model $1 unless it is there: tools/py/make_bench_model.py with the remaining
# arguments after $2 (its log), under $1.part and renamed when complete, so that a call ending mid-write leaves no
# truncated file for the next call on a warm machine to take for the model.
write_bench_model() {
    local model=$1 log=$2
    shift 2
    [ -f "$model" ] && return 0
    timeout 300 python3 tools/py/make_bench_model.py --out "$model.part" "$@" > "$log" 2>&1 && mv "$model.part" "$model"
}

# Says which -dev packages the CMake configuration needs and this machine lacks, with the fix.
check_deps() {
    local missing=() m
    for m in libpcre2-8:libpcre2-dev libzstd:libzstd-dev libutf8proc:libutf8proc-dev; do
        pkg-config --exists "${m%%:*}" 2> /dev/null || missing+=("${m##*:}")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    say "missing: ${missing[*]} (CMake will stop at pkg_check_modules)."
    say "  fix: here, mkdir -p .carry/debs && cd .carry/debs && apt-get download ${missing[*]}"
    say "  (plus libpcre2-posix3 for libpcre2-dev), carry .carry, run again"
}

# Configures (CUDA on, sm_90) and builds the given targets in build dir $1; logs configure.log and build.log
# in $LOG (default $OUT).
build_prescope() {
    local build=$1 log=${LOG:-$OUT}
    shift
    if ! timeout 240 cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DPRESCOPE_CUDA=ON \
            -DPRESCOPE_CUDA_ARCHS=90 -DPRESCOPE_BUILD_TESTS=$([ -f tests/CMakeLists.txt ] && echo ON || echo OFF) > "$log/configure.log" 2>&1; then
        say "FAIL configure (configure.log):"
        grep -E -A3 "CMake Error|No package|Could NOT find|Could not find" "$log/configure.log" | head -20 |
            tee -a "$OUT/summary.txt"
        return 1
    fi
    if ! timeout 600 ninja -C "$build" -j"$(nproc)" "$@" > "$log/build.log" 2>&1; then
        say "FAIL build (build.log):"
        grep -E "error|FAILED" "$log/build.log" | head -20 | tee -a "$OUT/summary.txt"
        return 1
    fi
}

# Makes the comparison peer (llama.cpp, built outside this repository, never committed) available as
# $PEER_BIN/llama-server and $PEER_BIN/llama-bench: unpacks .carry/peer-bin/llama.cpp-bin.tar.xz (its bin/ folder,
# built on this machine kind by .carry/peer/build.sh in an earlier call; its run path is /tmp/peer/build/bin) when
# carried, else starts .carry/peer/build.sh in the background (about 260 s on 16 cores), else leaves it absent.
setup_peer() {
    PEER_BIN=/tmp/peer/build/bin
    [ -x "$PEER_BIN/llama-server" ] && return 0
    if [ -f .carry/peer-bin/llama.cpp-bin.tar.xz ]; then
        mkdir -p /tmp/peer/build && tar xJf .carry/peer-bin/llama.cpp-bin.tar.xz -C /tmp/peer/build &&
            say "peer: unpacked $(ls "$PEER_BIN" | wc -l) files of the carried llama.cpp build into $PEER_BIN"
    elif [ -f .carry/peer/build.sh ]; then
        (PEER_JOBS=${PEER_JOBS:-$(($(nproc) - 4))} bash .carry/peer/build.sh > "${LOG:-$OUT}/peer-build.log" 2>&1) &
        say "peer: building llama.cpp in the background (.carry/peer/build.sh)"
    fi
}
