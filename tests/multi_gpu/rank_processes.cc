#include "tests/multi_gpu/rank_processes.h"

#include <fcntl.h>
#include <httplib.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "clients/recv/engine_listener.h"
#include "nlohmann/json.hpp"

namespace wpub::testing {
namespace {

using json = nlohmann::json;

struct Rank {
  pid_t pid = -1;
  int out = -1;  // the rank's stdout
  int port = 0;
};

struct Answer {
  int status = 0;  // 0: not reached
  std::string body;
};

// Starts `self 0 <device> <rank_args...>` with its stdout on a pipe. Everything the child needs
// is built before fork (the parent has no other threads yet, but exec's arguments stay
// async-signal-safe anyway).
bool StartRank(const std::string& self, int device, int index,
               const std::vector<std::string>& rank_args, Rank* rank) {
  std::vector<std::string> argv = {self, "0", std::to_string(device)};
  argv.insert(argv.end(), rank_args.begin(), rank_args.end());
  std::vector<char*> args;
  for (auto& a : argv) args.push_back(a.data());
  args.push_back(nullptr);
  const char* base = std::getenv("NCCL_HOSTID");
  std::vector<std::string> own = {
      absl::StrCat(
          "NCCL_HOSTID=", base != nullptr ? base : absl::StrCat("wpub-engine-", ::getpid()),
          "-rank", index),
      "NCCL_SOCKET_IFNAME=lo", "NCCL_IB_DISABLE=1"};
  std::vector<char*> envp;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string_view entry(*e);
    if (entry.rfind("NCCL_HOSTID=", 0) == 0 || entry.rfind("NCCL_SOCKET_IFNAME=", 0) == 0 ||
        entry.rfind("NCCL_IB_DISABLE=", 0) == 0) {
      continue;
    }
    envp.push_back(*e);
  }
  for (auto& e : own) envp.push_back(e.data());
  envp.push_back(nullptr);
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return false;
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) return false;
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) _exit(1);  // the parent died before prctl
    ::dup2(fds[1], 1);
    ::execve(args[0], args.data(), envp.data());
    _exit(127);
  }
  ::close(fds[1]);
  rank->pid = pid;
  rank->out = fds[0];
  return true;
}

// The port from the rank's first line ("... on :<port> ..."), within 60 s.
bool ReadPort(Rank* rank) {
  std::string line;
  for (int waited_ms = 0; waited_ms < 60000 && line.find('\n') == std::string::npos;) {
    pollfd p{rank->out, POLLIN, 0};
    if (::poll(&p, 1, 100) <= 0) {
      waited_ms += 100;
      continue;
    }
    char c;
    if (::read(rank->out, &c, 1) != 1) return false;
    line.push_back(c);
  }
  std::fputs(line.c_str(), stdout);
  const size_t at = line.find(" on :");
  if (at == std::string::npos) return false;
  const size_t end = line.find_first_not_of("0123456789", at + 5);
  return absl::SimpleAtoi(line.substr(at + 5, end - at - 5), &rank->port) && rank->port > 0;
}

Answer Forward(int port, const std::string& method, const std::string& path,
               const std::string& body) {
  httplib::Client c("127.0.0.1", port);
  c.set_connection_timeout(5);
  c.set_read_timeout(600);
  c.set_write_timeout(60);
  auto r = method == "GET" ? c.Get(path) : c.Post(path, body, "application/json");
  if (!r) return {};
  return {r->status, r->body};
}

// The first difference between rank 0's and another rank's /stats, or "".
std::string StatsDifference(const std::vector<Answer>& answers) {
  const json first = json::parse(answers[0].body, nullptr, false);
  if (first.is_discarded()) return "rank 0's /stats is not JSON";
  for (size_t i = 1; i < answers.size(); ++i) {
    const json other = json::parse(answers[i].body, nullptr, false);
    if (other.is_discarded()) return absl::StrCat("rank ", i, "'s /stats is not JSON");
    for (const char* field : {"buckets", "bytes", "checksums"}) {
      for (const auto& [version, record] : first.items()) {
        if (!other.contains(version) ||
            other[version].value(field, json()) != record.value(field, json())) {
          return absl::StrCat("rank ", i, " differs from rank 0 in version ", version, "'s ",
                              field);
        }
      }
    }
    if (other.size() != first.size()) {
      return absl::StrCat("rank ", i, " recorded ", other.size(), " versions, rank 0 ",
                          first.size());
    }
  }
  return "";
}

}  // namespace

