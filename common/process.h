// What every pdserve binary's main() needs around its server: waiting for
// SIGINT/SIGTERM and telling a launcher which port was bound.
#ifndef PDSERVE_COMMON_PROCESS_H_
#define PDSERVE_COMMON_PROCESS_H_

#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace pdserve {

// Blocks SIGINT and SIGTERM in the calling thread and every thread it
// starts afterwards. Call first in main(), before any thread exists.
void BlockTerminationSignals();

// Waits until SIGINT or SIGTERM arrives; returns its number.
int WaitForTerminationSignal();
// The same for at most `timeout`: the signal's number, or 0 when none came.
int WaitForTerminationSignalFor(absl::Duration timeout);

// Writes `port` and a newline to `path` atomically (a temporary file renamed
// into place), so a launcher polling for the file never reads half of it.
// Raises this process's soft limit of open files to its hard limit (the
// default soft one is often 1024); logs a warning when it cannot.
void RaiseOpenFileLimit();

absl::Status WritePortFile(const std::string& path, int port);

// What main() does once its server is up: writes `port` to `port_file`
// (unless empty) and waits for SIGINT or SIGTERM, logging as `program`.
// Returns false (after logging why) when the port file cannot be written;
// the caller then shuts down and exits 1.
bool AnnounceAndWaitForSignal(const std::string& program, int port,
                              const std::string& port_file);

}  // namespace pdserve

#endif  // PDSERVE_COMMON_PROCESS_H_
