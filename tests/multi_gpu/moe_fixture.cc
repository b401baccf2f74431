// Synthetic MoE layout/values/plan, the publication driver and child-process helpers.
#include "tests/multi_gpu/moe_fixture.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/common/status.h"
#include "core/transport/planner.h"
#include "core/transport/transport_group.h"

namespace wpub::testing {
namespace {

uint64_t Mix(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

uint64_t AlignUp(uint64_t v) { return (v + 255) / 256 * 256; }

}  // namespace

ModelLayout LayoutModel(const MoeShape& s) {
  ModelLayout m;
  auto add = [&](std::string name, Shape shape, bool quantize, int pair = -1) {
    ModelTensor t;
    t.name = std::move(name);
    t.shape = std::move(shape);
    t.nbytes = static_cast<uint64_t>(NumElements(t.shape)) * 2;
    t.offset = AlignUp(m.total_bytes);
    t.quantize = quantize;
    t.pair = pair;
    m.total_bytes = t.offset + t.nbytes;
    if (quantize) m.expert_bytes += t.nbytes;
    m.tensors.push_back(std::move(t));
    return static_cast<int>(m.tensors.size()) - 1;
  };
  if (s.embeddings) add("model.embed_tokens.weight", {s.vocab, s.hidden}, false);
  for (int l = 0; l < s.layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    add(p + "input_layernorm.weight", {s.hidden}, false);
    add(p + "self_attn.q_proj.weight", {s.heads * s.head_dim, s.hidden}, false);
    add(p + "self_attn.k_proj.weight", {s.kv_heads * s.head_dim, s.hidden}, false);
    add(p + "self_attn.v_proj.weight", {s.kv_heads * s.head_dim, s.hidden}, false);
    add(p + "self_attn.o_proj.weight", {s.hidden, s.heads * s.head_dim}, false);
    add(p + "self_attn.q_norm.weight", {s.head_dim}, false);
    add(p + "self_attn.k_norm.weight", {s.head_dim}, false);
    add(p + "post_attention_layernorm.weight", {s.hidden}, false);
    add(p + "mlp.gate.weight", {s.experts, s.hidden}, false);
    for (int e = 0; e < s.experts; ++e) {
      const std::string x = absl::StrCat(p, "mlp.experts.", e, ".");
      const int gate = add(x + "gate_proj.weight", {s.inter, s.hidden}, true);
      add(x + "up_proj.weight", {s.inter, s.hidden}, true, gate);
      add(x + "down_proj.weight", {s.hidden, s.inter}, true);
    }
  }
  if (s.embeddings) add("lm_head.weight", {s.vocab, s.hidden}, false);
  return m;
}

void FillHost(const ModelLayout& layout, uint64_t seed, uint8_t* base) {
  for (size_t t = 0; t < layout.tensors.size(); ++t) {
    const ModelTensor& mt = layout.tensors[t];
    auto* out = reinterpret_cast<uint16_t*>(base + mt.offset);
    const uint64_t n = mt.nbytes / 2;
    const uint64_t key = Mix(seed * 0x100000001B3ull + t);
    for (uint64_t i = 0; i < n; ++i) {
      const uint64_t r = Mix(key ^ i);
      // Roughly normal-sized weights: a uniform in [-1, 1) times a per-tensor scale, with an
      // occasional outlier so block scales vary.
      float v = static_cast<float>(static_cast<int64_t>(r >> 11) - (int64_t{1} << 52)) /
                static_cast<float>(int64_t{1} << 52);
      v *= (r & 0xFF) == 0 ? 0.5f : 0.02f;
      uint32_t bits;
      std::memcpy(&bits, &v, 4);
      out[i] = static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);  // RNE
    }
  }
}

absl::StatusOr<BuiltPlan> BuildPlan(const ModelLayout& layout, const uint8_t* base, bool nvfp4,
                                    uint64_t bucket_bytes, uint64_t version,
                                    std::vector<engine::InputTensor>* inputs,
                                    engine::PartMemory memory) {
  BuiltPlan b;
  engine::ExecutionPlan& plan = b.plan;
  plan.version = version;
  inputs->clear();
  std::vector<uint32_t> units;
  for (size_t i = 0; i < layout.tensors.size(); ++i) {
    const ModelTensor& t = layout.tensors[i];
    engine::InputTensor in;
    in.desc = TensorDesc{t.name, t.dtype, t.shape};
    in.parts.push_back(engine::PartView{base + t.offset, t.shape, t.nbytes, memory});
    in.batch = i;
    inputs->push_back(std::move(in));
  }
  std::vector<int> group_of(layout.tensors.size(), -1);
  for (size_t i = 0; i < layout.tensors.size(); ++i) {
    const ModelTensor& t = layout.tensors[i];
    if (!(nvfp4 && t.quantize)) {
      plan.outputs.push_back(TensorDesc{t.name, t.dtype, t.shape});
      plan.sources.push_back({engine::OutputKind::kPassthrough, i, -1});
      units.push_back(1);
      continue;
    }
    if (t.pair >= 0) {
      group_of[i] = group_of[static_cast<size_t>(t.pair)];
      plan.amax_groups[static_cast<size_t>(group_of[i])].members.push_back(i);
    } else {
      group_of[i] = static_cast<int>(plan.amax_groups.size());
      plan.amax_groups.push_back(engine::AmaxGroupPlan{{i}, 1});
    }
    const std::string stem = t.name.substr(0, t.name.size() - std::string(".weight").size());
    const int64_t m = t.shape[0], k = t.shape[1];
    plan.outputs.push_back(TensorDesc{stem + ".weight", DType::kUInt8, {m, k / 2}});
    plan.outputs.push_back(TensorDesc{stem + ".weight_scale", DType::kFloat8E4M3, {m, k / 16}});
    plan.outputs.push_back(TensorDesc{stem + ".weight_scale_2", DType::kFloat32, {}});
    for (auto kind : {engine::OutputKind::kPacked, engine::OutputKind::kScales,
                      engine::OutputKind::kDecodeScale}) {
      plan.sources.push_back({kind, i, group_of[i]});
    }
    units.push_back(3);
  }
  plan.inputs = inputs;
  WPUB_ASSIGN_OR_RETURN(plan.buckets, transport::PlanBuckets(plan.outputs, units, bucket_bytes));
  WPUB_RETURN_IF_ERROR(transport::CheckLayout(plan.buckets, plan.outputs, units, bucket_bytes));
  b.manifest.version = version;
  b.manifest.model_id = "synthetic-qwen3-moe";
  b.manifest.recipe = nvfp4 ? "nvfp4" : "bf16";
  for (const auto& bl : plan.buckets) {
    b.manifest.buckets.push_back(transport::MakeBucketManifest(bl, plan.outputs));
    b.bytes_out += bl.nbytes;
  }
  return b;
}

PublishResult Publish(engine::Backend& backend, transport::Transport& member,
                      const BuiltPlan& built, absl::Duration ack_deadline) {
  PublishResult r;
  const auto t0 = std::chrono::steady_clock::now();
  engine::SyncCounter syncs;
  // The engine's road: every bucket through a transport group, which hands `member` the
  // bucket where it accepts it (a host copy for a host-only transport).
  absl::StatusOr<std::unique_ptr<transport::TransportGroup>> group =
      transport::TransportGroup::Create({&member});
  if (!group.ok()) {
    r.status = group.status();
    return r;
  }
  transport::Transport& transport = **group;
  auto finish = [&](absl::Status s) {
    if (!s.ok()) transport.Abort(s.message());
    r.status = s;
    r.wall_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    r.host_syncs = syncs.count();
    r.outcomes = transport.Outcomes();
    return r;
  };
  auto lap = [last = t0]() mutable {
    const auto now = std::chrono::steady_clock::now();
    const double s = std::chrono::duration<double>(now - last).count();
    last = now;
    return s;
  };
  if (auto b = transport.Begin(built.manifest); !b.ok()) return finish(b.status());
  r.begin_seconds = lap();
  engine::ExecutionHooks hooks;
  hooks.syncs = &syncs;
  hooks.emit = [&](std::shared_ptr<const transport::Bucket> bucket) {
    return transport.Send(std::move(bucket));
  };
  hooks.cancelled = [] { return false; };
  auto executed = backend.Execute(built.plan, hooks);
  r.execute_seconds = lap();
  r.executed_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                      std::chrono::steady_clock::now().time_since_epoch())
                      .count();
  if (!executed.ok()) return finish(executed.status());
  if (absl::Status s = transport.WaitAcknowledged(absl::Now() + ack_deadline); !s.ok()) {
    return finish(s);
  }
  r.acknowledge_seconds = lap();
  absl::Status committed = transport.Commit();
  r.commit_seconds = lap();
  return finish(committed);
}

