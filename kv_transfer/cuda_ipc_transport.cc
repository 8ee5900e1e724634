// "cuda_ipc": KV writes between two workers on one node as device-to-device
// copies. The receiving (decode) side registers its device KV pool and
// exports it with cudaIpcGetMemHandle; the sending (prefill) side maps it
// once with cudaIpcOpenMemHandle and copies into it with cudaMemcpyAsync on
// a stream of its own. Works for two processes on one GPU and across the
// GPUs of a node (peer access is enabled lazily by the mapping).
//
// Why cudaIpcGetMemHandle and not cuMemExportToShareableHandle with a file
// descriptor: the engine's KV pool is one cudaMalloc (engine/cuda), and
// shareable handles exist only for memory made with cuMemCreate. A legacy
// IPC handle names the whole allocation, so a region carries its offset in
// it (cuMemGetAddressRange), and regions of one allocation share one
// mapping (a process can open a handle only once).
//
// The endpoint is a Unix-domain socket, "unix:@name" (abstract, the
// default: a name picked from the pid) or "unix:/path" (TransportOptions::
// listen_address, when it starts with "unix:"; needed between containers
// that share a directory but not a network namespace). Only processes of
// the same user (or root) are served: a peer that connects gets write
// access to the KV pool.
//
// Control protocol (control_channel.h frames on the socket):
//   HELLO / HELLO_REPLY   version check
//   WRITE    the remote ranges of up to kMaxOpsPerFrame ops
//   GRANT    the receiver checked every range against its regions and
//            pinned them (DeregisterMemory waits); the payload revokes
//            regions deregistered since the last reply and describes each
//            region the sender has not seen yet (IPC handle, offset in
//            its allocation, size, address): handles travel once per
//            region and connection
//   DONE     the sender's copies finished (a CUDA event it waited for):
//            the receiver unpins
//   NOTIFY / ACK   a notification, queued; it follows the DONE of every
//            write before it, so it is ordered after their bytes
//   ERROR    a refusal (NOT_FOUND, OUT_OF_RANGE, ...); the connection ends
//
// A write needs the receiver's CPU for its grant (one_sided is false):
// that is what makes revocation safe, since no copy starts into a region
// that is not pinned. The sender keeps its mappings of a revoked region
// until its next exchange with the peer; the driver keeps the memory of
// an open mapping alive, and nothing is copied into it without a grant.
//
// A copy that does not finish within io_timeout fails the Write with
// DEADLINE_EXCEEDED; the connection then keeps its socket (the receiver
// keeps its pins) until the copy has finished, since a copy cannot be
// cancelled.
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kv_transfer/control_channel.h"
#include "kv_transfer/cuda_common.h"
#include "kv_transfer/region_table.h"
#include "kv_transfer/socket_io.h"
#include "kv_transfer/transports.h"

