#include "common/log.h"

#include <unistd.h>

#include <cstring>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace pdserve {

LogMessage::LogMessage(LogSeverity severity, const char* file, int line) {
  const char* base = std::strrchr(file, '/');
  const char letter = severity == LogSeverity::kINFO      ? 'I'
                      : severity == LogSeverity::kWARNING ? 'W'
                                                          : 'E';
  stream_ << letter
          << absl::FormatTime("%m%d %H:%M:%E6S", absl::Now(), absl::LocalTimeZone()) << ' '
          << (base ? base + 1 : file) << ':' << line << "] ";
}

LogMessage::~LogMessage() {
  stream_ << '\n';
  const std::string line = stream_.str();
  size_t done = 0;
  while (done < line.size()) {
    const ssize_t n = ::write(STDERR_FILENO, line.data() + done, line.size() - done);
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
}

}  // namespace pdserve