// ---------------------------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<Child>> Child::Spawn(const std::vector<std::string>& argv,
                                                    const std::string& log_path, bool pipes,
                                                    const std::vector<std::string>& env) {
  int in_pipe[2] = {-1, -1}, out_pipe[2] = {-1, -1};
  if (pipes && (::pipe2(in_pipe, O_CLOEXEC) != 0 || ::pipe2(out_pipe, O_CLOEXEC) != 0)) {
    return absl::InternalError("pipe() failed");
  }
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  // The child's environment, built here: between fork and exec only async-signal-safe calls.
  std::vector<char*> envp;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string_view entry(*e);
    const std::string_view name = entry.substr(0, entry.find('='));
    const bool replaced = std::any_of(env.begin(), env.end(), [&](const std::string& set) {
      return set.size() > name.size() && set.compare(0, name.size(), name) == 0 &&
             set[name.size()] == '=';
    });
    if (!replaced) envp.push_back(*e);
  }
  for (const auto& e : env) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  const pid_t pid = ::fork();
  if (pid < 0) return absl::InternalError("fork() failed");
  if (pid == 0) {
    if (pipes) {
      ::dup2(in_pipe[0], 0);
      ::dup2(out_pipe[1], 1);
    }
    if (!log_path.empty()) {
      const int fd = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
      if (fd >= 0) {
        if (!pipes) ::dup2(fd, 1);
        ::dup2(fd, 2);
      }
    }
    ::execvpe(args[0], args.data(), envp.data());
    _exit(127);
  }
  std::unique_ptr<Child> c(new Child());
  c->pid_ = pid;
  if (pipes) {
    ::close(in_pipe[0]);
    ::close(out_pipe[1]);
    c->in_ = in_pipe[1];
    c->out_ = out_pipe[0];
  }
  return c;
}