namespace pdserve::kv {
namespace {

constexpr char kName[] = "cuda_ipc";
// Revoked region ids carried by one reply (the rest go in later ones).
constexpr size_t kMaxRevokesPerReply = 8192;
constexpr size_t kDescriptorBytes =
    4 + 4 + 8 + 8 + 8 + sizeof(cudaIpcMemHandle_t);
static_assert(4 + kMaxRevokesPerReply * 4 + 4 +
                  kMaxOpsPerFrame * kDescriptorBytes <=
              kMaxControlPayload);

// What a sender needs to write into one of the receiver's regions.
struct RegionDescriptor {
  uint32_t region = 0;
  uint64_t size = 0;
  uint64_t offset_in_allocation = 0;
  uint64_t address = 0;  // In the receiver's address space.
  cudaIpcMemHandle_t handle{};
};

void PutDescriptor(const RegionDescriptor& d, ControlWriter& w) {
  w.Put<uint32_t>(d.region);
  w.Put<uint32_t>(0);
  w.Put<uint64_t>(d.size);
  w.Put<uint64_t>(d.offset_in_allocation);
  w.Put<uint64_t>(d.address);
  w.PutBytes(std::as_bytes(std::span(d.handle.reserved)));
}

bool GetDescriptor(ControlReader& r, RegionDescriptor& d) {
  uint32_t zero = 0;
  return r.Get(d.region) && r.Get(zero) && zero == 0 && r.Get(d.size) &&
         r.Get(d.offset_in_allocation) && r.Get(d.address) &&
         r.GetBytes(std::as_writable_bytes(std::span(d.handle.reserved)));
}

// The payload of GRANT and ACK: u32 count, revoked region ids; u32 count,
// descriptors.
struct ReplyPayload {
  std::vector<uint32_t> revoked;
  std::vector<RegionDescriptor> described;
};

std::vector<std::byte> EncodeReply(const ReplyPayload& p) {
  ControlWriter w;
  w.Put<uint32_t>(static_cast<uint32_t>(p.revoked.size()));
  for (uint32_t id : p.revoked) w.Put<uint32_t>(id);
  w.Put<uint32_t>(static_cast<uint32_t>(p.described.size()));
  for (const RegionDescriptor& d : p.described) PutDescriptor(d, w);
  return std::move(w.out);
}

absl::StatusOr<ReplyPayload> DecodeReply(std::span<const std::byte> payload) {
  ControlReader r(payload);
  ReplyPayload p;
  uint32_t revoked = 0, described = 0;
  if (!r.Get(revoked) || revoked > kMaxRevokesPerReply ||
      r.left() < size_t{revoked} * 4) {
    return absl::DataLossError("malformed reply from the cuda_ipc peer");
  }
  p.revoked.resize(revoked);
  for (uint32_t& id : p.revoked) r.Get(id);
  if (!r.Get(described) || described > kMaxOpsPerFrame ||
      r.left() != size_t{described} * kDescriptorBytes) {
    return absl::DataLossError("malformed reply from the cuda_ipc peer");
  }
  p.described.resize(described);
  for (RegionDescriptor& d : p.described) {
    if (!GetDescriptor(r, d)) {
      return absl::DataLossError("malformed region from the cuda_ipc peer");
    }
  }
  return p;
}

std::string HandleKey(const cudaIpcMemHandle_t& h) {
  return std::string(h.reserved, sizeof(h.reserved));
}

// The IPC mappings open in this process, shared by every connection (a
// process can open a handle only once), closed with their last user.
class IpcMappings {
 public:
  static IpcMappings& Get() {
    static auto* mappings = new IpcMappings();
    return *mappings;
  }

  // The mapped allocation's base and size in this process. Requires the
  // caller's device to be current.
  absl::StatusOr<DeviceAllocation> Open(const cudaIpcMemHandle_t& handle) {
    absl::MutexLock lock(&mu_);
    auto it = open_.find(HandleKey(handle));
    if (it != open_.end()) {
      ++it->second.users;
      return it->second.allocation;
    }
    void* base = nullptr;
    if (cudaError_t e =
            cudaIpcOpenMemHandle(&base, handle, cudaIpcMemLazyEnablePeerAccess);
        e != cudaSuccess) {
      return CudaError(e, "cudaIpcOpenMemHandle");
    }
    absl::StatusOr<DeviceAllocation> a = FindDeviceAllocation(base);
    if (!a.ok() || a->base != base) {
      cudaIpcCloseMemHandle(base);
      return absl::InternalError("an opened IPC mapping has no allocation");
    }
    open_[HandleKey(handle)] = Mapping{*a, 1};
    return *a;
  }

  void Close(const cudaIpcMemHandle_t& handle) {
    absl::MutexLock lock(&mu_);
    auto it = open_.find(HandleKey(handle));
    if (it == open_.end() || --it->second.users > 0) return;
    if (cudaError_t e = cudaIpcCloseMemHandle(it->second.allocation.base);
        e != cudaSuccess) {
      cudaGetLastError();  // Nothing more to do: the mapping is gone to us.
    }
    open_.erase(it);
  }

