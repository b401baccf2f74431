// Running wpubd and wpub-recv as child processes (wpubctl demo, end-to-end tests): spawn with
// output redirected to a log file, signal, wait with a timeout, and read wpubd's ready file.
// RAII: a ChildProcess still running at destruction gets SIGTERM, then SIGKILL after 5 s.
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace wpub::client {

struct SpawnOptions {
  std::string path;               // executable
  std::vector<std::string> args;  // without argv[0]
  std::string log_path;           // stdout and stderr go here (appended); empty: inherited
};

// Thread-compatible (one owner).
class ChildProcess {
 public:
  static absl::StatusOr<std::unique_ptr<ChildProcess>> Spawn(const SpawnOptions& options);
  ~ChildProcess();
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  pid_t pid() const { return pid_; }
  // False once it exited (reaps it; exit_code() is then valid).
  bool Running();
  // Sends `signal` (no-op after exit).
  void Signal(int signal);
  // Waits up to `timeout` for exit. Returns the exit code (128 + signal when killed by one),
  // DEADLINE_EXCEEDED when still running.
  absl::StatusOr<int> Wait(absl::Duration timeout);
  // SIGTERM, then SIGKILL if it has not exited within `grace`; returns the exit code.
  int Stop(absl::Duration grace = absl::Seconds(5));
  int exit_code() const { return exit_code_; }

 private:
  explicit ChildProcess(pid_t pid) : pid_(pid) {}
  pid_t pid_;
  bool exited_ = false;
  int exit_code_ = -1;
};

// The ports wpubd bound, from its --ready_file.
struct DaemonPorts {
  int grpc_port = 0;
  int metrics_port = 0;
};

// Polls `path` until wpubd wrote it (or `daemon` exited: FAILED_PRECONDITION with its exit
// code; or `timeout`: DEADLINE_EXCEEDED).
absl::StatusOr<DaemonPorts> WaitForReadyFile(const std::string& path, ChildProcess* daemon,
                                             absl::Duration timeout);

// The directory of the running executable ("/.../build/server/wpubctl"), for locating sibling
// binaries of a build tree.
std::string ExecutableDir();

}  // namespace wpub::client
