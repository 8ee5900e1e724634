// "ucx": KV writes as UCX puts (ucp_put_nbx) into the peer's registered
// memory: one-sided RDMA writes on InfiniBand/RoCE; over shared memory and
// TCP (no NIC here) UCX 1.13 emulates them with active messages that the
// receiver's progress thread lands. The UCX transport list comes from the
// name: "ucx" takes UCX_TLS from the environment (UCX's own default when
// unset), "ucx:shm" is "sm,self", "ucx:tcp" is "tcp,self", and "ucx:LIST"
// passes LIST as is. The endpoint is "ucx://" + the worker's address in
// hex; both sides must use the same name.
//
// Protocol (active messages, eager only, a 24-byte header each):
//   HELLO         sender -> receiver: the sender's worker address; the
//                 receiver opens an endpoint back and answers REGIONS
//   GET_REGIONS   sender -> receiver: answer REGIONS again (a region
//                 registered after the connection was made)
//   REGIONS       receiver -> sender: pid, host, and every registered
//                 region: id, base address, size, packed remote key
//   NOTIFY / NOTIFY_REPLY   a notification and the status of queueing it
//   REVOKE / REVOKE_ACK     the receiver deregisters a region: the sender
//                 drops its remote key once no write of its own is in flight
//   BYE           either side closes the connection
//
// A Write checks every op against the local regions and the peer's region
// table before posting anything, posts every put, then flushes the
// endpoint: the flush completing means the bytes are in the peer's memory.
// A Write that fails after posting keeps its local regions pinned
// (DeregisterMemory waits) until its endpoint's close has completed, since
// UCX may still read them. Connections must not outlive their transport.
//
// Threading: one UCX worker per transport in SERIALIZED mode behind one
// std::mutex (mu_); every UCX call and every piece of state below is under
// it. A progress thread polls while messages flow and sleeps on the
// worker's event fd when idle; a thread waiting for its own operation
// progresses the worker itself.
#include <poll.h>
#include <signal.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "common/status_macros.h"
#include "kv_transfer/region_table.h"
#include "kv_transfer/transports.h"

namespace pdserve::kv {
namespace {

constexpr std::string_view kEndpointPrefix = "ucx://";
// Connections a receiver serves at once: a peer cannot make it hold
// endpoints without limit.
constexpr size_t kMaxPeers = 4096;
// How long the progress thread keeps polling after the last message.
constexpr auto kSpinAfterActivity = std::chrono::microseconds(500);
// How often the progress thread looks at the stop flag.
constexpr int kStopPollMs = 50;

enum AmId : unsigned {
  kHello = 1,
  kGetRegions,
  kRegions,
  kNotify,
  kNotifyReply,
  kRevoke,
  kRevokeAck,
  kBye,
};

// Every active message carries this header. `conn` names the connection
// (chosen by the sender, unique per transport); `seq` a notification;
// `value` a region id or a status code.
struct AmHeader {
  uint64_t conn = 0;
  uint64_t seq = 0;
  uint32_t value = 0;
  uint32_t reserved = 0;
};
static_assert(sizeof(AmHeader) == 24);

// Little-endian append/read of the REGIONS payload.
class Writer {
 public:
  template <typename T>
  void Put(T v) {
    const auto* p = reinterpret_cast<const std::byte*>(&v);
    out.insert(out.end(), p, p + sizeof(T));
  }
  void PutBytes(const void* data, size_t len) {
    Put<uint32_t>(static_cast<uint32_t>(len));
    const auto* p = static_cast<const std::byte*>(data);
    out.insert(out.end(), p, p + len);
  }
  std::vector<std::byte> out;
};

class Reader {
 public:
  Reader(const void* data, size_t len)
      : p_(static_cast<const std::byte*>(data)), left_(len) {}
  template <typename T>
  bool Get(T& v) {
    if (left_ < sizeof(T)) return false;
    std::memcpy(&v, p_, sizeof(T));
    p_ += sizeof(T);
    left_ -= sizeof(T);
    return true;
  }
  bool GetBytes(std::span<const std::byte>& b, size_t limit) {
    uint32_t len = 0;
    if (!Get(len) || len > left_ || len > limit) return false;
    b = {p_, len};
    p_ += len;
    left_ -= len;
    return true;
  }
  bool done() const { return left_ == 0; }

