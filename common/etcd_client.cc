#include "common/etcd_client.h"

#include <cmath>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace pdserve {
namespace {

namespace pb = ::etcdserverpb;

absl::Status FromGrpc(const grpc::Status& s, const std::string& what) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                      absl::StrCat("etcd ", what, ": ", s.error_message()));
}

// The end of the key range that holds exactly the keys starting with
// `prefix`: the prefix with its last byte below 0xff incremented (and the
// bytes after it dropped); "\0" (every key) when there is none.
std::string PrefixEnd(const std::string& prefix) {
  std::string end = prefix;
  while (!end.empty()) {
    unsigned char& last = reinterpret_cast<unsigned char&>(end.back());
    if (last < 0xff) {
      ++last;
      return end;
    }
    end.pop_back();
  }
  return std::string(1, '\0');
}

bool Unreachable(const grpc::Status& s) {
  return s.error_code() == grpc::StatusCode::UNAVAILABLE ||
         s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
}

std::shared_ptr<grpc::Channel> MakeChannel(
    const std::string& address, std::shared_ptr<grpc::ChannelCredentials> tls) {
  grpc::ChannelArguments args;
  // A watch must notice a peer that vanished without closing its socket
  // (a partition). etcd refuses pings more often than every 5 s.
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 10000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 5000);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 200);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 200);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
  return grpc::CreateCustomChannel(
      address, tls != nullptr ? tls : grpc::InsecureChannelCredentials(), args);
}

}  // namespace

std::vector<std::string> EtcdClient::SplitEndpoints(const std::string& list) {
  std::vector<std::string> out;
  for (absl::string_view e : absl::StrSplit(list, ',', absl::SkipWhitespace())) {
    out.emplace_back(absl::StripAsciiWhitespace(e));
  }
  return out;
}

absl::StatusOr<std::unique_ptr<EtcdClient>> EtcdClient::Create(const Options& options) {
  if (options.endpoints.empty()) {
    return absl::InvalidArgumentError("etcd: no endpoint given (e.g. http://127.0.0.1:2379)");
  }
  if (options.call_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("etcd: call_timeout must be positive");
  }
  std::unique_ptr<EtcdClient> client(new EtcdClient(options));
  for (const std::string& raw : options.endpoints) {
    absl::string_view e = raw;
    if (absl::ConsumePrefix(&e, "https://") && options.tls == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "etcd endpoint '", raw,
          "' is https:// but no TLS identity is given: set --etcd_cert_file, "
          "--etcd_key_file and --etcd_ca_file"));
    }
    if (absl::ConsumePrefix(&e, "http://") && options.tls != nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "etcd endpoint '", raw,
          "' is plaintext (http://) but the --etcd_*_file TLS flags are set: use https://"));
    }
    absl::ConsumeSuffix(&e, "/");
    const size_t colon = e.rfind(':');
    if (e.empty() || colon == absl::string_view::npos || colon == 0 ||
        colon + 1 == e.size() || e.find('/') != absl::string_view::npos) {
      return absl::InvalidArgumentError(absl::StrCat(
          "etcd endpoint '", raw, "' is not http://host:port"));
    }
    Endpoint endpoint;
    endpoint.address = std::string(e);
    endpoint.channel = MakeChannel(endpoint.address, options.tls);
    endpoint.kv = pb::KV::NewStub(endpoint.channel);
    endpoint.lease = pb::Lease::NewStub(endpoint.channel);
    client->endpoints_.push_back(std::move(endpoint));
  }
  return client;
}

void EtcdClient::SetDeadline(grpc::ClientContext& context) const {
  context.set_deadline(absl::ToChronoTime(absl::Now() + options_.call_timeout));
}

template <typename Call>
grpc::Status EtcdClient::CallWithFailover(Call call) {
  const size_t n = endpoints_.size();
  const size_t first = current_.load();
  grpc::Status status;
  for (size_t k = 0; k < n; ++k) {
    const size_t i = (first + k) % n;
    status = call(endpoints_[i]);
    if (!Unreachable(status)) {
      current_.store(i);
      return status;
    }
  }
  return status;
}

