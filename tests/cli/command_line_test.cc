// cli::Parse and cli::Help over flags defined here, and the JSON-lines log formatter.
#include "server/cli/command_line.h"

#include <gtest/gtest.h>
#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>

#include <cstdio>
#include <fstream>
#include <sstream>

#include "absl/flags/flag.h"
#include "absl/time/time.h"
#include "core/common/log_context.h"
#include "nlohmann/json.hpp"
#include "server/cli/build_info.h"
#include "server/cli/logging.h"

ABSL_FLAG(std::string, cli_test_name, "n0", "A name.");
ABSL_FLAG(int64_t, cli_test_count, 3, "A count.");
ABSL_FLAG(bool, cli_test_fast, false, "Go fast.");
ABSL_FLAG(absl::Duration, cli_test_wait, absl::Seconds(5), "How long to wait.");
ABSL_FLAG(std::string, cli_test_other, "", "A flag of another command.");

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
                                             "cli_test_other", "cli_test_wait"}));
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
