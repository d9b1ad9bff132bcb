#!/usr/bin/env bash
# llama.cpp's own tools (llama-bench, llama-server, llama-quantize) built from the very llama.cpp
# source that the installed llama-cpp-python vendors, so the peers and the in-process peer are
# the same code. Downloads that version's sdist from the package registry, builds with cmake
# (this CPU's flags from bench/llama_cpp_flags.sh, llama.cpp's defaults otherwise), and caches the result: the second call
# only prints the folder. A few minutes once on 2 cores.
#
# Usage: bench/llama_cpp_tools.sh    prints the folder holding llama-bench, llama-server and
#                                   llama-quantize (under forerun's cache folder, $FORERUN_CACHE)
#        ISA=avx2 bench/llama_cpp_tools.sh   the same tools built for AVX2 only (no AVX-512, no
#                                   native flags), in a folder of their own: to set beside
#                                   FORERUN_KERNEL=avx2 on an AVX-512 machine (forerun bench --llama-tools DIR)
# The cache key is the llama-cpp-python version and this CPU's flags: a build made on another
# CPU (say, one with AVX-512 on a machine without) is never reused. Beside bin/ it keeps that
# source's convert_hf_to_gguf.py and gguf-py (export-draft --format llama.cpp uses them).
set -euo pipefail
py=${PYTHON:-python}
version=$("$py" -c "import importlib.metadata as m; print(m.version('llama_cpp_python'))")
# the folder forerun bench looks in (keyed by that version and this CPU's flags)
dest=$(dirname "$("$py" -c "from forerun.bench_peers import llama_tools_dir; print(llama_tools_dir())")")
# this CPU's flags, or AVX2's (bench/llama_cpp_flags.sh: never AMX, which some VMs refuse)
flags=$(bash "$(dirname "$0")/llama_cpp_flags.sh")
read -r -a isa_flags <<<"$flags"
[ "${ISA:-native}" = avx2 ] && dest="$dest-avx2"
if [ -x "$dest/bin/llama-bench" ] && [ -x "$dest/bin/llama-server" ] && [ -x "$dest/bin/llama-quantize" ] &&
   [ "$(cat "$dest/build-flags" 2>/dev/null)" = "${isa_flags[*]}" ]; then
    echo "$dest/bin"; exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "building llama.cpp's tools from llama-cpp-python $version's sdist in $work" >&2
"$py" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$work" >&2
tar -xzf "$work"/llama_cpp_python-*.tar.gz -C "$work"
src=$(echo "$work"/llama_cpp_python-*/vendor/llama.cpp)
[ -f "$src/CMakeLists.txt" ] || { echo "no vendored llama.cpp in the sdist" >&2; exit 2; }
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release "${isa_flags[@]}" -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
    -DBUILD_SHARED_LIBS=OFF >&2
cmake --build "$work/build" -j "$(nproc)" --target llama-bench llama-server llama-quantize >&2
mkdir -p "$dest/bin"
cp "$work/build/bin/llama-bench" "$work/build/bin/llama-server" "$work/build/bin/llama-quantize" "$dest/bin/"
# the converter of the same source, for exporting draft heads (convert_hf_to_gguf.py and its gguf-py)
cp -r "$src/convert_hf_to_gguf.py" "$src/gguf-py" "$dest/" 2>/dev/null || true
[ -d "$src/conversion" ] && cp -r "$src/conversion" "$dest/" || true
echo "$version" > "$dest/llama-cpp-python-version"
echo "${isa_flags[*]}" > "$dest/build-flags"  # a build made with other flags (an older script's) is made again
echo "$dest/bin"
