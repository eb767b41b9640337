// SPDX-License-Identifier: Apache-2.0
// The consensus step of every collective call: in ONE allreduce, each rank
// contributes (a) whether its own argument checks failed and (b) a
// fingerprint of what it is about to run (schedule, partition, mask and its
// parameters, value type, shapes, options, direction). Every rank then knows
// whether all agree; if not, a second collective (error path only) carries the
// failing rank's message, or every rank's readable value of the first field
// that differs, so that all ranks throw the SAME error naming what differs and
// on which ranks -- before any point-to-point transfer is posted, so that a
// mismatch never becomes a hang or a silently wrong result.
#pragma once

#include <blockattn/comm/communicator.hpp>
#include <blockattn/core/config.hpp>
#include <blockattn/core/errors.hpp>
#include <blockattn/policy/score.hpp>

#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <typeinfo>
#include <utility>
#include <vector>

namespace blockattn {
namespace impl {

/// A readable name of T on the host ("blockattn::" removed), the same on
/// every rank built by the same compiler.
template <class T>
std::string type_name() {
  std::string s;
#if defined(__clang__) || defined(__GNUC__)
  const std::string f = __PRETTY_FUNCTION__;  // "... [with T = X; ...]" / "... [T = X]"
  const auto b = f.find("T = ");
  if (b != std::string::npos) {
    std::size_t e = b + 4;
    int depth = 0;
    for (; e < f.size(); ++e) {
      const char c = f[e];
      if (depth == 0 && (c == ';' || c == ']')) break;
      if (c == '<' || c == '(') ++depth;
      if (c == '>' || c == ')') --depth;
    }
    s = f.substr(b + 4, e - b - 4);
  }
#endif
  if (s.empty()) s = typeid(T).name();
  for (std::size_t p; (p = s.find("blockattn::")) != std::string::npos;) s.erase(p, 11);
  return s;
}

/// FNV-1a: a stable 64-bit fingerprint of a string (the same on every rank).
inline std::int64_t fingerprint_of(const std::string& s) {
  std::uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return static_cast<std::int64_t>(h);
}

/// A double with all its digits.
inline std::string to_text(double x) {
  std::ostringstream s;
  s.precision(17);
  s << x;
  return s.str();
}

/// One entry of a rank's configuration: compared across ranks by `value`,
/// reported by `text` (this rank's readable value).
struct ConfigField {
  std::string what;
  std::int64_t value = 0;
  std::string text;
};

/// Builds the fingerprint of one collective call.
class Fingerprint {
 public:
  /// A number (shape, flag): compared and printed as is.
  Fingerprint& number(std::string what, std::int64_t v) {
    m_fields.push_back({std::move(what), v, std::to_string(v)});
    return *this;
  }
  /// A string (type name, description): compared by its fingerprint.
  Fingerprint& text(std::string what, std::string t) {
    const std::int64_t v = fingerprint_of(t);
    m_fields.push_back({std::move(what), v, std::move(t)});
    return *this;
  }
  /// A double, compared bitwise (all NaNs are one value).
  Fingerprint& real(std::string what, double x, std::string text) {
    std::int64_t v = 0x7ff8000000000000ll;
    if (x == x) std::memcpy(&v, &x, sizeof v);
    m_fields.push_back({std::move(what), v, std::move(text)});
    return *this;
  }
  const std::vector<ConfigField>& fields() const { return m_fields; }

