// Flag parsing for one command -- a binary (wpubd, wpub-recv) or one wpubctl subcommand --
// against the flags it takes, instead of every flag linked into the binary. absl flags hold the
// values; this module decides what a command line may say and what --help prints.
//
//   --help, -h, --helpfull   print Help(command) to `out`; exit code 0
//   --version                print VersionLine(command.program); exit code 0
//   --name=value, --name value, --name / --noname (bools); dashes in names read as underscores
//   --flagfile=FILE          the file's lines as arguments (blank lines and # comments skipped)
//   --                       the rest is positional
// A flag this command does not take -- one of another subcommand, or none at all -- is an error
// naming it; so are more (or fewer) positional arguments than the command takes, a missing value,
// and a value its flag cannot parse (with a hint for durations: they need a unit). Errors go to
// `err` and give exit code 2. Thread-compatible: call from main before other threads start.
#pragma once

#include <cstdio>
#include <string>
#include <utility>
#include <vector>

namespace wpub::cli {

struct Command {
  std::string program;             // as --version names it: "wpubd", "wpubctl"
  std::string name;                // as usage lines name it: "wpubd", "wpubctl status"
  std::string summary;             // what it does (paragraphs, printed first by --help)
  std::vector<std::string> flags;  // the absl flags it takes (names without "--")
  int max_positional = 0;          // -1: any number
  int min_positional = 0;          // fewer is an error naming the usage line
  std::string positional;          // the usage line's argument part, e.g. "FILE [FILE]"
  // Environment variables that set a flag of this command when the command line does not:
  // (variable, flag name) pairs; an empty or unset variable is ignored, a flag this command
  // does not take is skipped, and a value the flag cannot parse is an error naming the
  // variable. --help lists each flag's variable.
  std::vector<std::pair<std::string, std::string>> environment;
  // Flags of `flags` that --help does not list: fault injection for tests, accepted as any
  // other flag but nothing an operator should find.
  std::vector<std::string> hidden;
};

// The variables every client of wpubd reads, as the Python client (wpub.Publisher.from_env) and
// the shipped manifests do: WPUB_TARGET, WPUB_TOKEN_FILE, WPUB_TLS_CA_FILE, WPUB_TLS_CERT_FILE,
// WPUB_TLS_KEY_FILE (flags target, auth_token_file, tls_ca_file, tls_cert_file, tls_key_file).
std::vector<std::pair<std::string, std::string>> ClientEnvironment();

struct Parsed {
  std::vector<std::string> positional;
  int exit_code = -1;  // >= 0: the command line was handled (help, version) or refused
};

// `args` excludes argv[0]. Every flag named in command.flags must be defined (an unknown name
// there is a programming error, reported as one).
Parsed Parse(const Command& command, const std::vector<std::string>& args, std::FILE* out = stdout,
             std::FILE* err = stderr);

// The names of the flags defined in source files whose path contains `fragment` (e.g.
// "server/wpubd/"): a binary's own flags, without those of the libraries it links.
std::vector<std::string> FlagsDefinedIn(const std::string& fragment);

// The command's usage line, summary, and its flags: name, value kind, default and help text.
std::string Help(const Command& command);

}  // namespace wpub::cli
