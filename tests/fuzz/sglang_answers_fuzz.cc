// Fuzz target `sglang_answers`: what an SGLang engine answers the driver (core/engines
// SglangDriver: cpp-httplib's response parsing, then the {"success", "message"} JSON of the
// weight-update routes). A loopback responder answers every request with the input: with its
// first byte even, the rest is the body of an `HTTP/1.1 200` answer with a correct
// Content-Length; odd, the rest is sent as the raw answer. The driver joins the group, then
// publishes one bucket (the lifecycle calls other than init and update are switched off), and
// the health probe runs once. Properties: nothing crashes or hangs (every call ends within
// the request timeout), and an engine marked failed carries a reason.
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "core/rollout/sglang_driver.h"
#include "tests/fuzz/fuzz_check.h"

namespace {

// Answers every HTTP request on a loopback port with the current answer, one connection at a
// time: reads the request (headers and Content-Length body), writes the answer and closes the
// connection (an answer without framing ends there; the client reconnects for the next one).
class Responder {
 public:
  Responder() {
    listen_fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(addr);
    FUZZ_CHECK(::bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
                   ::listen(listen_fd_, 64) == 0 &&
                   ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len) == 0,
               "cannot listen on loopback");
    port_ = ntohs(addr.sin_port);
    thread_ = std::thread([this] { Run(); });
  }

  uint16_t port() const { return port_; }
  void SetAnswer(std::string answer) {
    std::lock_guard lock(mu_);
    answer_ = std::move(answer);
  }

 private:
  void Run() {
    for (;;) {
      const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) continue;
      Serve(fd);
      ::close(fd);
    }
  }

  // Reads into `in` until `done(in)` or EOF or 2 s without a byte; false on EOF/timeout.
  template <typename Done>
  static bool ReadUntil(int fd, std::string& in, Done done) {
    char buf[4096];
    while (!done(in)) {
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, 2000) != 1) return false;
      const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
      if (n <= 0) return false;
      in.append(buf, static_cast<size_t>(n));
    }
    return true;
  }

  void Serve(int fd) {
    std::string in;
    size_t header_end = 0;
    if (!ReadUntil(fd, in, [&](const std::string& s) {
          header_end = s.find("\r\n\r\n");
          return header_end != std::string::npos;
        })) {
      return;
    }
    size_t body = 0;
    for (absl::string_view line :
         absl::StrSplit(absl::string_view(in).substr(0, header_end), "\r\n")) {
      if (absl::StartsWithIgnoreCase(line, "content-length:")) {
        (void)absl::SimpleAtoi(absl::StripAsciiWhitespace(line.substr(15)), &body);
      }
    }
    const size_t want = header_end + 4 + body;
    if (!ReadUntil(fd, in, [&](const std::string& s) { return s.size() >= want; })) return;
    std::string answer;
    {
      std::lock_guard lock(mu_);
      answer = answer_;
    }
    size_t off = 0;
    while (off < answer.size()) {
      const ssize_t n = ::send(fd, answer.data() + off, answer.size() - off, MSG_NOSIGNAL);
      if (n <= 0) return;
      off += static_cast<size_t>(n);
    }
  }

  int listen_fd_ = -1;
  uint16_t port_ = 0;
  std::mutex mu_;
  std::string answer_;
  std::thread thread_;  // serves for the life of the process
};

Responder& TheResponder() {
  static Responder* r = new Responder();  // never destroyed: its thread runs until exit
  return *r;
}

void CheckOutcomes(const wpub::rollout::SglangDriver& driver) {
  for (const wpub::rollout::EngineOutcome& o : driver.outcomes()) {
    FUZZ_CHECK(!o.failed || !o.error.empty(), "an engine failed without a reason");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  Responder& responder = TheResponder();
  const std::string rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] % 2 == 0) {
    responder.SetAnswer(absl::StrCat("HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n",
                                     "Content-Length: ", rest.size(), "\r\n\r\n", rest));
  } else {
    responder.SetAnswer(rest);
  }

  wpub::rollout::SglangDriverOptions o;
  const std::string url = absl::StrCat("http://127.0.0.1:", responder.port());
  o.engines = {{url, 1}};
  o.master_port = 29500;
  o.connect_timeout = absl::Seconds(2);
  o.request_timeout = absl::Seconds(2);
  o.endpoints.pause = o.endpoints.flush = o.endpoints.begin = "";
  o.endpoints.version = o.endpoints.end = o.endpoints.resume = "";
  absl::StatusOr<std::unique_ptr<wpub::rollout::SglangDriver>> driver =
      wpub::rollout::SglangDriver::Create(o);
  FUZZ_CHECK(driver.ok(), driver.status().ToString());
  const absl::Duration bound = absl::Seconds(10);  // well above every request's timeout

  (*driver)->StartJoin();
  absl::Status joined = (*driver)->WaitIdle(absl::Now() + bound);
  FUZZ_CHECK(!absl::IsDeadlineExceeded(joined), joined.ToString());
  CheckOutcomes(**driver);

  wpub::transport::BucketManifest bucket;
  bucket.index = 0;
  bucket.nbytes = 32;
  bucket.tensors.push_back({"model.norm.weight", wpub::DType::kBFloat16, {16}, 0, 32});
  (*driver)->BeginPublication(1, /*lifecycle_calls=*/true);
  (*driver)->PostBucket(bucket);
  (*driver)->EndPublication();
  absl::Status published = (*driver)->WaitIdle(absl::Now() + bound);
  FUZZ_CHECK(!absl::IsDeadlineExceeded(published), published.ToString());
  CheckOutcomes(**driver);

  const std::vector<bool> alive =
      wpub::rollout::ProbeEngines(o.engines, "/health", absl::Seconds(2));
  FUZZ_CHECK(alive.size() == 1, "one probe answer per engine");
  return 0;
}
