// The bounded random driver that runs a fuzz target in the normal build (no libFuzzer): every
// seed of the target's corpus, then a fixed number of deterministic mutations of them
// (libFuzzer-like byte mutations, dictionary tokens, splices), so CI fuzzes each target
// briefly and the same inputs every time. A crash or a failed FUZZ_CHECK aborts the test binary;
// a crash signal handler writes the input to `fuzz-<target>-{seed,mutation}-crash` in the working
// directory first, so it can be replayed with the libFuzzer binary or added to the corpus.
//
// Compile definitions (tests/fuzz/CMakeLists.txt): WPUB_FUZZ_TARGET, WPUB_FUZZ_SUITE (the gtest
// suite name), WPUB_FUZZ_CORPUS (folder),
// WPUB_FUZZ_DICT (file or ""), WPUB_FUZZ_ITERATIONS, WPUB_FUZZ_MAX_LEN. The environment may
// override the last two for a longer local run (WPUB_FUZZ_ITERATIONS, WPUB_FUZZ_SEED);
// WPUB_FUZZ_REPLAY replays given inputs (<suite>.Replay).
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

namespace fs = std::filesystem;
using Bytes = std::vector<uint8_t>;

Bytes ReadFile(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Every regular file of `dir`, in name order (so the run is the same on every machine).
std::vector<Bytes> ReadCorpus(const std::string& dir) {
  std::vector<fs::path> paths;
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    if (e.is_regular_file()) paths.push_back(e.path());
  }
  std::sort(paths.begin(), paths.end());
  std::vector<Bytes> out;
  for (const fs::path& p : paths) out.push_back(ReadFile(p));
  return out;
}

int HexDigit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// libFuzzer's dictionary format: one `"token"` (optionally `name="token"`) per line, with
// \\, \" and \xNN escapes; '#' lines are comments.
std::vector<Bytes> ReadDict(const std::string& path) {
  std::vector<Bytes> out;
  if (path.empty()) return out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    const size_t open = line.find('"');
    const size_t close = line.rfind('"');
    if (line.empty() || line[0] == '#' || open == std::string::npos || close <= open) continue;
    Bytes token;
    for (size_t i = open + 1; i < close; ++i) {
      if (line[i] == '\\' && i + 1 < close) {
        if (line[i + 1] == 'x' && i + 3 < close && HexDigit(line[i + 2]) >= 0 &&
            HexDigit(line[i + 3]) >= 0) {
          token.push_back(static_cast<uint8_t>(HexDigit(line[i + 2]) * 16 + HexDigit(line[i + 3])));
          i += 3;
        } else {
          token.push_back(static_cast<uint8_t>(line[++i]));
        }
      } else {
        token.push_back(static_cast<uint8_t>(line[i]));
      }
    }
    if (!token.empty()) out.push_back(std::move(token));
  }
  return out;
}

uint64_t EnvOr(const char* name, uint64_t fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::strtoull(v, nullptr, 10) : fallback;
}

// Deterministic byte mutations in the spirit of libFuzzer's MutationDispatcher.
class Mutator {
 public:
  Mutator(uint64_t seed, const std::vector<Bytes>* corpus, std::vector<Bytes> dict, size_t max_len)
      : rng_(seed), corpus_(corpus), dict_(std::move(dict)), max_len_(max_len) {}

  Bytes Next() {
    Bytes b = (*corpus_)[Below(corpus_->size())];
    const int n = 1 + static_cast<int>(Below(6));
    for (int i = 0; i < n; ++i) MutateOnce(b);
    if (b.size() > max_len_) b.resize(max_len_);
    return b;
  }

 private:
  uint64_t Below(uint64_t n) { return n == 0 ? 0 : rng_() % n; }

  void MutateOnce(Bytes& b) {
    static constexpr uint64_t kInteresting[] = {0,
                                                1,
                                                0x7f,
                                                0x80,
                                                0xff,
                                                0x7fff,
                                                0xffff,
                                                0x7fffffff,
                                                0x80000000,
                                                0xffffffff,
                                                ~uint64_t{0} >> 1,
                                                uint64_t{1} << 63,
                                                ~uint64_t{0}};
    const size_t pos = Below(b.size() + 1);
    switch (Below(b.empty() ? 3 : 10)) {
      case 0:  // insert random bytes
      {
        Bytes ins(1 + Below(8));
        for (uint8_t& c : ins) c = static_cast<uint8_t>(rng_());
        b.insert(b.begin() + pos, ins.begin(), ins.end());
        break;
      }
      case 1:  // insert a dictionary token
        if (!dict_.empty()) {
          const Bytes& t = dict_[Below(dict_.size())];
          b.insert(b.begin() + pos, t.begin(), t.end());
        }
        break;
      case 2:  // splice: this input's head, another seed's tail
      {
        const Bytes& other = (*corpus_)[Below(corpus_->size())];
        const size_t from = Below(other.size() + 1);
        b.resize(pos);
        b.insert(b.end(), other.begin() + from, other.end());
        break;
      }
      case 3:  // flip a bit
        b[Below(b.size())] ^= static_cast<uint8_t>(1u << Below(8));
        break;
      case 4:  // a random byte
        b[Below(b.size())] = static_cast<uint8_t>(rng_());
        break;
      case 5:  // nudge a byte
        b[Below(b.size())] += Below(2) == 0 ? 1 : 0xff;
        break;
      case 6:  // an interesting little-endian integer of 1, 2, 4 or 8 bytes
      {
        const size_t width = size_t{1} << Below(4);
        const uint64_t v = kInteresting[Below(std::size(kInteresting))];
        const size_t at = Below(b.size());
        for (size_t i = 0; i < width && at + i < b.size(); ++i) {
          b[at + i] = static_cast<uint8_t>(v >> (8 * i));
        }
        break;
      }
      case 7:  // erase a range
      {
        const size_t at = Below(b.size());
        const size_t len = 1 + Below(std::min<size_t>(b.size() - at, 16));
        b.erase(b.begin() + at, b.begin() + at + len);
        break;
      }
      case 8:  // duplicate a range elsewhere
      {
        const size_t at = Below(b.size());
        const size_t len = 1 + Below(std::min<size_t>(b.size() - at, 32));
        const Bytes piece(b.begin() + at, b.begin() + at + len);
        b.insert(b.begin() + Below(b.size() + 1), piece.begin(), piece.end());
        break;
      }
      default:  // overwrite with a dictionary token
        if (!dict_.empty()) {
          const Bytes& t = dict_[Below(dict_.size())];
          const size_t at = Below(b.size());
          for (size_t i = 0; i < t.size() && at + i < b.size(); ++i) b[at + i] = t[i];
        }
        break;
    }
  }

