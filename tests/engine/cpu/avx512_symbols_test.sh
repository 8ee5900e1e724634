#!/bin/sh
# The AVX-512 kernels' object files (engine/cpu/matmul_avx512_*.cc) may
# define no symbol but their exported functions: any other global symbol,
# such as an inline function of a header compiled there with AVX-512,
# could be the copy the linker keeps for the whole program and run on a
# CPU without AVX-512 (engine/cpu/matmul_tile.h). DW.ref.__gxx_personality_v0
# is no code: a pointer to the C++ exception personality routine that any
# object with unwinding cleanups carries (the sanitizer builds' do).
# Usage: avx512_symbols_test.sh LIBPDSERVE_ENGINE.a
set -eu
check() {  # OBJECT WANT
  symbols=$(nm -A -C --defined-only "$lib" | grep "$1:" | grep -v ' [trbd] ' |
            sed 's/.* [A-Za-z] //' | grep -v '^DW\.ref\.__gxx_personality_v0$' | sort)
  if [ "$symbols" != "$2" ]; then
    echo "$1 defines other global symbols than its kernels:"
    echo "$symbols"
    exit 1
  fi
  echo "$1 defines only: $(echo "$symbols" | tr '\n' ' ')"
}
lib=$1
check 'matmul_avx512_bf16\.cc\.o' 'pdserve::cpu::internal::Avx512Bf16PanelKernels()
pdserve::cpu::internal::Avx512Bf16Tiles()
pdserve::cpu::internal::Avx512RoundToBf16(float const*, long, unsigned short*)'
check 'matmul_avx512_vnni\.cc\.o' 'pdserve::cpu::internal::Avx512PanelKernels()
pdserve::cpu::internal::Avx512Tiles(pdserve::DType)
pdserve::cpu::internal::Avx512VnniQ8Kernels()'
