// A decode worker without a model whose tokens come by a timer
// (bench/timed_decode_worker.h): the first --first_token_ms after a call
// arrives, then one every --token_interval_ms. Prints its address on
// stdout and serves until killed. In front of it a real pd-router, so that
// two load generators measuring the same stream see the same server
// (tests/planner/aiperf_crosscheck.py).
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/time/time.h"
#include "bench/timed_decode_worker.h"

ABSL_FLAG(int32_t, token_interval_ms, 20, "Time between a stream's tokens");
ABSL_FLAG(int32_t, first_token_ms, 50, "Time from a call to its first token");

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return pdserve::bench::RunTimedDecodeWorker(
      absl::Milliseconds(absl::GetFlag(FLAGS_token_interval_ms)),
      absl::Milliseconds(absl::GetFlag(FLAGS_first_token_ms)));
}
