// posix_spawn-based child processes and wpubd's ready file.
#include "server/client/child_process.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

extern char** environ;

namespace wpub::client {

absl::StatusOr<std::unique_ptr<ChildProcess>> ChildProcess::Spawn(const SpawnOptions& options) {
  std::vector<std::string> argv_storage = {options.path};
  argv_storage.insert(argv_storage.end(), options.args.begin(), options.args.end());
  std::vector<char*> argv;
  for (std::string& a : argv_storage) argv.push_back(a.data());
  argv.push_back(nullptr);

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  if (!options.log_path.empty()) {
    posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, options.log_path.c_str(),
                                     O_WRONLY | O_CREAT | O_APPEND, 0644);
    posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
  }
  // Children start with default signal dispositions and an empty mask, whatever the parent
  // blocked (wpubctl and the daemon both block SIGTERM for sigwait).
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t empty;
  sigemptyset(&empty);
  sigset_t defaults;
  sigemptyset(&defaults);
  sigaddset(&defaults, SIGTERM);
  sigaddset(&defaults, SIGINT);
  sigaddset(&defaults, SIGPIPE);
  posix_spawnattr_setsigmask(&attr, &empty);
  posix_spawnattr_setsigdefault(&attr, &defaults);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, options.path.c_str(), &actions, &attr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  if (rc != 0) {
    return absl::InternalError(
        absl::StrCat("cannot start '", options.path, "': ", std::strerror(rc)));
  }
  return std::unique_ptr<ChildProcess>(new ChildProcess(pid));
}

ChildProcess::~ChildProcess() {
  if (!exited_) Stop();
}

bool ChildProcess::Running() {
  if (exited_) return false;
  int status = 0;
  const pid_t r = waitpid(pid_, &status, WNOHANG);
  if (r == 0) return true;
  exited_ = true;
  if (r < 0) {
    exit_code_ = -1;
  } else if (WIFEXITED(status)) {
    exit_code_ = WEXITSTATUS(status);
  } else if (WIFSIGNALED(status)) {
    exit_code_ = 128 + WTERMSIG(status);
  }
  return false;
}

void ChildProcess::Signal(int signal) {
  if (Running()) kill(pid_, signal);
}

absl::StatusOr<int> ChildProcess::Wait(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (Running()) {
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("process ", pid_, " still running after ", absl::FormatDuration(timeout)));
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  return exit_code_;
}

int ChildProcess::Stop(absl::Duration grace) {
  Signal(SIGTERM);
  if (!Wait(grace).ok()) {
    Signal(SIGKILL);
    (void)Wait(absl::Seconds(10));
  }
  return exit_code_;
}

absl::StatusOr<DaemonPorts> WaitForReadyFile(const std::string& path, ChildProcess* daemon,
                                             absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    std::ifstream in(path);
    if (in) {
      std::stringstream ss;
      ss << in.rdbuf();
      nlohmann::json j = nlohmann::json::parse(ss.str(), nullptr, /*allow_exceptions=*/false);
      if (j.is_object() && j.contains("grpc_port")) {
        DaemonPorts ports;
        ports.grpc_port = j.value("grpc_port", 0);
        ports.metrics_port = j.value("metrics_port", 0);
        return ports;
      }
    }
    if (daemon != nullptr && !daemon->Running()) {
      return absl::FailedPreconditionError(
          absl::StrCat("wpubd exited with code ", daemon->exit_code(), " before it was ready"));
    }
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("wpubd did not write '", path, "' within ", absl::FormatDuration(timeout)));
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
}

std::string ExecutableDir() {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return ".";
  std::string path(buf, static_cast<size_t>(n));
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

}  // namespace wpub::client
