// Minimal logging: PD_LOG(INFO|WARNING|ERROR) << ...; writes one line
// "I1122 14:03:05.123456 file.cc:42] message" to stderr. Each message is
// written with one write(2), so lines from different threads do not mix.
// (Debian's Abseil 20220623 has no absl/log.)
#ifndef PDSERVE_COMMON_LOG_H_
#define PDSERVE_COMMON_LOG_H_

#include <sstream>

namespace pdserve {

enum class LogSeverity { kINFO, kWARNING, kERROR };

class LogMessage {
 public:
  LogMessage(LogSeverity severity, const char* file, int line);
  ~LogMessage();  // Writes the line.
  std::ostream& stream() { return stream_; }

 private:
  std::ostringstream stream_;
};

}  // namespace pdserve

#define PD_LOG(severity) \
  ::pdserve::LogMessage(::pdserve::LogSeverity::k##severity, __FILE__, __LINE__).stream()

#endif  // PDSERVE_COMMON_LOG_H_
