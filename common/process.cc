#include "common/process.h"

#include <pthread.h>
#include <signal.h>
#include <sys/resource.h>

#include <algorithm>
#include <cstdio>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "common/log.h"

namespace pdserve {

void RaiseOpenFileLimit() {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0 ||
      limit.rlim_cur >= limit.rlim_max) {
    return;
  }
  limit.rlim_cur = limit.rlim_max;
  if (setrlimit(RLIMIT_NOFILE, &limit) != 0) {
    PD_LOG(WARNING) << "could not raise the open file limit to "
                    << limit.rlim_max;
  }
}
namespace {

sigset_t TerminationSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGHUP);
  return set;
}

}  // namespace

void BlockTerminationSignals() {
  const sigset_t set = TerminationSignals();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

int WaitForTerminationSignal(const std::function<void()>& on_reload) {
  const sigset_t set = TerminationSignals();
  while (true) {
    int signal = 0;
    if (sigwait(&set, &signal) != 0) continue;
    if (signal != SIGHUP) return signal;
    if (on_reload) {
      on_reload();
    } else {
      PD_LOG(INFO) << "SIGHUP: nothing to reload";
    }
  }
}

int WaitForTerminationSignalFor(absl::Duration timeout,
                                const std::function<void()>& on_reload) {
  const sigset_t set = TerminationSignals();
  const timespec wait = absl::ToTimespec(std::max(timeout, absl::ZeroDuration()));
  // EINTR (another signal) or EAGAIN (the timeout) both answer none.
  const int signal = sigtimedwait(&set, nullptr, &wait);
  if (signal == SIGHUP) {
    if (on_reload) on_reload();
    return 0;
  }
  return signal > 0 ? signal : 0;
}

absl::Status WritePortFile(const std::string& path, int port) {
  const std::string tmp = absl::StrCat(path, ".tmp");
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << port << "\n";
    if (!out.flush()) return absl::InternalError(absl::StrCat("cannot write ", tmp));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::InternalError(absl::StrCat("cannot rename ", tmp, " to ", path));
  }
  return absl::OkStatus();
}

bool AnnounceAndWaitForSignal(const std::string& program, int port,
                              const std::string& port_file,
                              const std::function<void()>& on_reload) {
  if (!port_file.empty()) {
    if (absl::Status s = WritePortFile(port_file, port); !s.ok()) {
      PD_LOG(ERROR) << program << ": " << s;
      return false;
    }
  }
  const int signal = WaitForTerminationSignal(on_reload);
  PD_LOG(INFO) << program << ": signal " << signal << ", shutting down";
  return true;
}

void NameThisThread(const std::string& name) {
  pthread_setname_np(pthread_self(), name.substr(0, 15).c_str());
}

}  // namespace pdserve