 private:
  const std::byte* p_;
  size_t left_;
};

std::string HostName() {
  char buf[256] = {};
  ::gethostname(buf, sizeof(buf) - 1);
  return buf;
}

std::string UcsError(ucs_status_t s) { return ucs_status_string(s); }

// The TLS list a transport name asks for; empty: UCX's (environment's).
absl::StatusOr<std::string> TlsFor(std::string_view name) {
  if (name == "ucx") return std::string();
  if (!name.starts_with("ucx:") || name.size() == 4) {
    return absl::NotFoundError(
        absl::StrCat("not a ucx transport name: ", std::string(name)));
  }
  const std::string_view mode = name.substr(4);
  if (mode == "shm") return std::string("sm,self");
  if (mode == "tcp") return std::string("tcp,self");
  return std::string(mode);
}

// The TLS list in effect: the configured one, else UCX_TLS, else "all".
std::string EffectiveTls(const std::string& tls) {
  if (!tls.empty()) return tls;
  const char* env = std::getenv("UCX_TLS");
  return env != nullptr && *env != '\0' ? env : "all";
}

bool HasTl(const std::string& tls,
           std::initializer_list<std::string_view> names) {
  const std::vector<std::string> items = absl::StrSplit(EffectiveTls(tls), ',');
  for (const std::string& item : items) {
    for (std::string_view n : names) {
      if (item == n || item.starts_with(std::string(n) + "_")) return true;
    }
  }
  return false;
}

// Shared-memory transports have no peer failure detection in UCX 1.13:
// endpoints over them go without it (peer loss is then found by BYE, by
// the peer's pid, or by the timeout).
bool SharedMemoryOnly(const std::string& tls) {
  return !HasTl(tls,
                {"all", "tcp", "rc", "dc", "ud", "ib", "rc_x", "dc_x", "ud_x"});
}

// Puts into memory the application allocated are one-sided (no receiver
// CPU) only over RDMA: UCX 1.13 emulates them with active messages over
// TCP, and over shared memory for memory it did not allocate itself.
bool PutsAreOneSided(const std::string& tls) {
  return HasTl(tls, {"rc", "dc", "ib"}) && !HasTl(tls, {"all"});
}

// A registered local region.
struct LocalRegion {
  std::span<std::byte> memory;
  ucp_mem_h memh = nullptr;
  std::vector<std::byte> rkey;  // Packed, for peers.
  int writers = 0;              // Local Writes reading from it.
  bool leaving = false;         // Being deregistered: no new Writes.
};

// A region of the peer, as its REGIONS message described it.
struct RemoteRegion {
  uint64_t base = 0;
  uint64_t size = 0;
  ucp_rkey_h rkey = nullptr;
};

// The receiving side's view of one sender's connection.
struct Peer {
  ucp_ep_h ep = nullptr;  // Back to the sender.
  bool failed = false;
  std::vector<uint32_t> revokes_waiting;  // REVOKE sent, no ACK yet.
};

// The sending side's state of one connection, shared between the
// KvConnection and the active-message handlers. Guarded by the
// transport's mu_.
struct ConnState {
  uint64_t id = 0;
  ucp_ep_h ep = nullptr;
  bool failed = false;
  std::string failure;     // Why, once failed.
  bool peer_gone = false;  // BYE or an endpoint error: nothing more to send.
  bool peer_reachable() const { return !peer_gone; }
  bool regions_known = false;
  uint64_t regions_version = 0;  // Bumped on every REGIONS.
  std::map<uint32_t, RemoteRegion> regions;
  uint32_t peer_pid = 0;
  bool peer_same_host = false;
  bool writing = false;
  std::vector<uint32_t> revokes_pending;  // Acked once `writing` ends.
  // Local regions a failed Write's puts may still read: their `writers`
  // counts are released only once the endpoint's close has completed.
  std::vector<uint32_t> pinned;
  uint64_t notify_seq = 0;
  uint64_t notify_reply_seq = 0;
  absl::StatusCode notify_reply_code = absl::StatusCode::kOk;
};

// Completion of a non-blocking UCX request. Heap-allocated: when a waiter
// gives up, the callback still has somewhere to write and frees it.
struct Completion {
  bool done = false;
  bool abandoned = false;
  ucs_status_t status = UCS_OK;
  std::function<void()> then;  // Run once done (under the worker's lock).
};

void OnComplete(void* request, ucs_status_t status, void* user_data) {
  auto* c = static_cast<Completion*>(user_data);
  if (c->abandoned) {
    if (c->then) c->then();
    delete c;
  } else {
    c->done = true;
    c->status = status;
  }
  ucp_request_free(request);
}

class UcxTransport;

class UcxConnection final : public KvConnection {
 public:
  UcxConnection(UcxTransport* transport, std::shared_ptr<ConnState> state)
      : transport_(transport), state_(std::move(state)) {}
  ~UcxConnection() override;

  absl::Status Write(std::span<const WriteOp> ops) override;
  absl::Status Notify(std::string_view message) override;

 private:
  UcxTransport* const transport_;
  const std::shared_ptr<ConnState> state_;
};

class UcxTransport final : public KvTransport {
 public:
  static absl::StatusOr<std::unique_ptr<KvTransport>> Create(
      std::string_view name, const TransportOptions& options) {
    PD_ASSIGN_OR_RETURN(const std::string tls, TlsFor(name));
    auto t =
        std::unique_ptr<UcxTransport>(new UcxTransport(name, tls, options));
    PD_RETURN_IF_ERROR(t->Init(tls));
    t->progress_thread_ = std::thread([p = t.get()] { p->ProgressLoop(); });
    return std::unique_ptr<KvTransport>(std::move(t));
  }

  ~UcxTransport() override {
    std::vector<uint32_t> ids;
    {
      std::lock_guard lock(mu_);
      for (const auto& [id, r] : local_) ids.push_back(id);
    }
    for (uint32_t id : ids) (void)DeregisterMemory(RegionId(id));
    {
      std::lock_guard lock(mu_);
      // Tell every sender we are gone, then close the endpoints.
      std::vector<ucp_ep_h> eps, told;
      for (auto& [conn, peer] : peers_) {
        if (!peer->failed) {
          SendAm(peer->ep, kBye, {conn}, {});
          told.push_back(peer->ep);
        }
        eps.push_back(peer->ep);
      }
      FlushBriefly(told);
      for (auto& [id, c] : conns_) {
        c->failed = true;
        eps.push_back(c->ep);
        c->ep = nullptr;
      }
      CloseEndpoints(eps);  // Before the error handlers' arguments go.
      peers_.clear();
      conns_.clear();
    }
    stop_.store(true);
    if (progress_thread_.joinable()) {
      {
        std::lock_guard lock(mu_);
        ucp_worker_signal(worker_);
      }
      progress_thread_.join();
    }
    if (worker_) ucp_worker_destroy(worker_);
    for (auto& [id, r] : local_)
      ucp_mem_unmap(context_, r.memh);  // Still pinned ones.
    if (context_) ucp_cleanup(context_);
  }

  const TransportCapabilities& capabilities() const override { return caps_; }
  std::string endpoint() const override { return endpoint_; }

