#!/bin/sh
# The AVX-512 kernels' object file (engine/cpu/matmul_avx512_bf16.cc) may define
# no symbol but its two exported functions: any other global symbol, such
# as an inline function of a header compiled there with AVX-512, could be
# the copy the linker keeps for the whole program and run on a CPU without
# AVX-512 (engine/cpu/matmul_tile.h).
# Usage: avx512_symbols_test.sh LIBPDSERVE_ENGINE.a
set -eu
symbols=$(nm -A -C --defined-only "$1" | grep 'matmul_avx512_bf16\.cc\.o:' | grep -v ' [trbd] ' |
          sed 's/.* [A-Za-z] //' | sort)
want='pdserve::cpu::internal::Avx512Bf16Tiles()
pdserve::cpu::internal::Avx512RoundToBf16(float const*, long, unsigned short*)'
if [ "$symbols" != "$want" ]; then
  echo "matmul_avx512_bf16.cc.o defines other global symbols than its kernels:"
  echo "$symbols"
  exit 1
fi
echo "matmul_avx512_bf16.cc.o defines only: $(echo "$symbols" | tr '\n' ' ')"