std::string EtcdClient::current_endpoint() const {
  return endpoints_[current_.load() % endpoints_.size()].address;
}

absl::Status EtcdClient::Put(const std::string& key, const std::string& value,
                             int64_t lease) {
  pb::PutRequest request;
  request.set_key(key);
  request.set_value(value);
  request.set_lease(lease);
  pb::PutResponse response;
  return FromGrpc(CallWithFailover([&](Endpoint& e) {
                    grpc::ClientContext context;
                    SetDeadline(context);
                    return e.kv->Put(&context, request, &response);
                  }),
                  absl::StrCat("put ", key));
}

absl::Status EtcdClient::Delete(const std::string& key) {
  pb::DeleteRangeRequest request;
  request.set_key(key);
  pb::DeleteRangeResponse response;
  return FromGrpc(CallWithFailover([&](Endpoint& e) {
                    grpc::ClientContext context;
                    SetDeadline(context);
                    return e.kv->DeleteRange(&context, request, &response);
                  }),
                  absl::StrCat("delete ", key));
}

absl::StatusOr<EtcdClient::Listing> EtcdClient::List(const std::string& prefix) {
  pb::RangeRequest request;
  request.set_key(prefix);
  request.set_range_end(PrefixEnd(prefix));
  pb::RangeResponse response;
  const grpc::Status s = CallWithFailover([&](Endpoint& e) {
    grpc::ClientContext context;
    SetDeadline(context);
    return e.kv->Range(&context, request, &response);
  });
  if (!s.ok()) return FromGrpc(s, absl::StrCat("list ", prefix));
  Listing listing;
  listing.revision = response.header().revision();
  for (const pb::KeyValue& kv : response.kvs()) {
    listing.kvs.push_back({.key = kv.key(),
                           .value = kv.value(),
                           .mod_revision = kv.mod_revision(),
                           .lease = kv.lease()});
  }
  return listing;
}

absl::StatusOr<int64_t> EtcdClient::GrantLease(absl::Duration ttl) {
  pb::LeaseGrantRequest request;
  request.set_ttl(std::max<int64_t>(1, static_cast<int64_t>(std::ceil(absl::ToDoubleSeconds(ttl)))));
  pb::LeaseGrantResponse response;
  const grpc::Status s = CallWithFailover([&](Endpoint& e) {
    grpc::ClientContext context;
    SetDeadline(context);
    return e.lease->LeaseGrant(&context, request, &response);
  });
  if (!s.ok()) return FromGrpc(s, "lease grant");
  if (!response.error().empty()) {
    return absl::UnavailableError(absl::StrCat("etcd lease grant: ", response.error()));
  }
  return response.id();
}

absl::StatusOr<absl::Duration> EtcdClient::KeepAlive(int64_t lease) {
  pb::LeaseKeepAliveRequest request;
  request.set_id(lease);
  pb::LeaseKeepAliveResponse response;
  bool answered = false;
  const grpc::Status s = CallWithFailover([&](Endpoint& e) {
    grpc::ClientContext context;
    SetDeadline(context);
    auto stream = e.lease->LeaseKeepAlive(&context);
    answered = stream->Write(request) && stream->Read(&response);
    stream->WritesDone();
    if (answered) {
      context.TryCancel();  // One round trip is all this call wants.
      stream->Finish().IgnoreError();
      return grpc::Status::OK;
    }
    return stream->Finish();
  });
  if (!s.ok()) return FromGrpc(s, "lease keep-alive");
  if (!answered) return absl::UnavailableError("etcd lease keep-alive: no answer");
  if (response.ttl() <= 0) {
    return absl::NotFoundError(absl::StrCat("etcd lease ", lease, " has expired"));
  }
  return absl::Seconds(response.ttl());
}

absl::Status EtcdClient::RevokeLease(int64_t lease) {
  pb::LeaseRevokeRequest request;
  request.set_id(lease);
  pb::LeaseRevokeResponse response;
  return FromGrpc(CallWithFailover([&](Endpoint& e) {
                    grpc::ClientContext context;
                    SetDeadline(context);
                    return e.lease->LeaseRevoke(&context, request, &response);
                  }),
                  "lease revoke");
}

