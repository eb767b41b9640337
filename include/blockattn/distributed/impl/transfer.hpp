// SPDX-License-Identifier: Apache-2.0
// The point-to-point transfers of the schedules, in one place: the messages a
// schedule sends and their tags (one encoding), and a small layer that posts
// them on the execution-space instance, remembers what each one is (message,
// step, peer), and completes them with an optional timeout, so that a peer
// that never posts becomes an exception naming the step, the peer and the
// message instead of a hang.
#pragma once

#include <blockattn/comm/communicator.hpp>
#include <blockattn/core/config.hpp>
#include <blockattn/core/errors.hpp>

#include <chrono>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>

namespace blockattn {

/// Thrown when a transfer does not complete within
/// DistributedOptions::timeout_seconds. The communicator still holds the
/// pending transfer: the job cannot continue with it (abort, e.g. MPI_Abort).
class timeout_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace impl {

/// Every message of every schedule. K, V: a key/value block (packed or not);
/// Q, dO, LSE, D: a (packed) query block with what its backward needs; dK,
/// dV, dQ: gradient partials; O, LSE partial: a helper's forward result;
/// rows: a rank's partial result of serving rows (decode's ring merge).
enum class Message : int { k, v, q, dout, q_lse, q_drow, dk, dv, dq, o, o_lse, rows, count };

inline const char* message_name(Message m) {
  switch (m) {
    case Message::k:
      return "K block";
    case Message::v:
      return "V block";
    case Message::q:
      return "Q block";
    case Message::dout:
      return "dO block";
    case Message::q_lse:
      return "LSE of a Q block";
    case Message::q_drow:
      return "D = rowsum(dO * O) of a Q block";
    case Message::dk:
      return "dK partial";
    case Message::dv:
      return "dV partial";
    case Message::dq:
      return "dQ partial";
    case Message::o:
      return "O partial";
    case Message::o_lse:
      return "LSE partial";
    case Message::rows:
      return "partial result of the rows (O, LSE)";
    case Message::count:
      break;
  }
  return "message";
}

/// The tag of `message` belonging to schedule step `step`: the only tag
/// encoding of the library. Tags of different steps never collide; within
/// one (source, tag) MPI keeps order, so consecutive calls are safe.
inline int message_tag(int step, Message message) {
  return step * int(Message::count) + int(message);
}

/// One posted transfer and what it is.
template <class Comm>
struct Transfer {
  typename Comm::request_type request;
  int peer = -1;
  int step = 0;
  Message message = Message::k;
  bool receive = false;
  bool done = false;
};

/// Posts and completes the transfers of one collective call.
template <class Comm, class ExecSpace>
class Transfers {
 public:
  using transfer_type = Transfer<Comm>;

  /// `timeout_seconds` <= 0: wait without limit (the communicator's wait()).
  Transfers(Comm& comm, const ExecSpace& exec, const char* function, double timeout_seconds)
      : m_comm(comm), m_exec(exec), m_function(function), m_timeout(timeout_seconds) {}

  template <class View>
  transfer_type send(const View& v, int peer, int step, Message m) {
    return post<false>(v, peer, step, m);
  }
  template <class View>
  transfer_type receive(const View& v, int peer, int step, Message m) {
    return post<true>(v, peer, step, m);
  }

  /// Whether the communicator collects a step's transfers until flush().
  static constexpr bool grouped = has_comm_flush<Comm>::value;

  /// Starts what was posted so far, for a communicator that collects a
  /// step's transfers (comm/communicator.hpp, flush()); a no-op otherwise.
  void flush() {
    if constexpr (grouped) m_comm.flush();
  }
  /// The largest `value` over the ranks (one allreduce).
  int agree_max(int value) { return m_comm.allreduce(value, ReduceOp::max); }
  const char* function() const { return m_function; }

  /// Progresses the transfer; true once it completed.
  bool test(transfer_type& t) {
    if (!t.done) t.done = m_comm.test(t.request);
    return t.done;
  }

  /// Completes the transfer, or throws timeout_error after the timeout.
  void wait(transfer_type& t) {
    if (t.done) return;
    if (!(m_timeout > 0)) {
      m_comm.wait(t.request);
      t.done = true;
      return;
    }
    const auto deadline =
        std::chrono::steady_clock::now() + std::chrono::duration<double>(m_timeout);
    while (!m_comm.test(t.request)) {
      if (std::chrono::steady_clock::now() > deadline) {
        std::ostringstream s;
        s << "blockattn::" << m_function << ": step " << t.step << ": the "
          << (t.receive ? "receive of the " : "send of the ") << message_name(t.message)
          << (t.receive ? " from rank " : " to rank ") << t.peer << " (tag "
          << message_tag(t.step, t.message) << ") did not complete within " << m_timeout
          << " s (DistributedOptions::timeout_seconds); rank " << t.peer
          << " may have failed, be stuck, or be running a different call. The transfer is "
             "still pending in the communicator: abort the job (e.g. MPI_Abort)";
        throw timeout_error(s.str());
      }
      std::this_thread::yield();
    }
    t.done = true;
  }
  template <class Range>
  void wait_all(Range& ts) {
    for (auto& t : ts) wait(t);
  }
  template <class Range>
  void test_all(Range& ts) {
    for (auto& t : ts) test(t);
  }

 private:
  template <bool Receive, class View>
  transfer_type post(const View& v, int peer, int step, Message m) {
    transfer_type t;
    t.request = comm_post<Receive>(m_comm, m_exec, v, peer, message_tag(step, m));
    t.peer = peer;
    t.step = step;
    t.message = m;
    t.receive = Receive;
    return t;
  }

  Comm& m_comm;
  ExecSpace m_exec;
  const char* m_function;
  double m_timeout;
};

}  // namespace impl
}  // namespace blockattn
