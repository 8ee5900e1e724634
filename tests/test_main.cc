// The main() of every test binary: GoogleTest's, with Abseil's failure
// signal handler installed first, so that a test process that crashes or
// aborts prints every frame of the failing thread, named, into ctest's
// output instead of only "Subprocess aborted". The handler then calls the
// one it replaced (a sanitizer's, or the default), so death tests, the
// sanitizers' reports and the exit status stay as they were.
//
// Abseil walks frame pointers, which Release builds omit (it stops after
// a frame or two); glibc's backtrace() unwinds by the binaries' unwind
// tables, through the signal frame, so it is the unwinder here.
#include <execinfo.h>

#include <algorithm>

#include "absl/debugging/failure_signal_handler.h"
#include "absl/debugging/stacktrace.h"
#include "absl/debugging/symbolize.h"
#include "gtest/gtest.h"

namespace {

int UnwindWithBacktrace(void** pcs, int* sizes, int max_depth, int skip_count,
                        const void* /*signal_context*/, int* min_dropped_frames) {
  void* frames[128];
  const int found = backtrace(frames, 128);
  const int skip = std::min(found, skip_count + 1);  // + this function.
  const int count = std::min(found - skip, max_depth);
  for (int i = 0; i < count; ++i) {
    pcs[i] = frames[skip + i];
    if (sizes != nullptr) sizes[i] = 0;  // Not known; nothing reads it here.
  }
  if (min_dropped_frames != nullptr) *min_dropped_frames = found - skip - count;
  return count;
}

}  // namespace

int main(int argc, char** argv) {
  absl::InitializeSymbolizer(argv[0]);
  // backtrace() loads the unwinder on first use, which allocates: not in
  // a signal handler.
  void* warm[1];
  backtrace(warm, 1);
  absl::SetStackUnwinder(UnwindWithBacktrace);
  absl::FailureSignalHandlerOptions options;
  options.call_previous_handler = true;
  absl::InstallFailureSignalHandler(options);
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
