// LogField: a thread_local vector used as a stack.
#include "core/common/log_context.h"

namespace wpub {
namespace {

std::vector<std::pair<std::string, std::string>>& Fields() {
  thread_local std::vector<std::pair<std::string, std::string>> fields;
  return fields;
}

}  // namespace

LogField::LogField(absl::string_view key, std::string value) {
  Fields().emplace_back(std::string(key), std::move(value));
}

LogField::~LogField() { Fields().pop_back(); }

const std::vector<std::pair<std::string, std::string>>& CurrentLogFields() { return Fields(); }

}  // namespace wpub