 private:
  struct Mapping {
    DeviceAllocation allocation;
    int users = 0;
  };
  absl::Mutex mu_;
  std::map<std::string, Mapping> open_ ABSL_GUARDED_BY(mu_);
};

class CudaIpcTransport;

class CudaIpcConnection final : public KvConnection {
 public:
  CudaIpcConnection(CudaIpcTransport* transport, Fd fd, bool same_process,
                    cudaStream_t stream, cudaEvent_t event)
      : transport_(transport),
        fd_(std::move(fd)),
        same_process_(same_process),
        stream_(stream),
        event_(event) {}
  ~CudaIpcConnection() override;

  absl::Status Write(std::span<const WriteOp> ops) override;
  absl::Status Notify(std::string_view message) override;

 private:
  struct Remote {
    std::byte* address = nullptr;  // The region's start, in this process.
    uint64_t size = 0;
    bool mapped = false;  // Through IpcMappings (else the peer is us).
    cudaIpcMemHandle_t handle{};
  };

  absl::Status WriteFrame(std::span<const WriteOp> ops);
  absl::Status ApplyReply(std::span<const std::byte> payload);
  absl::Status Fail(absl::Status s);
  void ForgetRemote(uint32_t region);

  CudaIpcTransport* const transport_;
  Fd fd_;
  const bool same_process_;
  const cudaStream_t stream_;
  const cudaEvent_t event_;
  bool failed_ = false;
  std::string failure_;
  // A copy outlived its Write: the socket, mappings and local pins stay
  // until it has finished (the destructor waits, bounded).
  bool copy_in_flight_ = false;
  std::vector<RegionRange> copy_pins_;
  std::map<uint32_t, Remote> remote_;
  ControlFrame reply_;  // Reused.
};

class CudaIpcTransport final : public KvTransport {
 public:
  static absl::StatusOr<std::unique_ptr<KvTransport>> Create(
      const TransportOptions& options) {
    PD_ASSIGN_OR_RETURN(const int device, RequireCudaDevice(kName));
    std::string endpoint = options.listen_address;
    if (!endpoint.starts_with("unix:")) {
      static std::atomic<uint64_t> next{0};
      std::random_device rd;
      endpoint = absl::StrCat("unix:@pdserve-kv-", ::getpid(), "-",
                              next.fetch_add(1), "-", rd() % 1000000);
    }
    PD_ASSIGN_OR_RETURN(Fd listener, ListenUnix(endpoint));
    return std::unique_ptr<KvTransport>(new CudaIpcTransport(
        options, device, std::move(listener), std::move(endpoint)));
  }

  ~CudaIpcTransport() override {
    server_.reset();  // Joins every serving thread.
    if (const std::string_view e = endpoint_; e.starts_with("unix:/")) {
      ::unlink(std::string(e.substr(5)).c_str());
    }
  }

  const TransportCapabilities& capabilities() const override { return caps_; }
  std::string endpoint() const override { return endpoint_; }

  absl::StatusOr<RegionId> RegisterMemory(
      std::span<std::byte> memory) override {
    PD_RETURN_IF_ERROR(SetDevice());
    PD_ASSIGN_OR_RETURN(const RegionId id, regions_.Register(memory));
    // Exported now, so that a failure is known before a peer asks; a
    // region that cannot be exported still serves as a local source.
    Export e;
    absl::StatusOr<DeviceAllocation> a = FindDeviceAllocation(memory.data());
    if (!a.ok()) {
      e.status = a.status();
    } else if (cudaError_t err = cudaIpcGetMemHandle(&e.d.handle, a->base);
               err != cudaSuccess) {
      e.status = CudaError(err, "cudaIpcGetMemHandle");
    } else {
      e.d.region = id.value;
      e.d.size = memory.size();
      e.d.offset_in_allocation = static_cast<uint64_t>(memory.data() - a->base);
      e.d.address = reinterpret_cast<uint64_t>(memory.data());
    }
    absl::MutexLock lock(&mu_);
    exports_[id.value] = std::move(e);
    return id;
  }

