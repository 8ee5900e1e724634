// What the benches that run pdserve binaries as separate processes share:
// starting a child with its stdout piped back, reading the line it
// announces itself with, sampling a process's CPU time and resident set
// from /proc, and describing the machine a figure was measured on.
//
// Linux only (/proc). Every function may be called from any thread; none
// keeps state.
#ifndef PDSERVE_BENCH_BENCH_PROCESS_H_
#define PDSERVE_BENCH_BENCH_PROCESS_H_

#include <spawn.h>
#include <sys/types.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"

extern char** environ;

namespace pdserve::bench {

struct ProcessSample {
  double cpu_seconds = 0;  // user + system, since the process started
  double rss_mib = 0;      // VmRSS
};

// The process's CPU time and resident set now; zeros once it is gone.
inline ProcessSample SampleProcess(pid_t pid) {
  ProcessSample out;
  std::ifstream stat(absl::StrCat("/proc/", pid, "/stat"));
  std::string line;
  std::getline(stat, line);
  if (line.empty()) return out;
  // Fields after the ")" of the command name: state is field 3; utime 14,
  // stime 15.
  std::istringstream rest(line.substr(line.rfind(')') + 2));
  std::vector<std::string> fields;
  std::string f;
  while (rest >> f) fields.push_back(f);
  const double tick = static_cast<double>(sysconf(_SC_CLK_TCK));
  if (fields.size() > 13) {
    out.cpu_seconds = (std::stod(fields[11]) + std::stod(fields[12])) / tick;
  }
  std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
  while (std::getline(status, line)) {
    if (absl::StartsWith(line, "VmRSS:")) {
      out.rss_mib = std::stod(line.substr(6)) / 1024.0;
    }
  }
  return out;
}

// Starts `args` (args[0] a path) with its stdout on a pipe whose read end
// goes to *stdout_fd; stderr is shared with this process.
inline pid_t Spawn(const std::vector<std::string>& args, int* stdout_fd) {
  int pipe_fds[2];
  if (pipe(pipe_fds) != 0) return -1;
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, pipe_fds[1], STDOUT_FILENO);
  posix_spawn_file_actions_addclose(&actions, pipe_fds[0]);
  std::vector<char*> argv;
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  pid_t pid = 0;
  if (posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), environ) !=
      0) {
    pid = -1;
  }
  posix_spawn_file_actions_destroy(&actions);
  close(pipe_fds[1]);
  *stdout_fd = pipe_fds[0];
  return pid;
}

// One line from `fd`, without its newline; blocks until it is complete or
// the writer closed its end.
inline std::string ReadLine(int fd) {
  std::string line;
  char c;
  while (read(fd, &c, 1) == 1 && c != '\n') line += c;
  return line;
}

// This executable's path (for starting it again in another role).
inline std::filesystem::path SelfExe() {
  return std::filesystem::read_symlink("/proc/self/exe");
}

// The first "flags" line of /proc/cpuinfo, without its "flags :" label.
inline std::string CpuFlagsLine() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (absl::StartsWith(line, "flags")) {
      return std::string(
          absl::StripAsciiWhitespace(line.substr(line.find(':') + 1)));
    }
  }
  return "";
}

// The machine, for the line above a table: CPU model, logical CPUs, memory,
// and the CPU flags a reader compares machines by (the whole line is
// CpuFlagsLine()).
inline std::string MachineDescription() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line, model = "unknown CPU";
  while (std::getline(cpuinfo, line)) {
    if (absl::StartsWith(line, "model name")) {
      model = std::string(absl::StripAsciiWhitespace(
          line.substr(line.find(':') + 1)));
      break;
    }
  }
  std::ifstream meminfo("/proc/meminfo");
  double mem_gib = 0;
  while (std::getline(meminfo, line)) {
    if (absl::StartsWith(line, "MemTotal:")) {
      mem_gib = std::stod(line.substr(9)) / (1024.0 * 1024.0);
    }
  }
  std::vector<std::string> notable;
  const std::string flags = absl::StrCat(" ", CpuFlagsLine(), " ");
  for (const char* f : {"avx2", "fma", "f16c", "avx512f", "avx512_vnni",
                        "avx512_bf16", "amx_tile"}) {
    if (absl::StrContains(flags, absl::StrCat(" ", f, " "))) {
      notable.push_back(f);
    }
  }
  return absl::StrCat(model, ", ", std::thread::hardware_concurrency(),
                      " logical CPUs, ",
                      static_cast<int>(mem_gib + 0.5), " GiB, flags ",
                      absl::StrJoin(notable, " "));
}

}  // namespace pdserve::bench

#endif  // PDSERVE_BENCH_BENCH_PROCESS_H_
