// "nccl": KV writes from one GPU to another, on one node or across nodes,
// as NCCL point-to-point sends and receives. Each connection is a
// communicator of its own, made when it connects: the sender makes an
// ncclUniqueId and passes it over a small TCP control channel (the
// endpoint is the receiver's "host:port", TransportOptions::
// listen_address), and both sides join with ncclCommInitRankConfig (sender
// rank 0, receiver rank 1). Communicators are non-blocking (config.blocking
// = 0), so that every wait is bounded: the transport polls
// ncclCommGetAsyncError and calls ncclCommAbort on a timeout or an error.
// libnccl is opened with dlopen on first use (nccl_api.h).
//
// Control protocol (control_channel.h frames):
//   HELLO        sender -> receiver: process nonce, device UUID, unique id
//   HELLO_REPLY  the mode (value): kTwoRanks, or kLoopback (below); in
//                kTwoRanks both sides then join, and the receiver sends
//                ACK once it has (ERROR if it could not)
//   WRITE        the remote ranges. kTwoRanks: the sender posts one
//                grouped ncclSend per range at once; the receiver checks
//                every range against its regions, pins them, posts the
//                matching grouped ncclRecv on its stream, waits for it and
//                answers ACK (or ERROR, after which both sides abort)
//   NOTIFY / ACK a notification, queued after every write before it
//
// Loopback. NCCL cannot join two ranks on one GPU (two processes or one),
// so a sender and a receiver in the same process on the same device use a
// one-rank communicator of the sender's: the receiver checks and pins the
// ranges and answers GRANT with their addresses; the sender posts the
// ncclSend and ncclRecv of every range to itself in one group, waits, and
// answers DONE, which unpins. This is what one GPU can test; two processes
// on one GPU are refused (FAILED_PRECONDITION: use cuda_ipc).
//
// Registered memory must be device memory. Writes need the receiver's CPU
// (one_sided is false); the receiver owns every write into its memory, so
// deregistration needs nothing from the senders.
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kv_transfer/control_channel.h"
#include "kv_transfer/cuda_common.h"
#include "kv_transfer/nccl_api.h"
#include "kv_transfer/region_table.h"
#include "kv_transfer/socket_io.h"
#include "kv_transfer/transports.h"

