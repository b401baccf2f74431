// Engine lists and group layouts (engine_driver.h).
#include "core/rollout/engine_driver.h"

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace wpub::rollout {

absl::StatusOr<std::vector<EngineSpec>> ParseEngineSpecs(absl::string_view text) {
  std::vector<EngineSpec> out;
  for (absl::string_view entry : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    entry = absl::StripAsciiWhitespace(entry);
    EngineSpec e;
    const size_t eq = entry.rfind('=');
    e.url = std::string(entry.substr(0, eq));
    if (eq != absl::string_view::npos &&
        (!absl::SimpleAtoi(entry.substr(eq + 1), &e.gpus) || e.gpus <= 0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("engine '", entry, "': the GPU count after '=' must be a positive integer"));
    }
    if (e.url.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("engine '", entry, "' has no URL"));
    }
    absl::StatusOr<std::pair<std::string, std::string>> split = SplitEngineFamily(e.url);
    if (!split.ok()) return split.status();
    if (!split->first.empty()) e.family = split->first;
    e.url = split->second;
    out.push_back(std::move(e));
  }
  if (out.empty()) return absl::InvalidArgumentError("no engines given");
  return out;
}

absl::StatusOr<GroupLayout> LayoutGroup(const std::vector<EngineSpec>& engines,
                                        const std::string& group_name) {
  if (engines.empty()) return absl::InvalidArgumentError("ConnectEngines: no engine URLs");
  if (group_name.empty()) return absl::InvalidArgumentError("ConnectEngines: empty group name");
  GroupLayout g;
  g.group_name = group_name;
  int next = 1;
  for (size_t i = 0; i < engines.size(); ++i) {
    if (engines[i].url.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("ConnectEngines: engine ", i, " has no URL"));
    }
    if (engines[i].gpus <= 0) {
      return absl::InvalidArgumentError(absl::StrCat("ConnectEngines: engine ", engines[i].url,
                                                     " has ", engines[i].gpus, " GPUs"));
    }
    g.rank_offsets.push_back(next);
    next += engines[i].gpus;
  }
  g.world_size = next;
  return g;
}

transport::PauseWindow PauseWindowOf(const PauseTimes& t, absl::Time now) {
  transport::PauseWindow w;
  if (t.paused == absl::InfinitePast()) return w;
  w.paused = true;
  w.resumed = t.resumed >= t.paused;
  const absl::Time end = w.resumed ? t.resumed : std::max(now, t.paused);
  const auto seconds = [](absl::Time a, absl::Time b) { return absl::ToDoubleSeconds(b - a); };
  w.seconds = seconds(t.paused, end);
  // The marks in order, each clamped into the window (a bucket sent before the pause answered
  // -- its request queued behind the pause -- starts the transfer at the pause).
  const absl::Time first =
      t.first_update == absl::InfinitePast() ? end : std::clamp(t.first_update, t.paused, end);
  const absl::Time last =
      t.last_update == absl::InfinitePast() ? first : std::clamp(t.last_update, first, end);
  w.waiting = seconds(t.paused, first);
  w.transfer = seconds(first, last);
  w.finalization = seconds(last, end);
  return w;
}

}  // namespace wpub::rollout
