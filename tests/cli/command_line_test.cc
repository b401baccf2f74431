// cli::Parse and cli::Help over flags defined here, and the JSON-lines log formatter.
#include "cli/command_line.h"

#include <grpc/support/log.h>
#include <gtest/gtest.h>
#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>

#include <cstdio>
#include <fstream>
#include <sstream>

#include "absl/flags/flag.h"
#include "absl/time/time.h"
#include "cli/build_info.h"
#include "cli/bytes.h"
#include "cli/logging.h"
#include "core/common/log_context.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, cli_test_name, "n0", "A name.");
ABSL_FLAG(int64_t, cli_test_count, 3, "A count.");
ABSL_FLAG(bool, cli_test_fast, false, "Go fast.");
ABSL_FLAG(absl::Duration, cli_test_wait, absl::Seconds(5), "How long to wait.");
ABSL_FLAG(std::string, cli_test_other, "", "A flag of another command.");
ABSL_FLAG(wpub::cli::Bytes, cli_test_size, uint64_t{256} << 20, "A size.");

namespace wpub::cli {
namespace {

// Parse with its output captured.
struct Outcome {
  Parsed parsed;
  std::string out, err;
};

std::string Slurp(std::FILE* f) {
  std::rewind(f);
  std::string s;
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof(buf), f)) > 0;) s.append(buf, n);
  std::fclose(f);
  return s;
}

Command Cmd(int max_positional = 0, int min_positional = 0) {
  Command c;
  c.program = "tool";
  c.name = "tool sub";
  c.summary = "Does a thing.";
  c.flags = {"cli_test_name", "cli_test_count", "cli_test_fast", "cli_test_wait"};
  c.max_positional = max_positional;
  c.min_positional = min_positional;
  c.positional = "FILE";
  return c;
}

Outcome Do(const std::vector<std::string>& args, int max_positional = 0, int min_positional = 0) {
  absl::SetFlag(&FLAGS_cli_test_name, "n0");
  absl::SetFlag(&FLAGS_cli_test_count, 3);
  absl::SetFlag(&FLAGS_cli_test_fast, false);
  absl::SetFlag(&FLAGS_cli_test_wait, absl::Seconds(5));
  std::FILE* out = std::tmpfile();
  std::FILE* err = std::tmpfile();
  Outcome r;
  r.parsed = Parse(Cmd(max_positional, min_positional), args, out, err);
  r.out = Slurp(out);
  r.err = Slurp(err);
  return r;
}

TEST(CommandLine, SetsTheCommandsFlagsInEveryForm) {
  Outcome r = Do(
      {"--cli_test_name=a", "--cli-test-count", "7", "--cli_test_fast", "--cli_test_wait=250ms"});
  EXPECT_EQ(r.parsed.exit_code, -1) << r.err;
  EXPECT_EQ(absl::GetFlag(FLAGS_cli_test_name), "a");
  EXPECT_EQ(absl::GetFlag(FLAGS_cli_test_count), 7);
  EXPECT_TRUE(absl::GetFlag(FLAGS_cli_test_fast));
  EXPECT_EQ(absl::GetFlag(FLAGS_cli_test_wait), absl::Milliseconds(250));
  r = Do({"--cli_test_fast", "--nocli_test_fast", "-cli_test_name=b"});
  EXPECT_EQ(r.parsed.exit_code, -1) << r.err;
  EXPECT_FALSE(absl::GetFlag(FLAGS_cli_test_fast));
  EXPECT_EQ(absl::GetFlag(FLAGS_cli_test_name), "b");
  r = Do({"x.bin", "--", "--not-a-flag"}, /*max_positional=*/-1);
  EXPECT_EQ(r.parsed.exit_code, -1) << r.err;
  EXPECT_EQ(r.parsed.positional, (std::vector<std::string>{"x.bin", "--not-a-flag"}));
}

