// Names of a flat int32 record's fields (a plan header, a descriptor), for
// the op adapters that hand them to Python: readers index the record by
// these names, so the layout is written once, in the enum that defines it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace hpc {

template <typename Field>
using FieldName = std::pair<Field, const char*>;

// True when `names` names fields 0..count-1, each once, in order: a field
// added to the enum without a name fails the static_assert at its table.
template <typename Field, size_t N>
constexpr bool names_every_field(const FieldName<Field> (&names)[N],
                                 int count) {
  if (N != static_cast<size_t>(count)) return false;
  for (size_t i = 0; i < N; ++i) {
    if (static_cast<int>(names[i].first) != static_cast<int>(i)) return false;
  }
  return true;
}

template <typename Field, size_t N>
std::vector<std::string> field_names(const FieldName<Field> (&names)[N]) {
  std::vector<std::string> out;
  out.reserve(N);
  for (const auto& field : names) out.emplace_back(field.second);
  return out;
}

// A list of named values computed together (a layout's offsets, a
// tiling): an adapter returns the values and a *_fields op the names, both
// from one function that lists the pairs, so their orders cannot drift.
using NamedValue = std::pair<const char*, int64_t>;

inline std::vector<int64_t> values_of(const std::vector<NamedValue>& entries) {
  std::vector<int64_t> out;
  out.reserve(entries.size());
  for (const auto& entry : entries) out.push_back(entry.second);
  return out;
}

inline std::vector<std::string> names_of(
    const std::vector<NamedValue>& entries) {
  std::vector<std::string> out;
  out.reserve(entries.size());
  for (const auto& entry : entries) out.emplace_back(entry.first);
  return out;
}

}  // namespace hpc