  absl::StatusOr<RegionId> RegisterMemory(
      std::span<std::byte> memory) override {
    if (memory.empty())
      return absl::InvalidArgumentError("cannot register empty memory");
    ucp_mem_map_params_t mp{};
    mp.field_mask =
        UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    mp.address = memory.data();
    mp.length = memory.size();
    std::lock_guard lock(mu_);
    ucp_mem_h memh = nullptr;
    if (ucs_status_t s = ucp_mem_map(context_, &mp, &memh); s != UCS_OK) {
      return absl::InternalError(absl::StrCat("ucp_mem_map: ", UcsError(s)));
    }
    void* packed = nullptr;
    size_t packed_len = 0;
    if (ucs_status_t s = ucp_rkey_pack(context_, memh, &packed, &packed_len);
        s != UCS_OK) {
      ucp_mem_unmap(context_, memh);
      return absl::InternalError(absl::StrCat("ucp_rkey_pack: ", UcsError(s)));
    }
    const uint32_t id = next_region_++;
    LocalRegion& r = local_[id];
    r.memory = memory;
    r.memh = memh;
    r.rkey.assign(static_cast<std::byte*>(packed),
                  static_cast<std::byte*>(packed) + packed_len);
    ucp_rkey_buffer_release(packed);
    return RegionId(id);
  }

  absl::Status DeregisterMemory(RegionId region) override {
    const absl::Time deadline = absl::Now() + options_.io_timeout;
    std::unique_lock lock(mu_);
    auto it = local_.find(region.value);
    if (it == local_.end() || it->second.leaving) {
      return absl::NotFoundError(
          absl::StrCat("unknown memory region ", region.value));
    }
    it->second.leaving = true;
    // Every sender that may hold its key drops it once its writes are done.
    for (auto& [conn, peer] : peers_) {
      if (peer->failed) continue;
      SendAm(peer->ep, kRevoke, {conn, 0, region.value}, {});
      peer->revokes_waiting.push_back(region.value);
    }
    auto settled = [&] {
      if (local_[region.value].writers > 0) return false;
      for (auto& [conn, peer] : peers_) {
        if (peer->failed) continue;
        for (uint32_t r : peer->revokes_waiting) {
          if (r == region.value) return false;
        }
      }
      return true;
    };
    bool ok = WaitLocked(lock, settled, deadline);
    // A peer that does not answer in time is dropped. Over RDMA the unmap
    // below revokes its access in hardware; over transports where UCX
    // emulates puts with messages, a peer frozen past the timeout that
    // later resumes a put it posted before could still write: deregister
    // only memory whose senders have finished or died.
    if (!ok) {
      std::vector<ucp_ep_h> eps;
      std::vector<uint64_t> dropped;
      for (auto& [conn, peer] : peers_) {
        auto& w = peer->revokes_waiting;
        if (std::find(w.begin(), w.end(), region.value) != w.end()) {
          eps.push_back(peer->ep);
          dropped.push_back(conn);
        }
      }
      CloseEndpoints(eps);
      for (uint64_t conn : dropped) peers_.erase(conn);
      // Our own failed writes to a stalled peer may still read the region
      // until their endpoints' closes complete.
      if (!WaitLocked(
              lock, [&] { return local_[region.value].writers == 0; },
              absl::Now() + options_.io_timeout)) {
        local_[region.value].leaving = false;
        return absl::DeadlineExceededError(
            absl::StrCat("memory region ", region.value,
                         " is still read by a write to a stalled peer; "
                         "deregister it later"));
      }
    }
    ucp_mem_unmap(context_, local_[region.value].memh);
    local_.erase(region.value);
    return absl::OkStatus();
  }

  absl::StatusOr<std::unique_ptr<KvConnection>> Connect(
      std::string_view endpoint) override {
    if (!endpoint.starts_with(kEndpointPrefix)) {
      return absl::InvalidArgumentError(
          absl::StrCat("not a ucx endpoint: '", std::string(endpoint), "'"));
    }
    const std::string hex(endpoint.substr(kEndpointPrefix.size()));
    if (hex.empty() || hex.size() % 2 != 0 ||
        hex.find_first_not_of("0123456789abcdefABCDEF") != std::string::npos) {
      return absl::InvalidArgumentError("malformed ucx endpoint address");
    }
    const std::string address = absl::HexStringToBytes(hex);
    const absl::Time deadline = absl::Now() + options_.io_timeout;
    auto state = std::make_shared<ConnState>();
    std::unique_lock lock(mu_);
    state->id = (conn_salt_ << 20) ^ ++next_conn_;
    if (ucs_status_t s =
            CreateEndpoint(address, &OnSenderEpError, state.get(), &state->ep);
        s != UCS_OK) {
      return absl::UnavailableError(
          absl::StrCat("cannot reach ucx peer: ", UcsError(s)));
    }
    conns_[state->id] = state;
    SendAm(state->ep, kHello, {state->id}, std::as_bytes(std::span(address_)));
    if (!WaitLocked(
            lock, [&] { return state->regions_known || state->failed; },
            deadline) ||
        state->failed) {
      const absl::Status s = state->failed
                                 ? absl::UnavailableError(absl::StrCat(
                                       "ucx peer: ", state->failure))
                                 : absl::DeadlineExceededError(
                                       "ucx peer did not answer the handshake");
      DropConnection(*state);
      return s;
    }
    return std::unique_ptr<KvConnection>(
        new UcxConnection(this, std::move(state)));
  }

  absl::StatusOr<Notification> WaitNotification(
      absl::Duration timeout) override {
    return notifications_.Wait(timeout);
  }

  // ---- Used by UcxConnection. ----