 private:
  std::vector<ConfigField> m_fields;
};

/// The partition's values: its parameters() when it has them (a table
/// partition: N, P and a hash of the table), else "{}" (a stateless
/// partition: its type says it all). Always one field.
template <class Partition>
void add_partition(Fingerprint& f, const Partition& partition);

/// Mask parameters: an optional member `parameters()` returning a std::array
/// (or any range) of numbers lets ranks compare mask values, not only types.
template <class M, class = void>
struct has_mask_parameters : std::false_type {};
template <class M>
struct has_mask_parameters<M,
                           std::void_t<decltype(std::begin(std::declval<const M&>().parameters())),
                                       decltype(std::end(std::declval<const M&>().parameters()))>>
    : std::true_type {};

/// "Type{p0, p1, ...}": a mask's or a score policy's type and, when it has
/// parameters(), their values.
template <class X>
std::string value_text(const X& x) {
  std::ostringstream s;
  s.precision(17);
  s << type_name<X>() << "{";
  if constexpr (has_mask_parameters<X>::value) {
    bool first = true;
    for (const auto& v : x.parameters()) {
      s << (first ? "" : ", ") << v;
      first = false;
    }
  }
  s << "}";
  return s.str();
}
/// A mask with a score policy: "Mask{...} with Policy{...}", and the first
/// global head of the call's heads where a head-parallel schedule set it.
template <class M, class S>
std::string value_text(const ScoredMask<M, S>& x) {
  std::string s = value_text(x.mask) + " with " + value_text(x.score_policy);
  if (x.head_offset != 0) s += " from head " + std::to_string(x.head_offset);
  return s;
}

/// The mask's type and, when it has parameters(), its values. Always two
/// fields, so that every rank's fingerprint has the same length.
template <class Mask>
void add_mask(Fingerprint& f, const Mask& mask) {
  f.text("mask", type_name<Mask>());
  f.text("mask value", value_text(mask));
}

template <class Partition>
void add_partition(Fingerprint& f, const Partition& partition) {
  std::ostringstream s;
  s << Partition::name() << "{";
  if constexpr (has_mask_parameters<Partition>::value) {
    bool first = true;
    for (const auto& x : partition.parameters()) {
      s << (first ? "" : ", ") << x;
      first = false;
    }
  }
  s << "}";
  f.text("partition value", s.str());
}

/// Element-wise allreduce of a host array (comm/communicator.hpp allreduce_values).
template <class C>
void allreduce_array(C& comm, std::vector<std::int64_t>& buf, ReduceOp op) {
  std::vector<std::int64_t> out(buf.size());
  allreduce_values(comm, buf.data(), out.data(), static_cast<int>(buf.size()), op);
  buf.swap(out);
}

/// Every rank's `mine` (truncated to `width` bytes), in rank order: one sum
/// allreduce of P * width bytes. Error paths only.
template <class C>
std::vector<std::string> gather_text(C& comm, const std::string& mine, std::size_t width) {
  const int P = comm.size();
  const std::size_t words = (width + 7) / 8;
  std::vector<std::int64_t> buf(std::size_t(P) * words, 0);
  const std::size_t n = mine.size() < words * 8 - 1 ? mine.size() : words * 8 - 1;
  std::memcpy(reinterpret_cast<char*>(buf.data() + std::size_t(comm.rank()) * words), mine.data(),
              n);
  allreduce_array(comm, buf, ReduceOp::sum);
  std::vector<std::string> out(P);
  for (int r = 0; r < P; ++r) {
    const char* p = reinterpret_cast<const char*>(buf.data() + std::size_t(r) * words);
    std::size_t len = 0;
    while (len < words * 8 && p[len] != '\0') ++len;
    out[r] = std::string(p, len);
  }
  return out;
}

/// "0-2, 5, 7-8"
inline std::string rank_list(const std::vector<int>& ranks) {
  std::ostringstream s;
  for (std::size_t i = 0; i < ranks.size();) {
    std::size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    s << (i ? ", " : "") << ranks[i];
    if (j > i) s << "-" << ranks[j];
    i = j + 1;
  }
  return s.str();
}

/// The consensus step. `error` is this rank's own argument error (empty when
/// its checks passed). Returns when every rank passed its checks and all
/// fingerprints agree; otherwise every rank throws the same invalid_argument.
/// `relative` is an error that compares two of this rank's arguments (o's
/// shape against q's): reported only when the fingerprints agree, because
/// where they differ, the argument that differs from the other ranks' is the
/// wrong one (q with the wrong rows on one rank is named as q, not as the o
/// that matches the other ranks). With `every_rank`, the same collective also
/// gathers one number per rank (`mine`, e.g. the local length, which may
/// differ between ranks) into (*every_rank)[r] on every rank. Collectives:
/// one on success, two on an error.
template <class C>
void reach_consensus(C& comm, const char* fn, const std::string& error,
                     const Fingerprint& fingerprint, std::int64_t mine = 0,
                     std::vector<std::int64_t>* every_rank = nullptr,
                     const std::string& relative = std::string()) {
  const auto& f = fingerprint.fields();
  const int P = comm.size(), rank = comm.rank();
  const std::size_t K = f.size();
  // [first failing rank | first rank with a relative error | values |
  // bitwise-not values | one slot per rank]: min gives the first failing
  // ranks, the minimum and (negated) the maximum of every field, and every
  // rank's number (the others put the largest value).
  const std::size_t extra = every_rank ? std::size_t(P) : 0;
  std::vector<std::int64_t> buf(2 + 2 * K + extra, std::numeric_limits<std::int64_t>::max());
  buf[0] = error.empty() ? P : rank;
  buf[1] = relative.empty() ? P : rank;
  for (std::size_t i = 0; i < K; ++i) {
    buf[2 + i] = f[i].value;
    buf[2 + K + i] = ~f[i].value;
  }
  if (every_rank) buf[2 + 2 * K + std::size_t(rank)] = mine;
  allreduce_array(comm, buf, ReduceOp::min);
  if (every_rank) every_rank->assign(buf.begin() + std::ptrdiff_t(2 + 2 * K), buf.end());
  const auto fail_with = [&](int bad, const std::string& mine_text) {
    const auto text = gather_text(comm, rank == bad ? mine_text : std::string(), 1024);
    std::ostringstream s;
    s << text[bad] << " [rank " << bad << " of " << P << "; every rank throws this error]";
    throw invalid_argument(s.str());
  };
  if (buf[0] < P) fail_with(static_cast<int>(buf[0]), error);
  std::vector<std::size_t> differ;
  for (std::size_t i = 0; i < K; ++i)
    if (buf[2 + i] != ~buf[2 + K + i]) differ.push_back(i);
  if (differ.empty()) {
    if (buf[1] < P) fail_with(static_cast<int>(buf[1]), relative);
    return;
  }
  const auto& d = f[differ[0]];
  const auto texts = gather_text(comm, d.text, 96);
  std::map<std::string, std::vector<int>> groups;
  std::vector<std::string> order;
  for (int r = 0; r < P; ++r) {
    if (!groups.count(texts[r])) order.push_back(texts[r]);
    groups[texts[r]].push_back(r);
  }
  std::ostringstream s;
  // When the ranks are in different calls (the first field names the call),
  // name only the class, so that the message is the same on every rank.
  std::string where = fn;
  if (differ[0] == 0 && f[0].what == "call") where = where.substr(0, where.find("::"));
  s << "blockattn::" << where << ": " << d.what << " differs between ranks: ";
  for (std::size_t i = 0; i < order.size(); ++i) {
    const auto& g = groups[order[i]];
    s << (i ? "; " : "") << order[i] << " on rank" << (g.size() > 1 ? "s " : " ") << rank_list(g);
  }
  s << "; expected the same on every rank";
  if (differ.size() > 1) {
    s << " (also differing: ";
    for (std::size_t i = 1; i < differ.size(); ++i) s << (i > 1 ? ", " : "") << f[differ[i]].what;
    s << ")";
  }
  throw invalid_argument(s.str());
}

}  // namespace impl
}  // namespace blockattn
