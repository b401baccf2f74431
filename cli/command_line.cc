// Parse and Help over absl's flag reflection (absl::FindCommandLineFlag, ParseFrom).
#include "cli/command_line.h"

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <set>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "cli/build_info.h"
#include "cli/bytes.h"

namespace wpub::cli {
namespace {

constexpr size_t kWidth = 78;

std::string Kind(const absl::CommandLineFlag& f) {
  if (f.IsOfType<bool>()) return "";
  if (f.IsOfType<absl::Duration>()) return "=DURATION";
  if (f.IsOfType<Bytes>()) return "=BYTES";
  if (f.IsOfType<std::string>()) return "=STRING";
  if (f.IsOfType<std::vector<std::string>>()) return "=A,B,...";
  if (f.IsOfType<double>() || f.IsOfType<float>()) return "=NUMBER";
  return "=N";
}

// `text` wrapped at kWidth, each line indented by `indent`.
std::string Wrap(const std::string& text, size_t indent) {
  std::string out, line;
  for (absl::string_view word : absl::StrSplit(text, ' ', absl::SkipWhitespace())) {
    if (!line.empty() && indent + line.size() + 1 + word.size() > kWidth) {
      absl::StrAppend(&out, std::string(indent, ' '), line, "\n");
      line.clear();
    }
    absl::StrAppend(&line, line.empty() ? "" : " ", word);
  }
  if (!line.empty()) absl::StrAppend(&out, std::string(indent, ' '), line, "\n");
  return out;
}

std::string UsageLine(const Command& c) {
  std::string line = absl::StrCat("Usage: ", c.name, " [flags]");
  if (c.max_positional != 0) absl::StrAppend(&line, " ", c.positional);
  return line;
}

std::string Hint(const absl::CommandLineFlag& f) {
  if (f.IsOfType<absl::Duration>()) {
    return " (a duration needs a unit: 500ms, 30s, 5m, 1h30m)";
  }
  if (f.IsOfType<bool>()) return " (true or false)";
  return "";
}

// The arguments with --flagfile expanded (one level; a flag file may not name another).
bool Expand(const std::vector<std::string>& args, std::vector<std::string>* out, std::string* why) {
  for (size_t i = 0; i < args.size(); ++i) {
    std::string path;
    if (absl::StartsWith(args[i], "--flagfile=")) {
      path = args[i].substr(std::string("--flagfile=").size());
    } else if (args[i] == "--flagfile" && i + 1 < args.size()) {
      path = args[++i];
    } else {
      out->push_back(args[i]);
      if (args[i] == "--") {
        out->insert(out->end(), args.begin() + static_cast<std::ptrdiff_t>(i) + 1, args.end());
        return true;
      }
      continue;
    }
    std::ifstream in(path);
    if (!in) {
      *why = absl::StrCat("flag file '", path, "' cannot be read");
      return false;
    }
    for (std::string line; std::getline(in, line);) {
      const std::string l(absl::StripAsciiWhitespace(line));
      if (l.empty() || l[0] == '#') continue;
      if (absl::StartsWith(l, "--flagfile")) {
        *why = absl::StrCat("flag file '", path, "' names another flag file");
        return false;
      }
      out->push_back(l);
    }
  }
  return true;
}

}  // namespace

std::vector<std::string> FlagsDefinedIn(const std::string& fragment) {
  std::vector<std::string> names;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (absl::StrContains(flag->Filename(), fragment)) names.emplace_back(name);
  }
  std::sort(names.begin(), names.end());
  return names;
}

std::string Help(const Command& c) {
  std::string out = absl::StrCat(UsageLine(c), "\n\n");
  for (absl::string_view para : absl::StrSplit(c.summary, '\n')) {
    absl::StrAppend(&out, Wrap(std::string(para), 0));
  }
  absl::StrAppend(&out, "\nFlags:\n");
  std::vector<std::string> names;
  for (const std::string& name : c.flags) {
    if (std::find(c.hidden.begin(), c.hidden.end(), name) == c.hidden.end()) names.push_back(name);
  }
  std::sort(names.begin(), names.end());
  for (const std::string& name : names) {
    const absl::CommandLineFlag* f = absl::FindCommandLineFlag(name);
    if (f == nullptr) {
      absl::StrAppend(&out, "  --", name, "  (undefined: a defect of this build)\n");
      continue;
    }
    std::string head = absl::StrCat("  --", name, Kind(*f));
    const std::string def = f->DefaultValue();
    absl::StrAppend(&head, "  (default: ", def.empty() ? "\"\"" : def);
    for (const auto& [var, flag] : c.environment) {
      if (flag == name) absl::StrAppend(&head, "; or $", var);
    }
    absl::StrAppend(&head, ")");
    absl::StrAppend(&out, head, "\n", Wrap(f->Help(), 6));
  }
  absl::StrAppend(&out, "  --flagfile=FILE\n", Wrap("Read more flags from FILE, one per line.", 6),
                  "  --help, --version\n",
                  Wrap("Print this text, or the build's version, and exit.", 6));
  return out;
}