Child::~Child() {
  Kill();
  if (in_ >= 0) ::close(in_);
  if (out_ >= 0) ::close(out_);
}

void Child::Kill() {
  if (reaped_ || pid_ <= 0) return;
  ::kill(pid_, SIGKILL);
  int st;
  ::waitpid(pid_, &st, 0);
  reaped_ = true;
}

bool Child::Running() {
  if (reaped_) return false;
  int st;
  if (::waitpid(pid_, &st, WNOHANG) == pid_) reaped_ = true;
  return !reaped_;
}

absl::Status Child::WriteLine(const std::string& line) {
  const std::string l = line + "\n";
  if (::write(in_, l.data(), l.size()) != static_cast<ssize_t>(l.size())) {
    return absl::UnavailableError("child stdin closed");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> Child::ReadLine(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  for (;;) {
    if (auto nl = buffer_.find('\n'); nl != std::string::npos) {
      std::string line = buffer_.substr(0, nl);
      buffer_.erase(0, nl + 1);
      return line;
    }
    const int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (ms <= 0) return absl::DeadlineExceededError("child did not answer in time");
    pollfd p{out_, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(ms)) <= 0) continue;
    char buf[4096];
    const ssize_t n = ::read(out_, buf, sizeof(buf));
    if (n <= 0) return absl::UnavailableError("child closed its stdout");
    buffer_.append(buf, static_cast<size_t>(n));
  }
}

std::string SourceDir() {
  const char* d = std::getenv("WPUB_SOURCE_DIR");
  return d != nullptr ? d : WPUB_DEFAULT_SOURCE_DIR;
}

std::string Python() {
  const char* p = std::getenv("WPUB_PYTHON");
  return p != nullptr ? p : "python3";
}

std::string SiblingBinary(const std::string& name) {
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  std::string self = n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
  return self.substr(0, self.rfind('/') + 1) + name;
}

MoeShape Qwen3MoeShape() {
  MoeShape s;
  s.layers = 48;
  s.experts = 128;
  s.hidden = 2048;
  s.inter = 768;
  s.heads = 32;
  s.kv_heads = 4;
  s.head_dim = 128;
  return s;
}

std::string TestWorkDir(const std::string& prefix, const std::string& test_name) {
  if (const char* keep = std::getenv("WPUB_TEST_LOG_DIR")) {
    ::mkdir(keep, 0755);
    const std::string dir = absl::StrCat(keep, "/", test_name);
    ::mkdir(dir.c_str(), 0755);
    return dir;
  }
  std::string tmpl = "/tmp/" + prefix + "XXXXXX";
  return ::mkdtemp(tmpl.data()) != nullptr ? tmpl : std::string();
}

int FreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

namespace {
absl::StatusOr<std::string> HttpRequest(int port, const std::string& request,
                                        const std::string& what, absl::Duration timeout) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    ::close(fd);
    return absl::UnavailableError(absl::StrCat("connect :", port));
  }
  (void)!::write(fd, request.data(), request.size());
  std::string resp;
  char buf[65536];
  const absl::Time deadline = absl::Now() + timeout;
  for (;;) {
    const int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now());
    pollfd p{fd, POLLIN, 0};
    if (ms <= 0 || ::poll(&p, 1, static_cast<int>(ms)) <= 0) break;
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n <= 0) break;
    resp.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  const size_t body = resp.find("\r\n\r\n");
  if (resp.rfind("HTTP/1.1 200", 0) != 0 || body == std::string::npos) {
    return absl::UnavailableError(absl::StrCat(what, ": ", resp.substr(0, 200)));
  }
  return resp.substr(body + 4);
}
}  // namespace

