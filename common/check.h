// PD_CHECK: aborts with a message when an internal invariant is broken.
// Only for programming errors; bad input from outside is a Status.
// (The Abseil release in Debian predates absl/log.)
#ifndef PDSERVE_COMMON_CHECK_H_
#define PDSERVE_COMMON_CHECK_H_

#include <cstdlib>
#include <iostream>
#include <sstream>

namespace pdserve::internal {

class CheckFailure {
 public:
  CheckFailure(const char* file, int line, const char* condition) {
    stream_ << file << ":" << line << ": check failed: " << condition << " ";
  }
  [[noreturn]] ~CheckFailure() {
    std::cerr << stream_.str() << std::endl;
    std::abort();
  }
  std::ostream& stream() { return stream_; }

 private:
  std::ostringstream stream_;
};

}  // namespace pdserve::internal

#define PD_CHECK(condition)         \
  if (__builtin_expect(!!(condition), 1)) \
    ;                               \
  else                              \
    ::pdserve::internal::CheckFailure(__FILE__, __LINE__, #condition).stream()

#define PD_CHECK_GE(a, b) PD_CHECK((a) >= (b)) << "(" << (a) << " vs " << (b) << ") "
#define PD_CHECK_GT(a, b) PD_CHECK((a) > (b)) << "(" << (a) << " vs " << (b) << ") "

#endif  // PDSERVE_COMMON_CHECK_H_