  absl::Status DeregisterMemory(RegionId region) override {
    PD_RETURN_IF_ERROR(regions_.Deregister(region, options_.io_timeout));
    absl::MutexLock lock(&mu_);
    exports_.erase(region.value);
    for (auto& [id, peer] : peers_) {
      if (peer.described.erase(region.value) > 0) {
        peer.revoked.push_back(region.value);
      }
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::unique_ptr<KvConnection>> Connect(
      std::string_view endpoint) override {
    PD_RETURN_IF_ERROR(SetDevice());
    PD_ASSIGN_OR_RETURN(Fd fd, ConnectUnix(endpoint, options_.io_timeout));
    ucred peer{};
    socklen_t len = sizeof(peer);
    if (::getsockopt(fd.get(), SOL_SOCKET, SO_PEERCRED, &peer, &len) != 0) {
      return absl::UnavailableError("cannot identify the cuda_ipc peer");
    }
    const absl::Time deadline = absl::Now() + options_.io_timeout;
    PD_RETURN_IF_ERROR(SendControl(fd.get(), ControlType::kHello,
                                   kControlVersion, {}, deadline));
    ControlFrame reply;
    PD_RETURN_IF_ERROR(
        RecvControl(fd.get(), options_.max_message_bytes, deadline, reply));
    PD_RETURN_IF_ERROR(CheckReply(reply, ControlType::kHelloReply));
    cudaStream_t stream = nullptr;
    if (cudaError_t e =
            cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
        e != cudaSuccess) {
      return CudaError(e, "cudaStreamCreateWithFlags");
    }
    cudaEvent_t event = nullptr;
    if (cudaError_t e =
            cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
        e != cudaSuccess) {
      cudaStreamDestroy(stream);
      return CudaError(e, "cudaEventCreateWithFlags");
    }
    return std::unique_ptr<KvConnection>(new CudaIpcConnection(
        this, std::move(fd), peer.pid == ::getpid(), stream, event));
  }

  absl::StatusOr<Notification> WaitNotification(
      absl::Duration timeout) override {
    return notifications_.Wait(timeout);
  }

  // ---- For CudaIpcConnection. ----
  const TransportOptions& options() const { return options_; }
  DeviceRegionTable& regions() { return regions_; }
  absl::Status SetDevice() const {
    if (cudaError_t e = cudaSetDevice(device_); e != cudaSuccess) {
      return CudaError(e, "cudaSetDevice");
    }
    return absl::OkStatus();
  }

 private:
  struct Export {
    absl::Status status;  // Why the region cannot be exported.
    RegionDescriptor d;
  };
  // A connected sender, as its serving thread and DeregisterMemory see it.
  struct PeerState {
    std::set<uint32_t> described;   // Regions whose handles it has.
    std::vector<uint32_t> revoked;  // To tell it in the next reply.
  };

  CudaIpcTransport(const TransportOptions& options, int device, Fd listener,
                   std::string endpoint)
      : options_(options),
        device_(device),
        endpoint_(std::move(endpoint)),
        notifications_(options.max_pending_notifications) {
    ControlServer::Options o;
    o.admit = [](int fd) {
      ucred peer{};
      socklen_t len = sizeof(peer);
      return ::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &peer, &len) == 0 &&
             (peer.uid == ::geteuid() || peer.uid == 0);
    };
    server_ = std::make_unique<ControlServer>(
        std::move(listener), std::move(o),
        [this](const ControlServer& server, Fd fd) {
          Serve(server, fd.get());
        });
  }

  // One sender's requests, in order. Its pins are released when it
  // reports DONE or goes away.
  void Serve(const ControlServer& server, int fd) {
    uint64_t id = 0;
    {
      absl::MutexLock lock(&mu_);
      id = next_peer_++;
      peers_[id];
    }
    std::vector<RegionRange> pinned;
    const absl::Status end = ServeRequests(server, fd, id, pinned);
    regions_.Unpin(pinned);
    {
      absl::MutexLock lock(&mu_);
      peers_.erase(id);
    }
    if (!end.ok() && !absl::IsUnavailable(end) && !absl::IsCancelled(end) &&
        !absl::IsDeadlineExceeded(end)) {
      server.Refuse(fd, end, options_.max_message_bytes, options_.io_timeout);
    }
  }

  // Returns why the connection ends: a status to refuse the peer with, or
  // UNAVAILABLE / CANCELLED / DEADLINE_EXCEEDED to just close.
  absl::Status ServeRequests(const ControlServer& server, int fd, uint64_t id,
                             std::vector<RegionRange>& pinned) {
    ControlFrame frame;
    const uint32_t max_message = options_.max_message_bytes;
    while (true) {
      PD_RETURN_IF_ERROR(
          server.NextFrame(fd, max_message, options_.io_timeout, frame));
      const absl::Time deadline = absl::Now() + options_.io_timeout;
      switch (frame.type) {
        case ControlType::kHello:
          if (frame.value != kControlVersion) {
            return absl::FailedPreconditionError(
                absl::StrCat("cuda_ipc protocol version ", frame.value,
                             " is not ", kControlVersion));
          }
          PD_RETURN_IF_ERROR(
              SendControl(fd, ControlType::kHelloReply, 0, {}, deadline));
          break;
        case ControlType::kWrite: {
          if (!pinned.empty()) {
            return absl::DataLossError("WRITE before the last one's DONE");
          }
          PD_ASSIGN_OR_RETURN(std::vector<RegionRange> ranges,
                              DecodeRanges(frame.payload));
          PD_RETURN_IF_ERROR(regions_.Pin(ranges).status());
          pinned = std::move(ranges);
          absl::StatusOr<std::vector<std::byte>> reply = Reply(id, pinned);
          if (!reply.ok()) return reply.status();
          PD_RETURN_IF_ERROR(
              SendControl(fd, ControlType::kGrant, 0, *reply, deadline));
          break;
        }
        case ControlType::kDone:
          if (pinned.empty())
            return absl::DataLossError("DONE without a WRITE");
          regions_.Unpin(pinned);
          pinned.clear();
          break;
        case ControlType::kNotify: {
          if (!pinned.empty()) {
            return absl::DataLossError("NOTIFY before the last WRITE's DONE");
          }
          PD_RETURN_IF_ERROR(notifications_.Push(
              {std::string(reinterpret_cast<const char*>(frame.payload.data()),
                           frame.payload.size())}));
          PD_ASSIGN_OR_RETURN(const std::vector<std::byte> reply,
                              Reply(id, {}));
          PD_RETURN_IF_ERROR(
              SendControl(fd, ControlType::kAck, 0, reply, deadline));
          break;
        }
        default:
          return absl::DataLossError(absl::StrCat("unexpected control frame ",
                                                  static_cast<int>(frame.type),
                                                  " from a cuda_ipc sender"));
      }
    }
  }

  // A GRANT or ACK payload for peer `id`: pending revocations, and the
  // regions of `ranges` it has not been told of. NOT_FOUND for a region
  // that cannot be exported.
  absl::StatusOr<std::vector<std::byte>> Reply(
      uint64_t id, std::span<const RegionRange> ranges) {
    absl::MutexLock lock(&mu_);
    PeerState& peer = peers_[id];
    ReplyPayload p;
    const size_t revokes = std::min(peer.revoked.size(), kMaxRevokesPerReply);
    p.revoked.assign(peer.revoked.begin(), peer.revoked.begin() + revokes);
    std::set<uint32_t> fresh;
    for (const RegionRange& r : ranges) {
      if (peer.described.contains(r.region) || !fresh.insert(r.region).second)
        continue;
      auto it = exports_.find(r.region);
      if (it == exports_.end()) {
        return absl::NotFoundError(
            absl::StrCat("unknown memory region ", r.region));
      }
      if (!it->second.status.ok()) {
        return absl::NotFoundError(
            absl::StrCat("memory region ", r.region,
                         " cannot be exported: ", it->second.status.message()));
      }
      p.described.push_back(it->second.d);
    }
    peer.revoked.erase(peer.revoked.begin(), peer.revoked.begin() + revokes);
    peer.described.insert(fresh.begin(), fresh.end());
    return EncodeReply(p);
  }

  const TransportOptions options_;
  const int device_;
  const TransportCapabilities caps_{kName, /*device_memory=*/true,
                                    /*one_sided=*/false, /*cross_host=*/false,
                                    /*host_memory=*/false};
  const std::string endpoint_;
  DeviceRegionTable regions_;
  NotificationQueue notifications_;
  absl::Mutex mu_;
  std::map<uint32_t, Export> exports_ ABSL_GUARDED_BY(mu_);
  uint64_t next_peer_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<uint64_t, PeerState> peers_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<ControlServer> server_;  // Last: serves the above.
};

CudaIpcConnection::~CudaIpcConnection() {
  (void)transport_->SetDevice();
  if (copy_in_flight_ &&
      !WaitForEvent(event_, absl::Now() + transport_->options().io_timeout,
                    "a timed-out KV copy")
           .ok()) {
    // The device has not finished a copy into the peer's memory after two
    // timeouts: keep what it uses (socket, pins, mappings) for the life of
    // the process rather than let the peer reuse the memory under it.
    (void)fd_.Release();
    cudaEventDestroy(event_);
    cudaStreamDestroy(stream_);
    return;
  }
  transport_->regions().Unpin(copy_pins_);
  for (auto& [id, r] : remote_) {
    if (r.mapped) IpcMappings::Get().Close(r.handle);
  }
  cudaEventDestroy(event_);
  cudaStreamDestroy(stream_);
}

absl::Status CudaIpcConnection::Fail(absl::Status s) {
  if (!failed_) {
    failed_ = true;
    failure_ = std::string(s.message());
  }
  if (!copy_in_flight_) fd_.Reset();
  return s;
}

void CudaIpcConnection::ForgetRemote(uint32_t region) {
  auto it = remote_.find(region);
  if (it == remote_.end()) return;
  if (it->second.mapped) IpcMappings::Get().Close(it->second.handle);
  remote_.erase(it);
}

// Revocations, then the regions described for the first time.
absl::Status CudaIpcConnection::ApplyReply(std::span<const std::byte> payload) {
  PD_ASSIGN_OR_RETURN(ReplyPayload p, DecodeReply(payload));
  for (uint32_t region : p.revoked) ForgetRemote(region);
  for (const RegionDescriptor& d : p.described) {
    if (remote_.contains(d.region)) {
      return absl::DataLossError(absl::StrCat(
          "the cuda_ipc peer described region ", d.region, " twice"));
    }
    Remote r;
    r.size = d.size;
    r.handle = d.handle;
    if (same_process_) {
      r.address = reinterpret_cast<std::byte*>(d.address);  // Our own memory.
    } else {
      PD_ASSIGN_OR_RETURN(const DeviceAllocation a,
                          IpcMappings::Get().Open(d.handle));
      r.mapped = true;
      if (d.offset_in_allocation > a.size ||
          d.size > a.size - d.offset_in_allocation) {
        IpcMappings::Get().Close(d.handle);
        return absl::DataLossError(absl::StrCat("cuda_ipc region ", d.region,
                                                " runs past its allocation"));
      }
      r.address = a.base + d.offset_in_allocation;
    }
    remote_[d.region] = r;
  }
  return absl::OkStatus();
}

absl::Status CudaIpcConnection::Write(std::span<const WriteOp> ops) {
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

absl::Status CudaIpcConnection::WriteFrame(std::span<const WriteOp> ops) {
  const std::vector<RegionRange> local_ranges = LocalRanges(ops);
  absl::StatusOr<std::vector<std::byte*>> sources =
      transport_->regions().Pin(local_ranges);
  if (!sources.ok()) {  // The connection stays open.
    return absl::InvalidArgumentError(
        absl::StrCat("local ", sources.status().message()));
  }
  struct Unpin {
    DeviceRegionTable& table;
    const std::vector<RegionRange>& ranges;
    bool armed = true;
    ~Unpin() {
      if (armed) table.Unpin(ranges);
    }
  } unpin{transport_->regions(), local_ranges};

  const TransportOptions& options = transport_->options();
  const absl::Time deadline = absl::Now() + options.io_timeout;
  if (absl::Status s = SendControl(fd_.get(), ControlType::kWrite, 0,
                                   EncodeRanges(ops), deadline);
      !s.ok()) {
    return Fail(s);
  }
  if (absl::Status s =
          RecvControl(fd_.get(), options.max_message_bytes, deadline, reply_);
      !s.ok()) {
    return Fail(s);
  }
  // From here the peer holds our ranges pinned until DONE or the close.
  if (absl::Status s = CheckReply(reply_, ControlType::kGrant); !s.ok()) {
    return Fail(s);
  }
  if (absl::Status s = ApplyReply(reply_.payload); !s.ok()) return Fail(s);

  // Every destination, checked against what the peer described, before
  // anything is copied.
  std::vector<std::byte*> destinations(ops.size(), nullptr);
  for (size_t i = 0; i < ops.size(); ++i) {
    const WriteOp& op = ops[i];
    auto it = remote_.find(op.remote_region.value);
    if (it == remote_.end() || op.remote_offset > it->second.size ||
        op.length > it->second.size - op.remote_offset) {
      return Fail(absl::DataLossError(
          "the cuda_ipc peer granted a range it did not describe"));
    }
    destinations[i] = it->second.address + op.remote_offset;
  }
  // One copy per run of ops that continue each other on both sides.
  cudaError_t launch = cudaSuccess;
  std::byte *run_src = nullptr, *run_dst = nullptr;
  size_t run_bytes = 0;
  auto flush_run = [&] {
    if (run_bytes > 0 && launch == cudaSuccess) {
      launch = cudaMemcpyAsync(run_dst, run_src, run_bytes,
                               cudaMemcpyDeviceToDevice, stream_);
    }
    run_bytes = 0;
  };
  for (size_t i = 0; i < ops.size() && launch == cudaSuccess; ++i) {
    if (ops[i].length == 0) continue;
    std::byte* src = (*sources)[i];
    if (run_bytes > 0 && run_src + run_bytes == src &&
        run_dst + run_bytes == destinations[i]) {
      run_bytes += ops[i].length;
      continue;
    }
    flush_run();
    run_src = src;
    run_dst = destinations[i];
    run_bytes = ops[i].length;
  }
  flush_run();
  // Whatever was launched is waited for, even after a failed launch.
  if (cudaError_t e = cudaEventRecord(event_, stream_); e != cudaSuccess) {
    cudaStreamSynchronize(stream_);
    return Fail(CudaError(e, "cudaEventRecord"));
  }
  const absl::Status copied =
      WaitForEvent(event_, absl::Now() + options.io_timeout,
                   "copying KV into the cuda_ipc peer's memory");
  if (absl::IsDeadlineExceeded(copied)) {
    copy_in_flight_ = true;  // Keeps the socket: the peer keeps its pins.
    unpin.armed = false;
    copy_pins_ = local_ranges;
    return Fail(copied);
  }
  if (!copied.ok()) return Fail(copied);
  if (launch != cudaSuccess) return Fail(CudaError(launch, "cudaMemcpyAsync"));
  if (absl::Status s = SendControl(fd_.get(), ControlType::kDone, 0, {},
                                   absl::Now() + options.io_timeout);
      !s.ok()) {
    return Fail(s);
  }
  return absl::OkStatus();
}

absl::Status CudaIpcConnection::Notify(std::string_view message) {
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
  PD_RETURN_IF_ERROR(transport_->SetDevice());  // Revocations unmap.
  const absl::Time deadline = absl::Now() + options.io_timeout;
  if (absl::Status s = SendControl(
          fd_.get(), ControlType::kNotify, 0,
          std::as_bytes(std::span(message.data(), message.size())), deadline);
      !s.ok()) {
    return Fail(s);
  }
  if (absl::Status s =
          RecvControl(fd_.get(), options.max_message_bytes, deadline, reply_);
      !s.ok()) {
    return Fail(s);
  }
  if (absl::Status s = CheckReply(reply_, ControlType::kAck); !s.ok()) {
    return Fail(s);
  }
  if (absl::Status s = ApplyReply(reply_.payload); !s.ok()) return Fail(s);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<KvTransport>> CreateCudaIpcTransport(
    const TransportOptions& options) {
  return CudaIpcTransport::Create(options);
}

}  // namespace pdserve::kv