namespace pdserve::kv {
namespace {

constexpr char kName[] = "nccl";
enum Mode : uint32_t { kTwoRanks = 1, kLoopback = 2 };
constexpr size_t kUuidBytes = sizeof(cudaUUID_t);
constexpr size_t kHelloBytes = 8 + kUuidBytes + sizeof(ncclUniqueId);

// Identifies this process to a peer (pids repeat across hosts).
uint64_t ProcessNonce() {
  static const uint64_t nonce = [] {
    std::random_device rd;
    return (uint64_t{rd()} << 32) ^ rd() ^ static_cast<uint64_t>(::getpid());
  }();
  return nonce;
}

absl::Status NcclError(const NcclApi& nccl, ncclComm_t comm, ncclResult_t r,
                       std::string_view what) {
  const char* detail = comm != nullptr ? nccl.get_last_error(comm) : nullptr;
  const std::string message =
      absl::StrCat("nccl ", std::string(what), ": ", nccl.get_error_string(r),
                   detail != nullptr && *detail != '\0' ? " (" : "",
                   detail != nullptr ? detail : "",
                   detail != nullptr && *detail != '\0' ? ")" : "");
  // Remote and system errors are a peer or its network going away.
  return r == ncclRemoteError || r == ncclSystemError
             ? absl::UnavailableError(message)
             : absl::InternalError(message);
}

// A non-blocking communicator and the stream and event its operations
// use. Destruction aborts the communicator (local, never waits on the
// peer) and waits, bounded, for the stream.
class Comm {
 public:
  static absl::StatusOr<std::unique_ptr<Comm>> Create(const NcclApi& nccl) {
    auto c = std::unique_ptr<Comm>(new Comm(nccl));
    if (cudaError_t e =
            cudaStreamCreateWithFlags(&c->stream_, cudaStreamNonBlocking);
        e != cudaSuccess) {
      return CudaError(e, "cudaStreamCreateWithFlags");
    }
    if (cudaError_t e =
            cudaEventCreateWithFlags(&c->event_, cudaEventDisableTiming);
        e != cudaSuccess) {
      return CudaError(e, "cudaEventCreateWithFlags");
    }
    return c;
  }
  ~Comm() {
    Abort();
    // An aborted communicator's kernels end; a stream still busy after
    // that is left to the driver (destroying it does not wait).
    if (event_ != nullptr) cudaEventDestroy(event_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  // Joins the communicator; bounded by `deadline`.
  absl::Status Init(const ncclUniqueId& id, int nranks, int rank,
                    absl::Time deadline) {
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    const ncclResult_t r =
        nccl_.comm_init_rank_config(&comm_, nranks, id, rank, &config);
    if (r != ncclSuccess && r != ncclInProgress) {
      return NcclError(nccl_, comm_, r, "ncclCommInitRankConfig");
    }
    return Settle(deadline, "joining the communicator");
  }

  // Polls until the last non-blocking call has finished (its operations
  // are then on the stream).
  absl::Status Settle(absl::Time deadline, std::string_view what,
                      const std::function<absl::Status()>& poll = {}) {
    while (true) {
      ncclResult_t state = ncclSuccess;
      if (ncclResult_t r = nccl_.comm_get_async_error(comm_, &state);
          r != ncclSuccess) {
        return Fail(NcclError(nccl_, comm_, r, "ncclCommGetAsyncError"));
      }
      if (state == ncclSuccess) return absl::OkStatus();
      if (state != ncclInProgress) {
        return Fail(NcclError(nccl_, comm_, state, what));
      }
      if (poll) {
        if (absl::Status s = poll(); !s.ok()) return Fail(s);
      }
      if (absl::Now() >= deadline) {
        return Fail(absl::DeadlineExceededError(
            absl::StrCat("nccl ", std::string(what), ": timed out")));
      }
      std::this_thread::yield();
    }
  }

  // Posts `count` sends and/or receives (`post(i)`) as one group, then
  // waits, bounded, until they have completed on the stream; `poll` runs
  // between polls (a non-OK status ends the wait with it).
  absl::Status RunGroup(size_t count,
                        const std::function<ncclResult_t(size_t)>& post,
                        absl::Time deadline, std::string_view what,
                        const std::function<absl::Status()>& poll = {}) {
    if (ncclResult_t r = nccl_.group_start(); r != ncclSuccess) {
      return Fail(NcclError(nccl_, comm_, r, "ncclGroupStart"));
    }
    ncclResult_t posted = ncclSuccess;
    for (size_t i = 0; i < count && posted == ncclSuccess; ++i) {
      posted = post(i);
      if (posted == ncclInProgress) posted = ncclSuccess;
    }
    const ncclResult_t ended = nccl_.group_end();  // Always closes the group.
    if (posted != ncclSuccess) {
      return Fail(NcclError(nccl_, comm_, posted, what));
    }
    if (ended != ncclSuccess && ended != ncclInProgress) {
      return Fail(NcclError(nccl_, comm_, ended, "ncclGroupEnd"));
    }
    PD_RETURN_IF_ERROR(Settle(deadline, what, poll));
    if (cudaError_t e = cudaEventRecord(event_, stream_); e != cudaSuccess) {
      return Fail(CudaError(e, "cudaEventRecord"));
    }
    const absl::Status done = WaitForEvent(event_, deadline, what, [&] {
      ncclResult_t state = ncclSuccess;
      nccl_.comm_get_async_error(comm_, &state);
      if (state != ncclSuccess && state != ncclInProgress) {
        return NcclError(nccl_, comm_, state, what);
      }
      return poll ? poll() : absl::OkStatus();
    });
    return done.ok() ? done : Fail(done);
  }

  ncclComm_t get() const { return comm_; }
  cudaStream_t stream() const { return stream_; }
  const NcclApi& nccl() const { return nccl_; }

  // After a failure: aborts the communicator, which ends its kernels,
  // and waits (bounded) for the stream, so that pinned memory can go.
  // True when the stream has finished.
  bool AbortAndDrain(absl::Duration limit) {
    Abort();
    return event_ == nullptr ||
           WaitForEvent(event_, absl::Now() + limit, "draining").ok();
  }

 private:
  explicit Comm(const NcclApi& nccl) : nccl_(nccl) {}
  absl::Status Fail(absl::Status s) {
    Abort();
    return s;
  }
  void Abort() {
    if (comm_ != nullptr) nccl_.comm_abort(comm_);
    comm_ = nullptr;
  }

  const NcclApi& nccl_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t event_ = nullptr;
};

// OK while the peer is quiet on the control socket; during a transfer it
// sends nothing before its answer, so readable means an answer (for the
// sender), a hangup, or a protocol error.
bool Readable(int fd) {
  pollfd p{fd, POLLIN, 0};
  return ::poll(&p, 1, 0) > 0;
}

class NcclTransport;

class NcclConnection final : public KvConnection {
 public:
  NcclConnection(NcclTransport* transport, Fd fd, Mode mode,
                 std::unique_ptr<Comm> comm)
      : transport_(transport),
        fd_(std::move(fd)),
        mode_(mode),
        comm_(std::move(comm)) {}
  ~NcclConnection() override;

  absl::Status Write(std::span<const WriteOp> ops) override;
  absl::Status Notify(std::string_view message) override;

 private:
  absl::Status WriteFrame(std::span<const WriteOp> ops);
  // Ends the connection after `s`; `pins` stay pinned when the stream
  // cannot be drained (the device may still read them).
  absl::Status Fail(absl::Status s, const std::vector<RegionRange>* pins);

  NcclTransport* const transport_;
  Fd fd_;
  const Mode mode_;
  std::unique_ptr<Comm> comm_;
  bool failed_ = false;
  std::string failure_;
  ControlFrame reply_;
};

class NcclTransport final : public KvTransport {
 public:
  static absl::StatusOr<std::unique_ptr<KvTransport>> Create(
      const TransportOptions& options) {
    PD_ASSIGN_OR_RETURN(const int device, RequireCudaDevice(kName));
    std::string error;
    const NcclApi* nccl = Nccl(&error);
    if (nccl == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat("the nccl KV transport needs libnccl: ", error));
    }
    cudaDeviceProp prop{};
    if (cudaError_t e = cudaGetDeviceProperties(&prop, device);
        e != cudaSuccess) {
      return CudaError(e, "cudaGetDeviceProperties");
    }
    PD_ASSIGN_OR_RETURN(auto listener, ListenTcp(options.listen_address));
    return std::unique_ptr<KvTransport>(new NcclTransport(
        options, *nccl, device, prop.uuid, std::move(listener.first),
        std::move(listener.second)));
  }

  ~NcclTransport() override { server_.reset(); }

  const TransportCapabilities& capabilities() const override { return caps_; }
  std::string endpoint() const override { return endpoint_; }

  absl::StatusOr<RegionId> RegisterMemory(
      std::span<std::byte> memory) override {
    PD_RETURN_IF_ERROR(SetDevice());
    return regions_.Register(memory);
  }
  absl::Status DeregisterMemory(RegionId region) override {
    return regions_.Deregister(region, options_.io_timeout);
  }

  absl::StatusOr<std::unique_ptr<KvConnection>> Connect(
      std::string_view endpoint) override {
    PD_RETURN_IF_ERROR(SetDevice());
    PD_ASSIGN_OR_RETURN(Fd fd, ConnectTcp(endpoint, options_.io_timeout));
    ncclUniqueId id{};
    if (ncclResult_t r = nccl_.get_unique_id(&id); r != ncclSuccess) {
      return NcclError(nccl_, nullptr, r, "ncclGetUniqueId");
    }
    const absl::Time deadline = absl::Now() + options_.io_timeout;
    ControlWriter hello;
    hello.Put<uint64_t>(ProcessNonce());
    hello.PutBytes(std::as_bytes(std::span(uuid_.bytes)));
    hello.PutBytes(std::as_bytes(std::span(id.internal)));
    PD_RETURN_IF_ERROR(SendControl(fd.get(), ControlType::kHello,
                                   kControlVersion, hello.out, deadline));
    ControlFrame reply;
    PD_RETURN_IF_ERROR(
        RecvControl(fd.get(), options_.max_message_bytes, deadline, reply));
    PD_RETURN_IF_ERROR(CheckReply(reply, ControlType::kHelloReply));
    if (reply.value != kTwoRanks && reply.value != kLoopback) {
      return absl::DataLossError("unknown mode from the nccl peer");
    }
    const Mode mode = static_cast<Mode>(reply.value);
    PD_ASSIGN_OR_RETURN(std::unique_ptr<Comm> comm, Comm::Create(nccl_));
    if (mode == kLoopback) {
      PD_RETURN_IF_ERROR(comm->Init(id, 1, 0, deadline));
    } else {
      PD_RETURN_IF_ERROR(comm->Init(id, 2, 0, deadline));
      // The receiver's side of the join.
      PD_RETURN_IF_ERROR(
          RecvControl(fd.get(), options_.max_message_bytes, deadline, reply));
      PD_RETURN_IF_ERROR(CheckReply(reply, ControlType::kAck));
    }
    return std::unique_ptr<KvConnection>(
        new NcclConnection(this, std::move(fd), mode, std::move(comm)));
  }

  absl::StatusOr<Notification> WaitNotification(
      absl::Duration timeout) override {
    return notifications_.Wait(timeout);
  }

  // ---- For NcclConnection. ----
  const TransportOptions& options() const { return options_; }
  DeviceRegionTable& regions() { return regions_; }
  absl::Status SetDevice() const {
    if (cudaError_t e = cudaSetDevice(device_); e != cudaSuccess) {
      return CudaError(e, "cudaSetDevice");
    }
    return absl::OkStatus();
  }

 private:
  NcclTransport(const TransportOptions& options, const NcclApi& nccl,
                int device, cudaUUID_t uuid, Fd listener, std::string endpoint)
      : options_(options),
        nccl_(nccl),
        device_(device),
        uuid_(uuid),
        endpoint_(std::move(endpoint)),
        notifications_(options.max_pending_notifications) {
    server_ = std::make_unique<ControlServer>(
        std::move(listener), ControlServer::Options{},
        [this](const ControlServer& server, Fd fd) {
          Serve(server, fd.get());
        });
  }

  void Serve(const ControlServer& server, int fd) {
    std::unique_ptr<Comm> comm;
    std::vector<RegionRange> pinned;  // Loopback: between GRANT and DONE.
    absl::Status end = SetDevice();
    if (end.ok()) end = ServeRequests(server, fd, comm, pinned);
    if (!pinned.empty()) {
      // A loopback sender that goes away has aborted its communicator
      // first (its connection's destructor), so its copies have ended.
      regions_.Unpin(pinned);
    }
    comm.reset();
    if (!end.ok() && !absl::IsUnavailable(end) && !absl::IsCancelled(end) &&
        !absl::IsDeadlineExceeded(end)) {
      server.Refuse(fd, end, options_.max_message_bytes, options_.io_timeout);
    }
  }

  absl::Status ServeRequests(const ControlServer& server, int fd,
                             std::unique_ptr<Comm>& comm,
                             std::vector<RegionRange>& pinned) {
    ControlFrame frame;
    bool loopback = false;
    while (true) {
      PD_RETURN_IF_ERROR(server.NextFrame(fd, options_.max_message_bytes,
                                          options_.io_timeout, frame));
      const absl::Time deadline = absl::Now() + options_.io_timeout;
      switch (frame.type) {
        case ControlType::kHello: {
          if (comm != nullptr || loopback) {
            return absl::DataLossError("a second HELLO");
          }
          PD_ASSIGN_OR_RETURN(loopback, Join(fd, frame, deadline, comm));
          break;
        }
        case ControlType::kWrite: {
          if (comm == nullptr && !loopback) {
            return absl::DataLossError("WRITE before HELLO");
          }
          if (!pinned.empty()) {
            return absl::DataLossError("WRITE before the last one's DONE");
          }
          PD_ASSIGN_OR_RETURN(std::vector<RegionRange> ranges,
                              DecodeRanges(frame.payload));
          PD_ASSIGN_OR_RETURN(std::vector<std::byte*> addresses,
                              regions_.Pin(ranges));
          if (loopback) {
            pinned = std::move(ranges);
            ControlWriter grant;
            for (std::byte* a : addresses) {
              grant.Put<uint64_t>(reinterpret_cast<uint64_t>(a));
            }
            PD_RETURN_IF_ERROR(
                SendControl(fd, ControlType::kGrant, 0, grant.out, deadline));
            break;
          }
          const absl::Status received = comm->RunGroup(
              ranges.size(),
              [&](size_t i) {
                return ranges[i].length == 0
                           ? ncclSuccess
                           : nccl_.recv(addresses[i], ranges[i].length,
                                        ncclUint8, 0, comm->get(),
                                        comm->stream());
              },
              deadline, "receiving KV",
              [fd] {
                return Readable(fd)
                           ? absl::UnavailableError("the nccl sender went away")
                           : absl::OkStatus();
              });
          if (!received.ok()) {
            // Unpinned only once the device is done with the memory.
            if (comm->AbortAndDrain(options_.io_timeout)) {
              regions_.Unpin(ranges);
            }
            return received;
          }
          regions_.Unpin(ranges);
          PD_RETURN_IF_ERROR(
              SendControl(fd, ControlType::kAck, 0, {}, deadline));
          break;
        }
        case ControlType::kDone:
          if (pinned.empty()) return absl::DataLossError("DONE without GRANT");
          regions_.Unpin(pinned);
          pinned.clear();
          break;
        case ControlType::kNotify:
          if (!pinned.empty()) {
            return absl::DataLossError("NOTIFY before the last WRITE's DONE");
          }
          PD_RETURN_IF_ERROR(notifications_.Push(
              {std::string(reinterpret_cast<const char*>(frame.payload.data()),
                           frame.payload.size())}));
          PD_RETURN_IF_ERROR(
              SendControl(fd, ControlType::kAck, 0, {}, deadline));
          break;
        default:
          return absl::DataLossError(absl::StrCat("unexpected control frame ",
                                                  static_cast<int>(frame.type),
                                                  " from an nccl sender"));
      }
    }
  }

  // Answers a HELLO: loopback (true) for a sender in this process on this
  // device; else joins its communicator as rank 1.
  absl::StatusOr<bool> Join(int fd, const ControlFrame& hello,
                            absl::Time deadline, std::unique_ptr<Comm>& comm) {
    if (hello.value != kControlVersion) {
      return absl::FailedPreconditionError(absl::StrCat(
          "nccl protocol version ", hello.value, " is not ", kControlVersion));
    }
    ControlReader r(hello.payload);
    uint64_t nonce = 0;
    cudaUUID_t uuid{};
    ncclUniqueId id{};
    if (hello.payload.size() != kHelloBytes || !r.Get(nonce) ||
        !r.GetBytes(std::as_writable_bytes(std::span(uuid.bytes))) ||
        !r.GetBytes(std::as_writable_bytes(std::span(id.internal)))) {
      return absl::DataLossError("malformed nccl HELLO");
    }
    const bool same_device =
        std::memcmp(uuid.bytes, uuid_.bytes, kUuidBytes) == 0;
    if (same_device && nonce == ProcessNonce()) {
      PD_RETURN_IF_ERROR(
          SendControl(fd, ControlType::kHelloReply, kLoopback, {}, deadline));
      return true;
    }
    if (same_device) {
      return absl::FailedPreconditionError(
          "the nccl sender runs on this GPU in another process; NCCL cannot "
          "join two processes on one GPU (use cuda_ipc)");
    }
    PD_RETURN_IF_ERROR(
        SendControl(fd, ControlType::kHelloReply, kTwoRanks, {}, deadline));
    PD_ASSIGN_OR_RETURN(comm, Comm::Create(nccl_));
    if (absl::Status s = comm->Init(id, 2, 1, deadline); !s.ok()) {
      comm.reset();
      return s;  // Refused with ERROR: the sender's join fails too.
    }
    PD_RETURN_IF_ERROR(SendControl(fd, ControlType::kAck, 0, {}, deadline));
    return false;
  }

  const TransportOptions options_;
  const NcclApi& nccl_;
  const int device_;
  const cudaUUID_t uuid_;
  const TransportCapabilities caps_{kName, /*device_memory=*/true,
                                    /*one_sided=*/false, /*cross_host=*/true,
                                    /*host_memory=*/false};
  const std::string endpoint_;
  DeviceRegionTable regions_;
  NotificationQueue notifications_;
  std::unique_ptr<ControlServer> server_;  // Last: serves the above.
};

NcclConnection::~NcclConnection() {
  (void)transport_->SetDevice();
  comm_.reset();  // Aborts before the peer sees the socket close.
}

absl::Status NcclConnection::Fail(absl::Status s,
                                  const std::vector<RegionRange>* pins) {
  if (!failed_) {
    failed_ = true;
    failure_ = std::string(s.message());
  }
  const bool drained = comm_ == nullptr ||
                       comm_->AbortAndDrain(transport_->options().io_timeout);
  if (pins != nullptr && drained) transport_->regions().Unpin(*pins);
  fd_.Reset();
  return s;
}

absl::Status NcclConnection::Write(std::span<const WriteOp> ops) {
  if (failed_) {
    return absl::UnavailableError(
        absl::StrCat("connection is closed: ", failure_));
  }
  PD_RETURN_IF_ERROR(transport_->SetDevice());
  for (size_t begin = 0; begin < ops.size(); begin += kMaxOpsPerFrame) {
    PD_RETURN_IF_ERROR(WriteFrame(
        ops.subspan(begin, std::min(kMaxOpsPerFrame, ops.size() - begin))));
  }
  return absl::OkStatus();
}

absl::Status NcclConnection::WriteFrame(std::span<const WriteOp> ops) {
  const std::vector<RegionRange> local_ranges = LocalRanges(ops);
  absl::StatusOr<std::vector<std::byte*>> sources =
      transport_->regions().Pin(local_ranges);
  if (!sources.ok()) {  // The connection stays open.
    return absl::InvalidArgumentError(
        absl::StrCat("local ", sources.status().message()));
  }
  const TransportOptions& options = transport_->options();
  const NcclApi& nccl = comm_->nccl();
  const absl::Time deadline = absl::Now() + options.io_timeout;
  if (absl::Status s = SendControl(fd_.get(), ControlType::kWrite, 0,
                                   EncodeRanges(ops), deadline);
      !s.ok()) {
    return Fail(s, &local_ranges);
  }
  if (mode_ == kLoopback) {
    if (absl::Status s =
            RecvControl(fd_.get(), options.max_message_bytes, deadline, reply_);
        !s.ok()) {
      return Fail(s, &local_ranges);
    }
    if (absl::Status s = CheckReply(reply_, ControlType::kGrant); !s.ok()) {
      return Fail(s, &local_ranges);
    }
    if (reply_.payload.size() != ops.size() * 8) {
      return Fail(absl::DataLossError("malformed GRANT from the nccl peer"),
                  &local_ranges);
    }
    std::vector<void*> destinations(ops.size());
    ControlReader r(reply_.payload);
    for (void*& d : destinations) {
      uint64_t a = 0;
      r.Get(a);
      d = reinterpret_cast<void*>(a);
    }
    // Sends and receives to ourselves, matched in order, in one group.
    if (absl::Status s = comm_->RunGroup(
            2 * ops.size(),
            [&](size_t i) {
              const WriteOp& op = ops[i / 2];
              if (op.length == 0) return ncclSuccess;
              return i % 2 == 0
                         ? nccl.send((*sources)[i / 2], op.length, ncclUint8, 0,
                                     comm_->get(), comm_->stream())
                         : nccl.recv(destinations[i / 2], op.length, ncclUint8,
                                     0, comm_->get(), comm_->stream());
            },
            deadline, "copying KV (loopback)");
        !s.ok()) {
      return Fail(s, &local_ranges);
    }
    transport_->regions().Unpin(local_ranges);
    if (absl::Status s = SendControl(fd_.get(), ControlType::kDone, 0, {},
                                     absl::Now() + options.io_timeout);
        !s.ok()) {
      return Fail(s, nullptr);
    }
    return absl::OkStatus();
  }
  // Two ranks: the receiver's ERROR or ACK may come while the sends run.
  bool answered = false;
  absl::Status answer;
  auto read_answer = [&]() -> absl::Status {
    if (answered || !Readable(fd_.get())) return absl::OkStatus();
    answered = true;
    answer =
        RecvControl(fd_.get(), options.max_message_bytes, deadline, reply_);
    if (answer.ok()) answer = CheckReply(reply_, ControlType::kAck);
    return answer;  // An error ends the wait for the sends.
  };
  if (absl::Status s = comm_->RunGroup(
          ops.size(),
          [&](size_t i) {
            return ops[i].length == 0
                       ? ncclSuccess
                       : nccl.send((*sources)[i], ops[i].length, ncclUint8, 1,
                                   comm_->get(), comm_->stream());
          },
          deadline, "sending KV", read_answer);
      !s.ok()) {
    return Fail(answered && !answer.ok() ? answer : s, &local_ranges);
  }
  transport_->regions().Unpin(local_ranges);
  if (!answered) {
    answer =
        RecvControl(fd_.get(), options.max_message_bytes, deadline, reply_);
    if (answer.ok()) answer = CheckReply(reply_, ControlType::kAck);
  }
  if (!answer.ok()) return Fail(answer, nullptr);
  return absl::OkStatus();
}

absl::Status NcclConnection::Notify(std::string_view message) {
  if (failed_) {
    return absl::UnavailableError(
        absl::StrCat("connection is closed: ", failure_));
  }
  const TransportOptions& options = transport_->options();
  if (message.size() > options.max_message_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "notification of ", message.size(), " bytes exceeds the limit of ",
        options.max_message_bytes));
  }
  const absl::Time deadline = absl::Now() + options.io_timeout;
  absl::Status s = SendControl(
      fd_.get(), ControlType::kNotify, 0,
      std::as_bytes(std::span(message.data(), message.size())), deadline);
  if (s.ok()) {
    s = RecvControl(fd_.get(), options.max_message_bytes, deadline, reply_);
  }
  if (s.ok()) s = CheckReply(reply_, ControlType::kAck);
  return s.ok() ? s : Fail(s, nullptr);
}

}  // namespace

absl::StatusOr<std::unique_ptr<KvTransport>> CreateNcclTransport(
    const TransportOptions& options) {
  return NcclTransport::Create(options);
}

}  // namespace pdserve::kv