TEST(CommandLine, HelpListsOnlyTheCommandsFlagsAndExitsZero) {
  for (const char* h : {"--help", "-h", "--helpfull"}) {
    Outcome r = Do({"--cli_test_count=2", h});
    EXPECT_EQ(r.parsed.exit_code, 0) << h;
    EXPECT_NE(r.out.find("Usage: tool sub [flags]"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("Does a thing."), std::string::npos);
    EXPECT_NE(r.out.find("--cli_test_wait=DURATION  (default: 5s)"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("How long to wait."), std::string::npos);
    EXPECT_EQ(r.out.find("cli_test_other"), std::string::npos) << "a foreign flag is listed";
    EXPECT_EQ(r.out.find(".cc"), std::string::npos) << "source paths in the help";
    EXPECT_TRUE(r.err.empty());
  }
}

// Environment variables set flags the command line leaves alone, as the Python client reads
// WPUB_TARGET and WPUB_TOKEN_FILE; the command line wins, an empty variable is unset, a value
// the flag cannot parse names the variable, a flag the command does not take is never set.
TEST(CommandLine, TheEnvironmentSetsFlagsTheCommandLineDoesNot) {
  Command c = Cmd();
  c.environment = {{"WPUB_CLI_TEST_NAME", "cli_test_name"},
                   {"WPUB_CLI_TEST_WAIT", "cli_test_wait"},
                   {"WPUB_CLI_TEST_OTHER", "cli_test_other"}};
  auto run = [&](const std::vector<std::string>& args) {
    absl::SetFlag(&FLAGS_cli_test_name, "n0");
    absl::SetFlag(&FLAGS_cli_test_wait, absl::Seconds(5));
    absl::SetFlag(&FLAGS_cli_test_other, "");
    std::FILE* out = std::tmpfile();
    std::FILE* err = std::tmpfile();
    Outcome r;
    r.parsed = Parse(c, args, out, err);
    r.out = Slurp(out);
    r.err = Slurp(err);
    return r;
  };
  ::setenv("WPUB_CLI_TEST_NAME", "from-env", 1);
  ::setenv("WPUB_CLI_TEST_WAIT", "", 1);
  ::setenv("WPUB_CLI_TEST_OTHER", "foreign", 1);
  Outcome r = run({});
  EXPECT_EQ(r.parsed.exit_code, -1) << r.err;
  EXPECT_EQ(absl::GetFlag(FLAGS_cli_test_name), "from-env");
  EXPECT_EQ(absl::GetFlag(FLAGS_cli_test_wait), absl::Seconds(5)) << "an empty variable is unset";
  EXPECT_EQ(absl::GetFlag(FLAGS_cli_test_other), "") << "not a flag of this command";
  r = run({"--cli_test_name=from-args"});
  EXPECT_EQ(r.parsed.exit_code, -1) << r.err;
  EXPECT_EQ(absl::GetFlag(FLAGS_cli_test_name), "from-args");
  ::setenv("WPUB_CLI_TEST_WAIT", "5", 1);
  r = run({});
  EXPECT_EQ(r.parsed.exit_code, 2);
  EXPECT_NE(r.err.find("$WPUB_CLI_TEST_WAIT=5 (for --cli_test_wait)"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("unit"), std::string::npos) << "the duration hint: " << r.err;
  r = run({"--help"});
  EXPECT_NE(r.out.find("--cli_test_name=STRING  (default: n0; or $WPUB_CLI_TEST_NAME)"),
            std::string::npos)
      << r.out;
  ::unsetenv("WPUB_CLI_TEST_NAME");
  ::unsetenv("WPUB_CLI_TEST_WAIT");
  ::unsetenv("WPUB_CLI_TEST_OTHER");
  // The clients' variables are the Python client's.
  const auto env = ClientEnvironment();
  EXPECT_EQ(env.front(), (std::pair<std::string, std::string>{"WPUB_TARGET", "target"}));
  EXPECT_EQ(env[1], (std::pair<std::string, std::string>{"WPUB_TOKEN_FILE", "auth_token_file"}));
}

TEST(Bytes, UnitsOrPlainBytesAndNothingAmbiguous) {
  const std::pair<const char*, uint64_t> good[] = {
      {"0", 0},
      {"1048576", 1048576},
      {"64KiB", 64 << 10},
      {"256MiB", uint64_t{256} << 20},
      {"256 MiB", uint64_t{256} << 20},
      {"1.5GiB", uint64_t{3} << 29},
      {"2TiB", uint64_t{2} << 40},
      {"4MB", 4000000},
      {"1kB", 1000},
      {"1KB", 1000},
      {"7B", 7},
      {"18446744073709551615", UINT64_MAX},
  };
  for (const auto& [text, want] : good) {
    Bytes b;
    std::string error;
    EXPECT_TRUE(AbslParseFlag(text, &b, &error)) << text << ": " << error;
    EXPECT_EQ(b.value, want) << text;
  }
  for (const char* bad : {"", "64M", "1 gigabyte", "-1", "0.3B", "1.2.3MiB", "MiB", "16EiB",
                          "18446744073709551616", "17179869184GiB", "1e3"}) {
    Bytes b;
    std::string error;
    EXPECT_FALSE(AbslParseFlag(bad, &b, &error)) << bad;
    EXPECT_FALSE(error.empty()) << bad;
  }
  EXPECT_EQ(AbslUnparseFlag(Bytes(uint64_t{256} << 20)), "256MiB");
  EXPECT_EQ(AbslUnparseFlag(Bytes(uint64_t{64} << 30)), "64GiB");
  EXPECT_EQ(AbslUnparseFlag(Bytes(1000)), "1000");
  EXPECT_EQ(AbslUnparseFlag(Bytes(0)), "0");
  // Through the command line: the flag's kind, its default in units, and a refusal naming it.
  Command c = Cmd();
  c.flags.push_back("cli_test_size");
  std::FILE* out = std::tmpfile();
  std::FILE* err = std::tmpfile();
  Parsed p = Parse(c, {"--cli_test_size=64MiB"}, out, err);
  (void)Slurp(out);
  EXPECT_EQ(p.exit_code, -1) << Slurp(err);
  EXPECT_EQ(absl::GetFlag(FLAGS_cli_test_size).value, uint64_t{64} << 20);
  out = std::tmpfile();
  err = std::tmpfile();
  p = Parse(c, {"--cli_test_size=64M"}, out, err);
  (void)Slurp(out);
  const std::string e = Slurp(err);
  EXPECT_EQ(p.exit_code, 2);
  EXPECT_NE(e.find("--cli_test_size=64M"), std::string::npos) << e;
  EXPECT_NE(e.find("MiB"), std::string::npos) << e;
  out = std::tmpfile();
  err = std::tmpfile();
  p = Parse(c, {"--help"}, out, err);
  const std::string help = Slurp(out);
  (void)Slurp(err);
  EXPECT_NE(help.find("--cli_test_size=BYTES  (default: 256MiB)"), std::string::npos) << help;
}

// A hidden flag (a test's fault injection) is taken but --help does not list it.
TEST(CommandLine, HiddenFlagsAreTakenButNotListed) {
  Command c = Cmd();
  c.flags.push_back("cli_test_other");
  c.hidden = {"cli_test_other"};
  std::FILE* out = std::tmpfile();
  std::FILE* err = std::tmpfile();
  Parsed p = Parse(c, {"--cli_test_other=x"}, out, err);
  (void)Slurp(out);
  EXPECT_EQ(p.exit_code, -1) << Slurp(err);
  EXPECT_EQ(absl::GetFlag(FLAGS_cli_test_other), "x");
  out = std::tmpfile();
  err = std::tmpfile();
  p = Parse(c, {"--help"}, out, err);
  const std::string help = Slurp(out);
  (void)Slurp(err);
  EXPECT_EQ(p.exit_code, 0);
  EXPECT_EQ(help.find("cli_test_other"), std::string::npos) << help;
  EXPECT_NE(help.find("cli_test_name"), std::string::npos) << help;
  absl::SetFlag(&FLAGS_cli_test_other, "");
}

TEST(CommandLine, VersionNamesTheBuild) {
  Outcome r = Do({"--version"});
  EXPECT_EQ(r.parsed.exit_code, 0);
  EXPECT_EQ(r.out, VersionLine("tool") + "\n");
  EXPECT_NE(r.out.find("tool " + Build().version + " (CUDA "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("gRPC 1."), std::string::npos) << r.out;
  EXPECT_FALSE(Build().version.empty());
}

TEST(CommandLine, RefusesWhatTheCommandDoesNotTakeNamingIt) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--cli_test_other=x"}, "--cli_test_other is not a flag of this command"},
      {{"--no_such_flag"}, "--no_such_flag is not a flag"},
      {{"stray"}, "unexpected argument 'stray' (this command takes none)"},
      {{"--cli_test_wait=60"}, "a duration needs a unit"},
      {{"--cli_test_count=many"}, "--cli_test_count=many"},
      {{"--cli_test_name"}, "--cli_test_name needs a value"},
      {{"--nocli_test_count"}, "--nocli_test_count is not a flag"},
      {{"--flagfile=/nonexistent/flags"}, "cannot be read"},
  };
  for (const auto& [args, want] : cases) {
    Outcome r = Do(args);
    EXPECT_EQ(r.parsed.exit_code, 2) << want;
    EXPECT_NE(r.err.find(want), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("`tool sub --help` lists its flags"), std::string::npos) << r.err;
  }
  Outcome two = Do({"a", "b"}, /*max_positional=*/1);
  EXPECT_EQ(two.parsed.exit_code, 2);
  EXPECT_NE(two.err.find("unexpected argument 'b'"), std::string::npos) << two.err;
  Outcome none = Do({"--cli_test_fast"}, /*max_positional=*/1, /*min_positional=*/1);
  EXPECT_EQ(none.parsed.exit_code, 2);
  EXPECT_NE(none.err.find("expects FILE (Usage: tool sub [flags] FILE)"), std::string::npos)
      << none.err;
  Outcome one = Do({"a"}, /*max_positional=*/1, /*min_positional=*/1);
  EXPECT_EQ(one.parsed.exit_code, -1) << one.err;
  EXPECT_EQ(one.parsed.positional, std::vector<std::string>{"a"});
}

TEST(CommandLine, AFlagFileIsReadAsArguments) {
  const std::string path = ::testing::TempDir() + "/cli_flags";
  {
    std::ofstream f(path);
    f << "# a comment\n\n--cli_test_name=from-file\n  --cli_test_count=11  \n";
  }
  Outcome r = Do({"--flagfile=" + path, "--cli_test_count=12"});
  EXPECT_EQ(r.parsed.exit_code, -1) << r.err;
  EXPECT_EQ(absl::GetFlag(FLAGS_cli_test_name), "from-file");
  EXPECT_EQ(absl::GetFlag(FLAGS_cli_test_count), 12);  // later arguments win
  {
    std::ofstream f(path);
    f << "--cli_test_other=1\n";
  }
  r = Do({"--flagfile", path});
  EXPECT_EQ(r.parsed.exit_code, 2);
  EXPECT_NE(r.err.find("--cli_test_other is not a flag of this command"), std::string::npos);
}

TEST(CommandLine, FlagsDefinedInFindsThisFilesFlags) {
  const std::vector<std::string> names = FlagsDefinedIn("tests/cli/command_line_test");
  EXPECT_EQ(names, (std::vector<std::string>{"cli_test_count", "cli_test_fast", "cli_test_name",
                                             "cli_test_other", "cli_test_size", "cli_test_wait"}));
}

TEST(Logging, JsonLinesCarryTheThreadsFieldsAndEscape) {
  std::ostringstream sink_out;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(sink_out);
  sink->set_formatter(JsonFormatter("wpubd"));
  spdlog::logger logger("t", sink);
  {
    LogField version("version", "12");
    LogField phase("phase", "ingest");
    {
      LogField inner("phase", "transfer");
      logger.info("bucket \"3\"\nsent \xff");
    }
    logger.warn("aborted");
  }
  logger.info("plain");
  std::istringstream lines(sink_out.str());
  std::vector<nlohmann::json> j;
  for (std::string line; std::getline(lines, line);) j.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(j.size(), 3u) << sink_out.str();
  EXPECT_EQ(j[0]["msg"], "bucket \"3\"\nsent \xEF\xBF\xBD");
  EXPECT_EQ(j[0]["level"], "info");
  EXPECT_EQ(j[0]["logger"], "wpubd");
  EXPECT_EQ(j[0]["version"], "12");
  EXPECT_EQ(j[0]["phase"], "transfer");  // the innermost scope's value
  EXPECT_EQ(j[1]["phase"], "ingest");
  EXPECT_EQ(j[1]["level"], "warning");
  EXPECT_FALSE(j[2].contains("version"));
  // RFC 3339 with an offset, microseconds.
  const std::string ts = j[0]["ts"];
  EXPECT_EQ(ts.size(), std::string("2026-12-02T10:00:01.123456+00:00").size()) << ts;
  EXPECT_EQ(ts.substr(ts.size() - 6), "+00:00") << ts;
  absl::Time t;
  std::string why;
  EXPECT_TRUE(absl::ParseTime(absl::RFC3339_full, ts, &t, &why)) << ts << ": " << why;
  EXPECT_LT(absl::AbsDuration(absl::Now() - t), absl::Minutes(5));
}

// gRPC's own lines (gpr_log) come out in the binary's format: a JSON line with source=grpc and
// gRPC's location, at the matching level -- not gRPC's "E1204 ..." line on stderr.
TEST(Logging, GrpcLinesGoThroughTheSameLogger) {
  ASSERT_TRUE(ConfigureLogging("wpubd", "info", "json").ok());
  std::ostringstream sink_out;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(sink_out);
  sink->set_formatter(JsonFormatter("wpubd"));
  const std::shared_ptr<spdlog::logger> previous = spdlog::default_logger();
  spdlog::set_default_logger(std::make_shared<spdlog::logger>("t", sink));
  gpr_set_log_verbosity(GPR_LOG_SEVERITY_INFO);  // gRPC's default drops its info lines
  gpr_log("src/core/lib/iomgr/tcp_server.cc", 42, GPR_LOG_SEVERITY_ERROR, "bind failed: %s",
          "Address already in use");
  gpr_log("x.cc", 1, GPR_LOG_SEVERITY_INFO, "%s", "informational");
  gpr_set_log_verbosity(GPR_LOG_SEVERITY_ERROR);
  spdlog::set_default_logger(previous);
  std::istringstream lines(sink_out.str());
  std::vector<nlohmann::json> j;
  for (std::string line; std::getline(lines, line);) j.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(j.size(), 2u) << sink_out.str();
  EXPECT_EQ(j[0]["msg"], "grpc: bind failed: Address already in use");
  EXPECT_EQ(j[0]["level"], "error");
  EXPECT_EQ(j[0]["source"], "grpc");
  EXPECT_EQ(j[0]["grpc_location"], "src/core/lib/iomgr/tcp_server.cc:42");
  EXPECT_EQ(j[1]["level"], "info");
  ASSERT_TRUE(ConfigureLogging("wpubd", "info", "text").ok());
}

TEST(Logging, RefusesUnknownLevelsAndFormats) {
  EXPECT_TRUE(absl::IsInvalidArgument(ConfigureLogging("x", "loud", "text")));
  absl::Status s = ConfigureLogging("x", "info", "xml");
  EXPECT_TRUE(absl::IsInvalidArgument(s));
  EXPECT_NE(s.message().find("not text or json"), std::string::npos);
  EXPECT_TRUE(ConfigureLogging("x", "warn", "json").ok());
  EXPECT_TRUE(ConfigureLogging("x", "info", "text").ok());
}

}  // namespace
}  // namespace wpub::cli
