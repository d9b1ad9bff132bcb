#!/usr/bin/env bash
# The cmake flags for building llama.cpp on this CPU, printed on one line; used both for
# llama-cpp-python's install (.ci/run, the README) and for llama.cpp's own tools
# (bench/llama_cpp_tools.sh), so both builds run the same instructions.
#
# Usage: bench/llama_cpp_flags.sh           this CPU's flags (native, but never AMX: see below)
#        ISA=avx2 bench/llama_cpp_flags.sh   AVX2 only (no AVX-512, no native flags)
#
# A CPU that lists AMX: llama.cpp's native build then runs its AMX kernels for batched passes,
# which stop with SIGILL where the kernel does not grant the tile state (seen on cloud VMs:
# llama-bench's pp512 and llama-cpp-python's prompt pass killed, one-token steps fine). Such a
# CPU gets its AVX-512 set without AMX.
set -euo pipefail
case ${ISA:-native} in
native)
    if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
        echo "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON" \
             "-DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF" \
             "-DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
    else
        echo "-DGGML_NATIVE=ON"
    fi ;;
avx2) echo "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" \
           "-DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF" ;;
*) echo "ISA must be native or avx2, got $ISA" >&2; exit 2 ;;
esac
