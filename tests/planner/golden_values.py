#!/usr/bin/env python3
"""The golden values of workload_test.cc, computed without pdserve's code.

std::mt19937_64 transcribed from the C++ standard (it must give the
standard's 10000th value for the default seed), the unbiased integer draw
of planner/workload.cc (draws below 2^64 mod n rejected, then x mod n), and
the trace figures. Run: python3 tests/planner/golden_values.py [traces dir]
"""
import csv
import json
import math
import sys

M = (1 << 64) - 1


class MT19937_64:
    def __init__(self, seed):
        self.mt = [0] * 312
        self.mt[0] = seed & M
        for i in range(1, 312):
            prev = self.mt[i - 1]
            self.mt[i] = (6364136223846793005 * (prev ^ (prev >> 62)) + i) & M
        self.i = 312

    def __call__(self):
        if self.i >= 312:
            for k in range(312):
                y = (self.mt[k] & 0xFFFFFFFF80000000) | (self.mt[(k + 1) % 312] & 0x7FFFFFFF)
                self.mt[k] = self.mt[(k + 156) % 312] ^ (y >> 1) ^ (0xB5026F5AA96619E9 if y & 1 else 0)
            self.i = 0
        x = self.mt[self.i]
        self.i += 1
        x ^= (x >> 29) & 0x5555555555555555
        x ^= (x << 17) & 0x71D67FFFEDA60000
        x ^= (x << 37) & 0xFFF7EEE000000000
        x ^= x >> 43
        return x & M


def below(rng, n):
    reject_below = (1 << 64) % n
    while True:
        x = rng()
        if x >= reject_below:
            return x % n


rng = MT19937_64(5489)
for _ in range(9999):
    rng()
assert rng() == 9981545732273789042, "not the standard's mt19937_64"

rng = MT19937_64(42)
print("uniform:1:1000, seed 42:", [1 + below(rng, 1000) for _ in range(8)])
rng = MT19937_64(0)
print("block id 0, 'a'..'z':", [ord("a") + below(rng, 26) for _ in range(8)])

traces = sys.argv[1] if len(sys.argv) > 1 else "../shared/traces"
rows = [json.loads(line) for line in open(f"{traces}/mooncake_conversation_trace.jsonl")]
print("mooncake rows, mean input, mean output:", len(rows),
      sum(r["input_length"] for r in rows) / len(rows),
      sum(r["output_length"] for r in rows) / len(rows))
print("mooncake / 16: mean input, mean output:",
      sum(math.ceil(r["input_length"] / 16) for r in rows) / len(rows),
      sum(max(1, math.ceil(r["output_length"] / 16)) for r in rows) / len(rows))
window = [r for r in rows if 600000 <= r["timestamp"] < 900000]
print("mooncake [600 s, 900 s): rows, first, last ms:", len(window), window[0]["timestamp"],
      window[-1]["timestamp"])
print("mooncake prompts over 4096:", sum(r["input_length"] > 4096 for r in rows))
azure = list(csv.DictReader(open(f"{traces}/azure_llm_inference_2023_conv.csv")))
print("azure rows, mean input, mean output:", len(azure),
      sum(int(r["ContextTokens"]) for r in azure) / len(azure),
      sum(int(r["GeneratedTokens"]) for r in azure) / len(azure))