absl::StatusOr<std::unique_ptr<EtcdWatch>> EtcdClient::Watch(const std::string& prefix,
                                                            int64_t start_revision) {
  // A watch is one long stream: it goes to the first endpoint that accepts
  // it, the current one first.
  absl::Status last;
  const size_t n = endpoints_.size();
  const size_t first = current_.load();
  for (size_t k = 0; k < n; ++k) {
    const Endpoint& e = endpoints_[(first + k) % n];
    std::unique_ptr<EtcdWatch> watch(new EtcdWatch());
    watch->channel_ = e.channel;
    watch->stub_ = pb::Watch::NewStub(e.channel);
    // Only the creation is bounded by the call timeout: once created the
    // stream runs until cancelled, and keep-alive pings find a dead peer.
    if (!e.channel->WaitForConnected(
            absl::ToChronoTime(absl::Now() + options_.call_timeout))) {
      last = absl::UnavailableError(absl::StrCat("etcd watch: cannot reach ", e.address));
      continue;
    }
    watch->stream_ = watch->stub_->Watch(&watch->context_);
    pb::WatchRequest request;
    pb::WatchCreateRequest* create = request.mutable_create_request();
    create->set_key(prefix);
    create->set_range_end(PrefixEnd(prefix));
    create->set_start_revision(start_revision);
    if (!watch->stream_->Write(request) || !watch->stream_->Read(&watch->pending_)) {
      last = FromGrpc(watch->stream_->Finish(), "watch");
      if (last.ok()) last = absl::UnavailableError("etcd watch: the stream ended at once");
      continue;
    }
    if (watch->pending_.compact_revision() > 0 || watch->pending_.canceled()) {
      watch->context_.TryCancel();
      watch->stream_->Finish().IgnoreError();
      return absl::FailedPreconditionError(absl::StrCat(
          "etcd watch from revision ", start_revision, " refused (compacted to ",
          watch->pending_.compact_revision(), "): ", watch->pending_.cancel_reason()));
    }
    current_.store((first + k) % n);
    return watch;  // `pending_` is the creation response: no events.
  }
  return last;
}

EtcdWatch::~EtcdWatch() {
  if (stream_ == nullptr) return;
  context_.TryCancel();
  stream_->Finish().IgnoreError();
}

bool EtcdWatch::Next(EtcdEvent* event) {
  while (next_event_ >= pending_.events_size()) {
    if (stream_ == nullptr) return false;  // Ended before.
    next_event_ = 0;
    pending_.Clear();
    if (!stream_->Read(&pending_)) {
      const grpc::Status s = stream_->Finish();
      absl::MutexLock lock(&mu_);
      status_ = cancelled_.load()
                    ? absl::CancelledError("watch cancelled")
                    : absl::UnavailableError(absl::StrCat(
                          "etcd watch lost: ",
                          s.ok() ? "the server ended the stream" : s.error_message()));
      stream_.reset();
      return false;
    }
    if (pending_.canceled() || pending_.compact_revision() > 0) {
      absl::MutexLock lock(&mu_);
      status_ = absl::FailedPreconditionError(
          absl::StrCat("etcd cancelled the watch: ", pending_.cancel_reason()));
      context_.TryCancel();
      stream_->Finish().IgnoreError();
      stream_.reset();
      return false;
    }
  }
  const etcdserverpb::Event& e = pending_.events(next_event_++);
  event->type = e.type() == etcdserverpb::Event::DELETE ? EtcdEvent::Type::kDelete
                                                        : EtcdEvent::Type::kPut;
  event->kv = {.key = e.kv().key(),
               .value = e.kv().value(),
               .mod_revision = e.kv().mod_revision(),
               .lease = e.kv().lease()};
  return true;
}

absl::Status EtcdWatch::status() const {
  absl::MutexLock lock(&mu_);
  return status_;
}

void EtcdWatch::Cancel() {
  cancelled_.store(true);
  context_.TryCancel();
}

}  // namespace pdserve