int RunRankProcesses(const std::string& self, int port, const std::vector<int>& devices,
                     const std::vector<std::string>& rank_args) {
  std::vector<Rank> ranks(devices.size());
  for (size_t i = 0; i < devices.size(); ++i) {
    if (!StartRank(self, devices[i], static_cast<int>(i), rank_args, &ranks[i])) {
      std::fprintf(stderr, "cannot start rank %zu\n", i);
      return 3;
    }
  }
  // Any rank's exit takes the engine down. Started before the ports are read, so a rank that
  // fails at startup ends the engine at once.
  std::thread([&ranks] {
    int st = 0;
    const pid_t dead = ::wait(&st);
    std::printf("rank process %d exited (status %d): the engine exits\n", static_cast<int>(dead),
                st);
    std::fflush(stdout);
    for (const Rank& r : ranks) ::kill(r.pid, SIGKILL);
    ::kill(::getpid(), SIGKILL);
  }).detach();
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (!ReadPort(&ranks[i])) {
      std::fprintf(stderr, "rank %zu did not report its port\n", i);
      for (const Rank& r : ranks) ::kill(r.pid, SIGKILL);
      return 3;
    }
    // The rest of the rank's output goes to this process's stdout (the engine's log).
    std::thread([fd = ranks[i].out] {
      char buf[4096];
      for (ssize_t n; (n = ::read(fd, buf, sizeof(buf))) > 0;) {
        (void)!::write(1, buf, static_cast<size_t>(n));
      }
    }).detach();
  }

  auto all = [&ranks](const std::string& method, const std::string& path,
                      const std::function<std::string(size_t)>& body) {
    std::vector<Answer> answers(ranks.size());
    std::vector<std::thread> threads;
    for (size_t i = 0; i < ranks.size(); ++i) {
      threads.emplace_back([&, i] { answers[i] = Forward(ranks[i].port, method, path, body(i)); });
    }
    for (auto& t : threads) t.join();
    return answers;
  };
  auto reply = [](const std::vector<Answer>& answers, httplib::Response& res) {
    for (size_t i = 0; i < answers.size(); ++i) {
      if (answers[i].status == 0) {
        res.status = 502;
        res.set_content(
            absl::StrCat("{\"success\": false, \"message\": \"rank ", i, " did not answer\"}"),
            "application/json");
        return;
      }
      if (answers[i].status != 200) {
        res.status = answers[i].status;
        res.set_content(answers[i].body, "application/json");
        return;
      }
    }
    res.status = 200;
    res.set_content(answers[0].body, "application/json");
  };

  httplib::Server server;
  server.Get("/stats", [&](const httplib::Request&, httplib::Response& res) {
    auto answers = all("GET", "/stats", [](size_t) { return std::string(); });
    reply(answers, res);
    if (res.status != 200) return;
    if (std::string diff = StatsDifference(answers); !diff.empty()) {
      res.status = 500;
      res.set_content(diff, "text/plain");
    }
  });
  server.Get(R"(/.*)", [&](const httplib::Request& req, httplib::Response& res) {
    if (req.path == "/health") {
      reply(all("GET", "/health", [](size_t) { return std::string(); }), res);
      return;
    }
    Answer a = Forward(ranks[0].port, "GET", req.path, "");
    res.status = a.status == 0 ? 502 : a.status;
    res.set_content(a.body, "application/json");
  });
  server.Post(R"(/.*)", [&](const httplib::Request& req, httplib::Response& res) {
    const bool init = req.path == "/init_weights_update_group";
    const json parsed = init ? json::parse(req.body, nullptr, false) : json();
    reply(all("POST", req.path,
              [&](size_t i) {
                if (!init || !parsed.is_object() || !parsed.contains("rank_offset") ||
                    !parsed["rank_offset"].is_number_integer()) {
                  return req.body;
                }
                json mine = parsed;
                mine["rank_offset"] =
                    parsed["rank_offset"].get<int64_t>() + static_cast<int64_t>(i);
                return mine.dump();
              }),
          res);
  });
  std::thread serving;
  auto bound =
      recv::ServeEngineHttp(server, "127.0.0.1", port, "the rank processes' front", &serving);
  if (!bound.ok()) {
    std::fprintf(stderr, "%s\n", bound.status().ToString().c_str());
    for (const Rank& r : ranks) ::kill(r.pid, SIGKILL);
    return 3;
  }
  std::printf("cpp receiver on :%d: %zu rank processes in front\n", *bound, ranks.size());
  std::fflush(stdout);
  serving.join();  // until killed
  return 0;
}

}  // namespace wpub::testing