Parsed Parse(const Command& c, const std::vector<std::string>& raw, std::FILE* out,
             std::FILE* err) {
  Parsed p;
  auto fail = [&](const std::string& why) {
    std::fprintf(err, "%s: %s\n%s; `%s --help` lists its flags.\n", c.name.c_str(), why.c_str(),
                 UsageLine(c).c_str(), c.name.c_str());
    p.exit_code = 2;
    return p;
  };
  std::vector<std::string> args;
  if (std::string why; !Expand(raw, &args, &why)) return fail(why);
  const std::set<std::string> allowed(c.flags.begin(), c.flags.end());
  for (const std::string& a : args) {
    if (a == "--help" || a == "-h" || a == "--helpfull" || a == "--helpshort") {
      std::fputs(Help(c).c_str(), out);
      p.exit_code = 0;
      return p;
    }
    if (a == "--") break;
  }
  // The environment before the arguments, so that the command line overrides it (after --help,
  // which works whatever the environment holds).
  for (const auto& [var, flag] : c.environment) {
    const char* v = std::getenv(var.c_str());
    absl::CommandLineFlag* f = allowed.count(flag) ? absl::FindCommandLineFlag(flag) : nullptr;
    if (v == nullptr || *v == '\0' || f == nullptr) continue;
    if (std::string error; !f->ParseFrom(v, &error)) {
      return fail(absl::StrCat("$", var, "=", v, " (for --", flag, "): ", error, Hint(*f)));
    }
  }
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--") {
      p.positional.insert(p.positional.end(), args.begin() + static_cast<std::ptrdiff_t>(i) + 1,
                          args.end());
      break;
    }
    if (a == "--version") {
      std::fprintf(out, "%s\n", VersionLine(c.program).c_str());
      p.exit_code = 0;
      return p;
    }
    if (a.size() < 2 || a[0] != '-' || a == "-") {
      p.positional.push_back(a);
      continue;
    }
    const size_t dashes = a[1] == '-' ? 2 : 1;
    const size_t eq = a.find('=');
    std::string name = a.substr(dashes, eq == std::string::npos ? std::string::npos : eq - dashes);
    std::replace(name.begin(), name.end(), '-', '_');
    std::optional<std::string> value;
    if (eq != std::string::npos) value = a.substr(eq + 1);
    absl::CommandLineFlag* f = allowed.count(name) ? absl::FindCommandLineFlag(name) : nullptr;
    if (f == nullptr && absl::StartsWith(name, "no") && allowed.count(name.substr(2)) &&
        !value.has_value()) {
      absl::CommandLineFlag* b = absl::FindCommandLineFlag(name.substr(2));
      if (b != nullptr && b->IsOfType<bool>()) {
        f = b;
        name = name.substr(2);
        value = "false";
      }
    }
    if (f == nullptr) {
      const bool elsewhere = absl::FindCommandLineFlag(name) != nullptr;
      return fail(absl::StrCat("--", name,
                               elsewhere ? " is not a flag of this command" : " is not a flag"));
    }
    if (!value.has_value()) {
      if (f->IsOfType<bool>()) {
        value = "true";
      } else if (i + 1 < args.size()) {
        value = args[++i];
      } else {
        return fail(absl::StrCat("--", name, " needs a value"));
      }
    }
    std::string error;
    if (!f->ParseFrom(*value, &error)) {
      return fail(absl::StrCat("--", name, "=", *value, ": ", error, Hint(*f)));
    }
  }
  if (c.max_positional >= 0 && p.positional.size() > static_cast<size_t>(c.max_positional)) {
    return fail(absl::StrCat("unexpected argument '",
                             p.positional[static_cast<size_t>(c.max_positional)], "'",
                             c.max_positional == 0 ? " (this command takes none)" : ""));
  }
  if (p.positional.size() < static_cast<size_t>(c.min_positional)) {
    return fail(absl::StrCat("expects ", c.positional, " (", UsageLine(c), ")"));
  }
  return p;
}

std::vector<std::pair<std::string, std::string>> ClientEnvironment() {
  return {{"WPUB_TARGET", "target"},
          {"WPUB_TOKEN_FILE", "auth_token_file"},
          {"WPUB_TLS_CA_FILE", "tls_ca_file"},
          {"WPUB_TLS_CERT_FILE", "tls_cert_file"},
          {"WPUB_TLS_KEY_FILE", "tls_key_file"}};
}

}  // namespace wpub::cli