  absl::Status Write(ConnState& c, std::span<const WriteOp> ops) {
    const absl::Time deadline = absl::Now() + options_.io_timeout;
    std::unique_lock lock(mu_);
    Progress();  // Learn of a peer's BYE or REVOKE before posting.
    if (c.failed)
      return absl::UnavailableError(
          absl::StrCat("connection is closed: ", c.failure));
    // Every range before anything is posted. A remote region the table
    // lacks (registered after the handshake) makes us ask the peer once
    // and check everything again (the wait lets other threads in).
    for (bool refreshed = false;; refreshed = true) {
      bool unknown_remote = false;
      PD_RETURN_IF_ERROR(CheckRanges(c, ops, refreshed, unknown_remote));
      if (!unknown_remote) break;
      const uint64_t version = c.regions_version;
      SendAm(c.ep, kGetRegions, {c.id}, {});
      if (!WaitLocked(
              lock, [&] { return c.regions_version != version || c.failed; },
              deadline)) {
        return FailLocked(c,
                          TimeoutStatus(c, "asking the peer for its regions"));
      }
      if (c.failed)
        return absl::UnavailableError(absl::StrCat("ucx peer: ", c.failure));
    }
    // Post every put, then one flush.
    for (const WriteOp& op : ops) ++local_[op.local_region.value].writers;
    c.writing = true;
    absl::Status status = absl::OkStatus();
    for (const WriteOp& op : ops) {
      if (op.length == 0) continue;
      const LocalRegion& l = local_[op.local_region.value];
      const RemoteRegion& r = c.regions[op.remote_region.value];
      ucp_request_param_t p{};
      p.op_attr_mask = UCP_OP_ATTR_FIELD_MEMH;
      p.memh = l.memh;
      ucs_status_ptr_t req =
          ucp_put_nbx(c.ep, l.memory.data() + op.local_offset, op.length,
                      r.base + op.remote_offset, r.rkey, &p);
      if (UCS_PTR_IS_ERR(req)) {
        status = absl::UnavailableError(
            absl::StrCat("ucp_put_nbx: ", UcsError(UCS_PTR_STATUS(req))));
        break;
      }
      if (req != nullptr)
        ucp_request_free(req);  // The flush reports its completion.
    }
    if (status.ok()) status = FlushLocked(lock, c, deadline, "writing KV");
    // Over shared memory the bytes may "land" in a dead peer's segment.
    if (status.ok() && PeerExited(c)) {
      status =
          absl::UnavailableError("writing KV: the peer process has exited");
    }
    for (const WriteOp& op : ops) {
      if (status.ok()) {
        --local_[op.local_region.value].writers;
      } else {
        c.pinned.push_back(op.local_region.value);
      }
    }
    c.writing = false;
    AckPendingRevokes(c);
    if (!status.ok()) return FailLocked(c, status);
    return absl::OkStatus();
  }

  // INVALID_ARGUMENT for a local range outside its region (the connection
  // stays open); NOT_FOUND / OUT_OF_RANGE for a remote one (it closes).
  // An unknown remote region sets `unknown_remote` instead, unless
  // `final`. Requires mu_.
  absl::Status CheckRanges(ConnState& c, std::span<const WriteOp> ops,
                           bool final, bool& unknown_remote) {
    for (const WriteOp& op : ops) {
      auto it = local_.find(op.local_region.value);
      if (it == local_.end() || it->second.leaving) {
        return absl::InvalidArgumentError(absl::StrCat(
            "local memory region ", op.local_region.value, " is unknown"));
      }
      const uint64_t size = it->second.memory.size();
      if (op.local_offset > size || op.length > size - op.local_offset) {
        return absl::InvalidArgumentError(
            absl::StrCat("local range [", op.local_offset, ", +", op.length,
                         ") outside region ", op.local_region.value, " of ",
                         size, " bytes"));
      }
    }
    for (const WriteOp& op : ops) {
      auto it = c.regions.find(op.remote_region.value);
      if (it == c.regions.end() && !final) {
        unknown_remote = true;
        return absl::OkStatus();
      }
      if (it == c.regions.end()) {
        return FailLocked(
            c, absl::NotFoundError(absl::StrCat(
                   "peer refused the transfer: unknown memory region ",
                   op.remote_region.value)));
      }
      const uint64_t size = it->second.size;
      if (op.remote_offset > size || op.length > size - op.remote_offset) {
        return FailLocked(
            c, absl::OutOfRangeError(absl::StrCat(
                   "peer refused the transfer: range [", op.remote_offset,
                   ", +", op.length, ") outside region ",
                   op.remote_region.value, " of ", size, " bytes")));
      }
    }
    return absl::OkStatus();
  }

  absl::Status Notify(ConnState& c, std::string_view message) {
    if (message.size() > options_.max_message_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "notification of ", message.size(), " bytes exceeds the limit of ",
          options_.max_message_bytes));
    }
    const absl::Time deadline = absl::Now() + options_.io_timeout;
    std::unique_lock lock(mu_);
    Progress();
    if (c.failed)
      return absl::UnavailableError(
          absl::StrCat("connection is closed: ", c.failure));
    const uint64_t seq = ++c.notify_seq;
    SendAm(c.ep, kNotify, {c.id, seq},
           std::as_bytes(std::span(message.data(), message.size())));
    if (!WaitLocked(
            lock, [&] { return c.notify_reply_seq == seq || c.failed; },
            deadline)) {
      return FailLocked(
          c, TimeoutStatus(c, "waiting for the peer to queue a notification"));
    }
    if (c.failed && c.notify_reply_seq != seq) {
      return absl::UnavailableError(absl::StrCat("ucx peer: ", c.failure));
    }
    if (c.notify_reply_code != absl::StatusCode::kOk) {
      return absl::Status(c.notify_reply_code, "peer refused the notification");
    }
    return absl::OkStatus();
  }

  void Close(ConnState& c) {
    std::lock_guard lock(mu_);
    DropConnection(c);
  }