  std::mt19937_64 rng_;
  const std::vector<Bytes>* corpus_;
  std::vector<Bytes> dict_;
  size_t max_len_;
};

// TEST with the suite name expanded first: each target's binary has its own suite
// (WPUB_FUZZ_SUITE, e.g. FuzzPublish), so ctest names the target in every test name.
#define FUZZ_TEST(suite, name) TEST(suite, name)

// The input being run, for the crash handler (a test binary runs one input at a time).
const Bytes* current_input = nullptr;
char reproducer_path[256];
constexpr int kCrashSignals[] = {SIGABRT, SIGSEGV, SIGBUS, SIGFPE, SIGILL};
struct sigaction previous_actions[std::size(kCrashSignals)];

// On a crash signal, writes the current input to reproducer_path (open/write/close are
// async-signal-safe), then hands the signal to the handler installed before (a sanitizer's
// report, or the default: death by that signal).
void WriteReproducer(int sig) {
  if (current_input != nullptr) {
    const int fd = ::open(reproducer_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd >= 0) {
      ssize_t ignored = ::write(fd, current_input->data(), current_input->size());
      (void)ignored;
      ::close(fd);
    }
    static const char kMsg[] = "fuzz driver: crashing input written to ";
    ssize_t ignored = ::write(2, kMsg, sizeof(kMsg) - 1);
    ignored = ::write(2, reproducer_path, std::strlen(reproducer_path));
    ignored = ::write(2, "\n", 1);
    (void)ignored;
  }
  for (size_t i = 0; i < std::size(kCrashSignals); ++i) {
    if (kCrashSignals[i] == sig) sigaction(sig, &previous_actions[i], nullptr);
  }
  std::raise(sig);
}

void InstallCrashHandler(const char* test) {
  std::snprintf(reproducer_path, sizeof(reproducer_path), "fuzz-%s-%s-crash", WPUB_FUZZ_TARGET,
                test);
  static bool installed = false;  // once: the saved actions must be the ones from before
  if (installed) return;
  installed = true;
  struct sigaction action {};
  action.sa_handler = WriteReproducer;
  sigemptyset(&action.sa_mask);
  for (size_t i = 0; i < std::size(kCrashSignals); ++i) {
    sigaction(kCrashSignals[i], &action, &previous_actions[i]);
  }
}

void RunInput(const Bytes& input) {
  current_input = &input;
  LLVMFuzzerTestOneInput(input.data(), input.size());
  current_input = nullptr;
}

FUZZ_TEST(WPUB_FUZZ_SUITE, SeedCorpus) {
  const std::vector<Bytes> corpus = ReadCorpus(WPUB_FUZZ_CORPUS);
  ASSERT_FALSE(corpus.empty()) << "no seeds in " << WPUB_FUZZ_CORPUS;
  InstallCrashHandler("seed");
  for (const Bytes& seed : corpus) RunInput(seed);
  std::printf("%s: %zu seeds ran\n", WPUB_FUZZ_TARGET, corpus.size());
}

FUZZ_TEST(WPUB_FUZZ_SUITE, RandomMutations) {
  const std::vector<Bytes> corpus = ReadCorpus(WPUB_FUZZ_CORPUS);
  ASSERT_FALSE(corpus.empty()) << "no seeds in " << WPUB_FUZZ_CORPUS;
  const uint64_t iterations = EnvOr("WPUB_FUZZ_ITERATIONS", WPUB_FUZZ_ITERATIONS);
  Mutator mutator(EnvOr("WPUB_FUZZ_SEED", 1), &corpus, ReadDict(WPUB_FUZZ_DICT), WPUB_FUZZ_MAX_LEN);
  InstallCrashHandler("mutation");
  for (uint64_t i = 0; i < iterations; ++i) {
    const Bytes input = mutator.Next();
    RunInput(input);
  }
  std::printf("%s: %llu mutated inputs ran\n", WPUB_FUZZ_TARGET,
              static_cast<unsigned long long>(iterations));
}

// Replays the files named by WPUB_FUZZ_REPLAY (a file or a folder), e.g. a reproducer from
// tests/fuzz/crashes/<target>/, in a build without libFuzzer. Skipped when it is unset.
FUZZ_TEST(WPUB_FUZZ_SUITE, Replay) {
  const char* what = std::getenv("WPUB_FUZZ_REPLAY");
  if (what == nullptr || *what == '\0') GTEST_SKIP() << "WPUB_FUZZ_REPLAY is not set";
  const std::vector<Bytes> inputs =
      fs::is_directory(what) ? ReadCorpus(what) : std::vector<Bytes>{ReadFile(what)};
  InstallCrashHandler("replay");
  for (const Bytes& input : inputs) RunInput(input);
  std::printf("%s: %zu inputs replayed\n", WPUB_FUZZ_TARGET, inputs.size());
}

}  // namespace
