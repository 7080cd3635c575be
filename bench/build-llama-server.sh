#!/bin/sh
# Build llama.cpp's llama-server (and llama-batched-bench, the engine's own ceiling, in
# the same folder) from the vendored sources of the llama-cpp-python sdist that forged
# pins, into a cache folder outside the repo, for the comparison benchmarks.
# Usage: bench/build-llama-server.sh [CACHE_DIR]   (prints llama-server's path)
set -eu
version=$(sed -n 's/.*"llama-cpp-python==\([0-9.]*\)".*/\1/p' pyproject.toml)
cache=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/forged-bench}
# build-noamx: a native build without AMX, as forged's own llama.cpp is built (see the
# Makefile): on this project's Xeon VMs ggml's AMX kernels stop llama-server at its
# warm-up (SIGILL on tilezero, or a general protection fault). The older "build"
# folder, native with AMX, is left alone.
bin="$cache/llama.cpp-$version/build-noamx/bin/llama-server"
built() { [ -x "$bin" ] && [ -x "${bin%/*}/llama-batched-bench" ]; }
if built; then echo "$bin"; exit 0; fi
mkdir -p "$cache"
# One build at a time per cache: two at once (a benchmark beside the test that needs
# llama-server) overwrote each other's objects ("Text file busy"). The second waits,
# then finds the first's binary.
exec 9>"$cache/.build.lock"
flock 9
if built; then echo "$bin"; exit 0; fi
cd "$cache"
if [ ! -d "llama.cpp-$version" ]; then
    python3 -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$version" -d sdist >&2
    tar -xzf "sdist/llama_cpp_python-$version.tar.gz"
    mv "llama_cpp_python-$version/vendor/llama.cpp" "llama.cpp-$version"
    rm -rf "llama_cpp_python-$version"
fi
cd "llama.cpp-$version"
# GCC keeps an explicit -mno-* over what -march=native enables, whatever the order.
export CFLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
export CXXFLAGS="$CFLAGS"
# The UI flags stop the build from downloading its web UI (no network here).
cmake -B build-noamx -DCMAKE_BUILD_TYPE=Release -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF \
      -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=ON >&2
cmake --build build-noamx --target llama-server llama-batched-bench -j "$(nproc)" >&2
echo "$bin"