 private:
  UcxTransport(std::string_view name, const std::string& tls,
               const TransportOptions& options)
      : options_(options),
        caps_{std::string(name), false, PutsAreOneSided(tls), true},
        peer_failure_detection_(!SharedMemoryOnly(tls)),
        notifications_(options.max_pending_notifications) {
    std::random_device rd;
    conn_salt_ = (uint64_t{rd()} << 32) ^ rd();
  }

  absl::Status Init(const std::string& tls) {
    ucp_config_t* config = nullptr;
    if (ucs_status_t s = ucp_config_read(nullptr, nullptr, &config);
        s != UCS_OK) {
      return absl::InternalError(
          absl::StrCat("ucp_config_read: ", UcsError(s)));
    }
    if (!tls.empty()) {
      if (ucs_status_t s = ucp_config_modify(config, "TLS", tls.c_str());
          s != UCS_OK) {
        ucp_config_release(config);
        return absl::InvalidArgumentError(
            absl::StrCat("UCX TLS '", tls, "': ", UcsError(s)));
      }
    }
    // UCX's TCP transport carries puts as 8 KiB messages by default; KV
    // blocks move at about twice the rate in 256 KiB segments
    // (docs/benchmarks.md). UCX_TCP_{TX,RX}_SEG_SIZE still decide when set.
    // UCX 1.13 applies transport keys given here without their TCP_ prefix.
    if (HasTl(tls, {"tcp", "all"})) {
      for (const char* key : {"TX_SEG_SIZE", "RX_SEG_SIZE"}) {
        if (std::getenv(absl::StrCat("UCX_TCP_", key).c_str()) == nullptr &&
            std::getenv(absl::StrCat("UCX_", key).c_str()) == nullptr) {
          ucp_config_modify(config, key, "256k");
        }
      }
    }
    ucp_params_t params{};
    params.field_mask =
        UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
    params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
    params.mt_workers_shared = 0;
    ucs_status_t s = ucp_init(&params, config, &context_);
    ucp_config_release(config);
    if (s != UCS_OK)
      return absl::UnavailableError(absl::StrCat("ucp_init: ", UcsError(s)));
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;
    if (s = ucp_worker_create(context_, &wp, &worker_); s != UCS_OK) {
      return absl::UnavailableError(
          absl::StrCat("ucp_worker_create: ", UcsError(s)));
    }
    if (s = ucp_worker_get_efd(worker_, &efd_); s != UCS_OK) {
      return absl::UnavailableError(
          absl::StrCat("ucp_worker_get_efd: ", UcsError(s)));
    }
    ucp_address_t* addr = nullptr;
    size_t addr_len = 0;
    if (s = ucp_worker_get_address(worker_, &addr, &addr_len); s != UCS_OK) {
      return absl::UnavailableError(
          absl::StrCat("ucp_worker_get_address: ", UcsError(s)));
    }
    address_.assign(reinterpret_cast<const char*>(addr), addr_len);
    ucp_worker_release_address(worker_, addr);
    endpoint_ = absl::StrCat(std::string(kEndpointPrefix),
                             absl::BytesToHexString(address_));
    constexpr std::pair<AmId, ucp_am_recv_callback_t> kHandlers[] = {
        {kHello, &OnAmId<kHello>},
        {kGetRegions, &OnAmId<kGetRegions>},
        {kRegions, &OnAmId<kRegions>},
        {kNotify, &OnAmId<kNotify>},
        {kNotifyReply, &OnAmId<kNotifyReply>},
        {kRevoke, &OnAmId<kRevoke>},
        {kRevokeAck, &OnAmId<kRevokeAck>},
        {kBye, &OnAmId<kBye>},
    };
    for (const auto& [id, cb] : kHandlers) {
      ucp_am_handler_param_t h{};
      h.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID |
                     UCP_AM_HANDLER_PARAM_FIELD_CB |
                     UCP_AM_HANDLER_PARAM_FIELD_ARG;
      h.id = id;
      h.cb = cb;
      h.arg = this;
      if (s = ucp_worker_set_am_recv_handler(worker_, &h); s != UCS_OK) {
        return absl::UnavailableError(
            absl::StrCat("ucp_worker_set_am_recv_handler: ", UcsError(s)));
      }
    }
    return absl::OkStatus();
  }

  // Sleeps on the worker's event fd when idle. While traffic flows (puts
  // that UCX emulates with messages land through this thread) it keeps
  // polling for kSpinAfterActivity, yielding the core between rounds, so
  // a stream of messages does not pay a wakeup each.
  void ProgressLoop() {
    auto last_activity = std::chrono::steady_clock::now();
    while (!stop_.load()) {
      bool spin = false;
      {
        std::lock_guard lock(mu_);
        const auto now = std::chrono::steady_clock::now();
        while (Progress() != 0) last_activity = now;
        spin = now - last_activity < kSpinAfterActivity;
        if (!spin && ucp_worker_arm(worker_) == UCS_ERR_BUSY) continue;
      }
      if (spin) {
        std::this_thread::yield();  // The lock and the core go to others.
        continue;
      }
      pollfd p{efd_, POLLIN, 0};
      ::poll(&p, 1, kStopPollMs);
    }
  }

  // Progresses the worker, then runs what handlers deferred (UCX calls
  // are not allowed inside its callbacks). Requires mu_.
  unsigned Progress() {
    unsigned n = ucp_worker_progress(worker_);
    while (!deferred_.empty()) {
      auto work = std::move(deferred_);
      deferred_.clear();
      for (auto& w : work) w();
      n += ucp_worker_progress(worker_);
    }
    return n;
  }