absl::StatusOr<std::string> HttpGet(int port, const std::string& path) {
  return HttpRequest(
      port, absl::StrCat("GET ", path, " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"),
      "GET " + path, absl::Seconds(10));
}

absl::StatusOr<std::string> HttpPost(int port, const std::string& path, const std::string& body,
                                     absl::Duration timeout) {
  return HttpRequest(port,
                     absl::StrCat("POST ", path,
                                  " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
                                  "Content-Type: application/json\r\nContent-Length: ",
                                  body.size(), "\r\n\r\n", body),
                     "POST " + path, timeout);
}

absl::StatusOr<std::unique_ptr<Child>> StartEmulator(int port, int gpu,
                                                     const std::vector<std::string>& extra,
                                                     const std::string& log_path,
                                                     const std::vector<std::string>& env) {
  std::vector<std::string> argv = {Python(), SourceDir() + "/tests/multi_gpu/sglang_emulator.py",
                                   "--port", std::to_string(port),
                                   "--gpu",  std::to_string(gpu)};
  argv.insert(argv.end(), extra.begin(), extra.end());
  WPUB_ASSIGN_OR_RETURN(std::unique_ptr<Child> c, Child::Spawn(argv, log_path, false, env));
  WPUB_RETURN_IF_ERROR(
      WaitForHealth(*c, port, absl::Seconds(120), "the SGLang emulator", log_path));
  return c;
}

absl::Status WaitForHealth(Child& child, int port, absl::Duration timeout, const std::string& what,
                           const std::string& log_path) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    if (HttpGet(port, "/health").ok()) return absl::OkStatus();
    if (!child.Running()) {
      return absl::FailedPreconditionError(
          absl::StrCat(what, " exited at startup; see ", log_path));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return absl::DeadlineExceededError(absl::StrCat(
      what, " on port ", port, " did not answer /health in ", absl::FormatDuration(timeout)));
}

absl::StatusOr<std::unique_ptr<Child>> SpawnCppReceiver(int port, const std::vector<int>& gpus,
                                                        const std::vector<std::string>& args,
                                                        const std::string& log_path,
                                                        const std::string& binary,
                                                        const std::vector<std::string>& env) {
  std::vector<std::string> argv = {
      binary.empty() ? SiblingBinary("multi_gpu_cpp_receiver") : binary, std::to_string(port),
      absl::StrJoin(gpus, ",")};
  argv.insert(argv.end(), args.begin(), args.end());
  return Child::Spawn(argv, log_path, false, env);
}

}  // namespace wpub::testing
