// What every pdserve binary's main() needs around its server: waiting for
// SIGINT/SIGTERM, reloading on SIGHUP, and telling a launcher which port was
// bound.
#ifndef PDSERVE_COMMON_PROCESS_H_
#define PDSERVE_COMMON_PROCESS_H_

#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace pdserve {

// Blocks SIGINT, SIGTERM and SIGHUP in the calling thread and every thread
// it starts afterwards. Call first in main(), before any thread exists.
// SIGHUP then never ends the process: it is waited for below.
void BlockTerminationSignals();

// Waits until SIGINT or SIGTERM arrives; returns its number. Each SIGHUP
// before it runs `on_reload` (when set) on the calling thread, then waits on.
int WaitForTerminationSignal(const std::function<void()>& on_reload = {});
// The same for at most `timeout`: the signal's number, or 0 when none came
// (a SIGHUP runs `on_reload` and answers 0 too).
int WaitForTerminationSignalFor(absl::Duration timeout,
                                const std::function<void()>& on_reload = {});

// Raises this process's soft limit of open files to its hard limit (the
// default soft one is often 1024); logs a warning when it cannot.
void RaiseOpenFileLimit();

// Writes `port` and a newline to `path` atomically (a temporary file renamed
// into place), so a launcher polling for the file never reads half of it.
absl::Status WritePortFile(const std::string& path, int port);

// Names the calling thread as `top -H` and /proc/PID/task/TID/comm show it
// (the first 15 characters). pd-plan profile tells a worker's engine thread
// ("pd-engine") from its serving threads by it.
void NameThisThread(const std::string& name);

// What main() does once its server is up: writes `port` to `port_file`
// (unless empty) and waits for SIGINT or SIGTERM, logging as `program`,
// running `on_reload` on each SIGHUP (e.g. TLS certificates re-read).
// Returns false (after logging why) when the port file cannot be written;
// the caller then shuts down and exits 1.
bool AnnounceAndWaitForSignal(const std::string& program, int port,
                              const std::string& port_file,
                              const std::function<void()>& on_reload = {});

}  // namespace pdserve

#endif  // PDSERVE_COMMON_PROCESS_H_