  // Progresses until `done()` or the deadline; false on the deadline.
  // Releases mu_ between rounds so the progress thread and other callers
  // get their turn.
  template <typename Pred>
  bool WaitLocked(std::unique_lock<std::mutex>& lock, Pred done,
                  absl::Time deadline) {
    for (int round = 0;; ++round) {
      if (done()) return true;
      if (Progress() == 0) {
        if (absl::Now() >= deadline) return done();
        lock.unlock();
        if (round > 64) {
          std::this_thread::sleep_for(std::chrono::microseconds(50));
        } else {
          std::this_thread::yield();
        }
        lock.lock();
      }
    }
  }

  // A flush of the connection's endpoint, bounded by the deadline. On the
  // deadline the endpoint is force-closed, which cancels what is in flight.
  absl::Status FlushLocked(std::unique_lock<std::mutex>& lock, ConnState& c,
                           absl::Time deadline, absl::string_view what) {
    auto* done = new Completion;
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.cb.send = &OnComplete;
    p.user_data = done;
    ucs_status_ptr_t req = ucp_ep_flush_nbx(c.ep, &p);
    if (req == nullptr) {
      delete done;
      return absl::OkStatus();
    }
    if (UCS_PTR_IS_ERR(req)) {
      delete done;
      return absl::UnavailableError(
          absl::StrCat(what, ": ", UcsError(UCS_PTR_STATUS(req))));
    }
    if (!WaitLocked(
            lock, [&] { return done->done; }, deadline)) {
      done->abandoned = true;  // The callback frees it.
      return TimeoutStatus(c, what);
    }
    const ucs_status_t s = done->status;
    delete done;
    if (s != UCS_OK) {
      return absl::UnavailableError(
          absl::StrCat(what, ": ", c.failed ? c.failure : UcsError(s)));
    }
    return absl::OkStatus();
  }

  static bool PeerExited(const ConnState& c) {
    return c.peer_same_host && c.peer_pid != 0 &&
           ::kill(static_cast<pid_t>(c.peer_pid), 0) != 0 && errno == ESRCH;
  }

  // DEADLINE_EXCEEDED, or UNAVAILABLE when the peer's process is known to
  // have exited (shared memory has no connection to break).
  static absl::Status TimeoutStatus(const ConnState& c,
                                    absl::string_view what) {
    if (c.failed)
      return absl::UnavailableError(absl::StrCat(what, ": ", c.failure));
    if (PeerExited(c)) {
      return absl::UnavailableError(
          absl::StrCat(what, ": the peer process has exited"));
    }
    return absl::DeadlineExceededError(absl::StrCat(what, ": timed out"));
  }

  // Closes the connection after an error (but a local-range error, which
  // never reaches here). Requires mu_.
  absl::Status FailLocked(ConnState& c, absl::Status s) {
    if (!c.failed) {
      c.failed = true;
      c.failure = std::string(s.message());
    }
    DropConnection(c);
    return s;
  }

  // Forgets the connection: remote keys, endpoint, registry entry. A peer
  // still there is told (BYE), so it stops counting on us, e.g. to
  // acknowledge a REVOKE.
  void DropConnection(ConnState& c) {
    for (auto& [id, r] : c.regions) ucp_rkey_destroy(r.rkey);
    c.regions.clear();
    if (c.ep != nullptr && c.peer_reachable()) {
      SendAm(c.ep, kBye, {c.id}, {});
      FlushBriefly({c.ep});
    }
    c.failed = true;
    if (c.failure.empty()) c.failure = "closed";
    auto unpin = [this, pins = std::move(c.pinned)] {
      for (uint32_t r : pins) {
        if (auto it = local_.find(r); it != local_.end()) --it->second.writers;
      }
    };
    c.pinned.clear();
    if (c.ep != nullptr) {
      CloseEndpoints({c.ep}, std::move(unpin));
    } else {
      unpin();
    }
    c.ep = nullptr;
    conns_.erase(c.id);
  }

  // Waits up to 200 ms in all for what was sent on `eps` to leave.
  // Requires mu_.
  void FlushBriefly(const std::vector<ucp_ep_h>& eps) {
    std::vector<Completion*> pending;
    for (ucp_ep_h ep : eps) {
      auto* done = new Completion;
      ucp_request_param_t p{};
      p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
      p.cb.send = &OnComplete;
      p.user_data = done;
      ucs_status_ptr_t req = ucp_ep_flush_nbx(ep, &p);
      if (req == nullptr || UCS_PTR_IS_ERR(req)) {
        delete done;
      } else {
        pending.push_back(done);
      }
    }
    AwaitBriefly(pending, absl::Milliseconds(200));
  }

  // Progresses until every completion is done or `limit` passed; frees the
  // done ones and leaves the others to their callbacks.
  void AwaitBriefly(const std::vector<Completion*>& pending,
                    absl::Duration limit) {
    const absl::Time deadline = absl::Now() + limit;
    for (Completion* done : pending) {
      while (!done->done && absl::Now() < deadline)
        ucp_worker_progress(worker_);
      if (done->done) {
        if (done->then) done->then();
        delete done;
      } else {
        done->abandoned = true;
      }
    }
  }

  // Force-closes endpoints and waits (bounded) for the closes. Requires mu_.
  // `then` runs once every close has completed: now, or later from the
  // progress thread when a stalled peer keeps one pending.
  void CloseEndpoints(const std::vector<ucp_ep_h>& eps,
                      std::function<void()> then = {}) {
    std::vector<Completion*> pending;
    for (ucp_ep_h ep : eps) {
      if (ep == nullptr) continue;
      auto* done = new Completion;
      ucp_request_param_t p{};
      p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK |
                       UCP_OP_ATTR_FIELD_USER_DATA;
      p.flags = UCP_EP_CLOSE_FLAG_FORCE;
      p.cb.send = &OnComplete;
      p.user_data = done;
      ucs_status_ptr_t req = ucp_ep_close_nbx(ep, &p);
      if (req == nullptr || UCS_PTR_IS_ERR(req)) {
        delete done;
      } else {
        pending.push_back(done);
      }
    }
    if (pending.empty()) {
      if (then) then();
      return;
    }
    // The last close to complete runs `then`.
    auto left = std::make_shared<size_t>(pending.size());
    for (Completion* done : pending) {
      done->then = [left, then] {
        if (--*left == 0 && then) then();
      };
    }
    AwaitBriefly(pending, absl::Seconds(1));
  }

  // An endpoint to a worker address (see SharedMemoryOnly).
  ucs_status_t CreateEndpoint(const std::string& address,
                              ucp_err_handler_cb_t on_error, void* arg,
                              ucp_ep_h* ep) {
    ucp_ep_params_t p{};
    p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS |
                   UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                   UCP_EP_PARAM_FIELD_ERR_HANDLER;
    p.address = reinterpret_cast<const ucp_address_t*>(address.data());
    p.err_mode = peer_failure_detection_ ? UCP_ERR_HANDLING_MODE_PEER
                                         : UCP_ERR_HANDLING_MODE_NONE;
    p.err_handler.cb = on_error;
    p.err_handler.arg = arg;
    return ucp_ep_create(worker_, &p, ep);
  }

  // Sends an eager active message; completion is not awaited (the reply,
  // or a flush, says it arrived). Requires mu_.
  void SendAm(ucp_ep_h ep, AmId id, AmHeader header,
              std::span<const std::byte> payload) {
    if (ep == nullptr) return;
    // UCX 1.13 reads the header and the payload until the send completes.
    struct Message {
      AmHeader header;
      std::vector<std::byte> payload;
    };
    auto* m = new Message{header, {payload.begin(), payload.end()}};
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK |
                     UCP_OP_ATTR_FIELD_USER_DATA;
    p.flags = UCP_AM_SEND_FLAG_EAGER;
    p.cb.send = [](void* request, ucs_status_t, void* user_data) {
      delete static_cast<Message*>(user_data);
      ucp_request_free(request);
    };
    p.user_data = m;
    ucs_status_ptr_t req =
        ucp_am_send_nbx(ep, id, &m->header, sizeof(m->header),
                        m->payload.data(), m->payload.size(), &p);
    if (req == nullptr || UCS_PTR_IS_ERR(req)) delete m;
  }

  // The REGIONS payload: who we are and every registered region.
  std::vector<std::byte> RegionsPayload() {
    Writer w;
    w.Put<uint32_t>(static_cast<uint32_t>(::getpid()));
    const std::string host = HostName();
    w.PutBytes(host.data(), host.size());
    uint32_t count = 0;
    for (const auto& [id, r] : local_) count += r.leaving ? 0 : 1;
    w.Put<uint32_t>(count);
    for (const auto& [id, r] : local_) {
      if (r.leaving) continue;
      w.Put<uint32_t>(id);
      w.Put<uint64_t>(reinterpret_cast<uint64_t>(r.memory.data()));
      w.Put<uint64_t>(r.memory.size());
      w.PutBytes(r.rkey.data(), r.rkey.size());
    }
    return std::move(w.out);
  }

  // Handlers, one per message. Called from progress under mu_.
  template <AmId kId>
  static ucs_status_t OnAmId(void* arg, const void* header,
                             size_t header_length, void* data, size_t length,
                             const ucp_am_recv_param_t* param) {
    auto* self = static_cast<UcxTransport*>(arg);
    if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0)
      return UCS_ERR_MESSAGE_TRUNCATED;
    if (header_length != sizeof(AmHeader)) return UCS_OK;
    AmHeader h;
    std::memcpy(&h, header, sizeof(h));
    self->Handle(kId, h,
                 std::span(static_cast<const std::byte*>(data), length));
    return UCS_OK;
  }

  void Handle(AmId id, const AmHeader& h, std::span<const std::byte> payload) {
    switch (id) {
      case kHello: {
        if (peers_.contains(h.conn) || peers_.size() >= kMaxPeers ||
            payload.empty() || payload.size() > 64 * 1024) {
          return;
        }
        // Opening an endpoint is a UCX call: after the progress round.
        std::string address(reinterpret_cast<const char*>(payload.data()),
                            payload.size());
        deferred_.push_back(
            [this, conn = h.conn, address = std::move(address)] {
              if (peers_.contains(conn)) return;
              auto peer = std::make_unique<Peer>();
              if (CreateEndpoint(address, &OnReceiverEpError, peer.get(),
                                 &peer->ep) != UCS_OK) {
                return;
              }
              SendAm(peer->ep, kRegions, {conn}, RegionsPayload());
              peers_[conn] = std::move(peer);
            });
        return;
      }
      case kGetRegions: {
        auto it = peers_.find(h.conn);
        if (it == peers_.end() || it->second->failed) return;
        deferred_.push_back([this, conn = h.conn] {
          auto it = peers_.find(conn);
          if (it != peers_.end())
            SendAm(it->second->ep, kRegions, {conn}, RegionsPayload());
        });
        return;
      }
      case kRegions: {
        auto it = conns_.find(h.conn);
        if (it == conns_.end()) return;
        ParseRegions(*it->second, payload);
        return;
      }
      case kNotify: {
        auto it = peers_.find(h.conn);
        if (it == peers_.end() || it->second->failed) return;
        absl::Status s =
            payload.size() > options_.max_message_bytes
                ? absl::ResourceExhaustedError("notification too long")
                : notifications_.Push({std::string(
                      reinterpret_cast<const char*>(payload.data()),
                      payload.size())});
        deferred_.push_back(
            [this, conn = h.conn, seq = h.seq, code = s.code()] {
              auto it = peers_.find(conn);
              if (it != peers_.end()) {
                SendAm(it->second->ep, kNotifyReply,
                       {conn, seq, static_cast<uint32_t>(code)}, {});
              }
            });
        return;
      }
      case kNotifyReply: {
        auto it = conns_.find(h.conn);
        if (it == conns_.end()) return;
        it->second->notify_reply_seq = h.seq;
        it->second->notify_reply_code =
            h.value <= 16 ? static_cast<absl::StatusCode>(h.value)
                          : absl::StatusCode::kUnknown;
        return;
      }
      case kRevoke: {
        auto it = conns_.find(h.conn);
        if (it == conns_.end()) return;
        it->second->revokes_pending.push_back(h.value);
        if (!it->second->writing) {
          deferred_.push_back(
              [this, c = it->second] { AckPendingRevokes(*c); });
        }
        return;
      }
      case kRevokeAck: {
        auto it = peers_.find(h.conn);
        if (it == peers_.end()) return;
        auto& w = it->second->revokes_waiting;
        w.erase(std::remove(w.begin(), w.end(), h.value), w.end());
        return;
      }
      case kBye: {
        if (auto it = conns_.find(h.conn); it != conns_.end()) {
          it->second->failed = true;
          it->second->peer_gone = true;
          it->second->failure = "the peer closed the connection";
        }
        if (auto it = peers_.find(h.conn); it != peers_.end()) {
          it->second->failed = true;
          deferred_.push_back([this, conn = h.conn] {
            auto it = peers_.find(conn);
            if (it == peers_.end()) return;
            CloseEndpoints({it->second->ep});
            peers_.erase(conn);
          });
        }
        return;
      }
    }
  }

  // Drops the remote keys of revoked regions and acknowledges. Requires mu_
  // and no Write in flight on the connection.
  void AckPendingRevokes(ConnState& c) {
    for (uint32_t region : c.revokes_pending) {
      if (auto it = c.regions.find(region); it != c.regions.end()) {
        ucp_rkey_destroy(it->second.rkey);
        c.regions.erase(it);
      }
      if (!c.failed) SendAm(c.ep, kRevokeAck, {c.id, 0, region}, {});
    }
    c.revokes_pending.clear();
  }

  // Replaces the connection's table with a REGIONS message. A malformed
  // one fails the connection.
  void ParseRegions(ConnState& c, std::span<const std::byte> payload) {
    if (c.writing) return;  // Only answers a Write's own GET_REGIONS.
    Reader r(payload.data(), payload.size());
    uint32_t pid = 0, count = 0;
    std::span<const std::byte> host;
    if (!r.Get(pid) || !r.GetBytes(host, 256) || !r.Get(count))
      return FailMalformed(c);
    std::map<uint32_t, RemoteRegion> regions;
    for (uint32_t i = 0; i < count; ++i) {
      uint32_t id = 0;
      RemoteRegion region;
      std::span<const std::byte> rkey;
      if (!r.Get(id) || !r.Get(region.base) || !r.Get(region.size) ||
          !r.GetBytes(rkey, 64 * 1024)) {
        for (auto& [i, reg] : regions) ucp_rkey_destroy(reg.rkey);
        return FailMalformed(c);
      }
      if (ucp_ep_rkey_unpack(c.ep, rkey.data(), &region.rkey) != UCS_OK)
        continue;
      if (auto [it, inserted] = regions.emplace(id, region); !inserted) {
        ucp_rkey_destroy(region.rkey);
      }
    }
    for (auto& [id, reg] : c.regions) ucp_rkey_destroy(reg.rkey);
    c.regions = std::move(regions);
    c.peer_pid = pid;
    c.peer_same_host =
        std::string_view(reinterpret_cast<const char*>(host.data()),
                         host.size()) == HostName();
    c.regions_known = true;
    ++c.regions_version;
  }

  static void FailMalformed(ConnState& c) {
    c.failed = true;
    c.failure = "malformed region table from the peer";
  }

  static void OnSenderEpError(void* arg, ucp_ep_h, ucs_status_t status) {
    auto* c = static_cast<ConnState*>(arg);
    c->peer_gone = true;
    if (!c->failed) {
      c->failed = true;
      c->failure = absl::StrCat("connection lost (", UcsError(status), ")");
    }
  }

  static void OnReceiverEpError(void* arg, ucp_ep_h, ucs_status_t) {
    static_cast<Peer*>(arg)->failed = true;
  }

  friend class UcxConnection;

  const TransportOptions options_;
  const TransportCapabilities caps_;
  const bool peer_failure_detection_;
  NotificationQueue notifications_;
  std::atomic<bool> stop_{false};

  std::mutex mu_;  // The worker's lock; guards everything below.
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int efd_ = -1;
  std::string address_;   // This worker's address.
  std::string endpoint_;  // "ucx://" + hex(address_); fixed after Init.
  uint64_t conn_salt_ = 0;
  uint64_t next_conn_ = 0;
  uint32_t next_region_ = 1;
  std::map<uint32_t, LocalRegion> local_;
  std::map<uint64_t, std::shared_ptr<ConnState>> conns_;  // As a sender.
  std::map<uint64_t, std::unique_ptr<Peer>> peers_;       // As a receiver.
  std::vector<std::function<void()>> deferred_;

  std::thread progress_thread_;
};

UcxConnection::~UcxConnection() { transport_->Close(*state_); }

absl::Status UcxConnection::Write(std::span<const WriteOp> ops) {
  return transport_->Write(*state_, ops);
}

absl::Status UcxConnection::Notify(std::string_view message) {
  return transport_->Notify(*state_, message);
}

}  // namespace

absl::StatusOr<std::unique_ptr<KvTransport>> CreateUcxTransport(
    std::string_view name, const TransportOptions& options) {
  return UcxTransport::Create(name, options);
}

}  // namespace pdserve::kv
