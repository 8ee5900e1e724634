#include "router/etcd_discovery.h"

#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "google/protobuf/util/json_util.h"
#include "pdserve/internal/v1/cluster_config.pb.h"

namespace pdserve {

absl::StatusOr<std::unique_ptr<EtcdDiscovery>> EtcdDiscovery::Start(const Options& options,
                                                                    WorkerRegistry* registry) {
  if (registry == nullptr) return absl::InvalidArgumentError("etcd discovery needs a registry");
  if (options.prefix.empty() || options.prefix.back() != '/') {
    return absl::InvalidArgumentError(
        absl::StrCat("etcd prefix '", options.prefix, "' must end in '/'"));
  }
  if (options.retry_interval <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("etcd discovery: retry_interval must be positive");
  }
  absl::StatusOr<std::unique_ptr<EtcdClient>> client =
      EtcdClient::Create({.endpoints = options.endpoints, .tls = options.tls});
  if (!client.ok()) return client.status();
  std::unique_ptr<EtcdDiscovery> d(new EtcdDiscovery(options, *std::move(client), registry));
  d->workers_prefix_ = options.prefix + "workers/";
  d->state_.since = absl::Now();
  d->state_.endpoint = d->client_->current_endpoint();
  d->thread_ = std::thread([p = d.get()] { p->Run(); });
  return d;
}

EtcdDiscovery::~EtcdDiscovery() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    if (watch_ != nullptr) watch_->Cancel();
  }
  if (thread_.joinable()) thread_.join();
}

EtcdDiscovery::State EtcdDiscovery::state() const {
  absl::MutexLock lock(&mu_);
  return state_;
}

void EtcdDiscovery::SetConnected(bool connected, const std::string& error) {
  absl::MutexLock lock(&mu_);
  if (state_.connected != connected) state_.since = absl::Now();
  if (connected && !state_.connected) {
    PD_LOG(INFO) << "etcd discovery: following " << workers_prefix_ << " at "
                 << client_->current_endpoint() << " (" << known_.size() << " workers)";
  } else if (!connected && (state_.connected || state_.error.empty())) {
    PD_LOG(WARNING) << "etcd discovery: " << error
                    << "; serving from the last view of the workers (" << known_.size()
                    << ") until etcd answers";
  }
  state_.connected = connected;
  state_.error = connected ? "" : error;
  state_.workers = static_cast<int>(known_.size());
  state_.endpoint = client_->current_endpoint();
}

void EtcdDiscovery::ApplyPut(const EtcdKeyValue& kv) {
  const std::string id = kv.key.substr(workers_prefix_.size());
  internal::v1::WorkerRegistration r;
  google::protobuf::util::JsonParseOptions parse;
  parse.ignore_unknown_fields = true;  // Newer workers may say more.
  const auto parsed = google::protobuf::util::JsonStringToMessage(kv.value, &r, parse);
  std::string problem;
  if (!parsed.ok()) {
    problem = absl::StrCat("not a WorkerRegistration: ", parsed.ToString());
  } else if (r.id() != id) {
    problem = absl::StrCat("its id '", r.id(), "' differs from its key");
  } else if (r.role() != "prefill" && r.role() != "decode") {
    problem = absl::StrCat("unknown role '", r.role(), "'");
  } else if (r.address().empty()) {
    problem = "no address";
  }
  if (!problem.empty()) {
    PD_LOG(ERROR) << "etcd discovery: ignoring " << kv.key << ": " << problem;
    ApplyDelete(kv.key);  // A worker that was valid before is not any more.
    return;
  }
  const WorkerRole role = r.role() == "decode" ? WorkerRole::kDecode : WorkerRole::kPrefill;
  auto it = known_.find(kv.key);
  if (it != known_.end() && it->second.role == role && it->second.address == r.address()) {
    return;  // A renewal under a new lease; nothing changed.
  }
  if (absl::Status s = registry_->AddWorker(role, id, r.address()); !s.ok()) {
    PD_LOG(ERROR) << "etcd discovery: ignoring " << kv.key << ": " << s;
    return;
  }
  known_[kv.key] = Known{role, r.address()};
}

void EtcdDiscovery::ApplyDelete(const std::string& key) {
  if (known_.erase(key) == 0) return;
  registry_->RemoveWorker(key.substr(workers_prefix_.size())).IgnoreError();
}

void EtcdDiscovery::Run() {
  absl::Duration wait = absl::ZeroDuration();
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithTimeout(absl::Condition(&stopping_), wait);
      if (stopping_) return;
    }
    wait = options_.retry_interval;
    absl::StatusOr<EtcdClient::Listing> listing = client_->List(workers_prefix_);
    if (!listing.ok()) {
      SetConnected(false, listing.status().ToString());
      continue;
    }
    // The listing is the whole truth as of its revision: what it lacks left
    // while etcd was out of sight.
    absl::flat_hash_set<std::string> listed;
    for (const EtcdKeyValue& kv : listing->kvs) {
      listed.insert(kv.key);
      ApplyPut(kv);
    }
    std::vector<std::string> gone;
    for (const auto& [key, known] : known_) {
      if (!listed.contains(key)) gone.push_back(key);
    }
    for (const std::string& key : gone) ApplyDelete(key);

    absl::StatusOr<std::unique_ptr<EtcdWatch>> watch =
        client_->Watch(workers_prefix_, listing->revision + 1);
    if (!watch.ok()) {
      SetConnected(false, watch.status().ToString());
      continue;
    }
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
      watch_ = watch->get();
    }
    SetConnected(true, "");
    EtcdEvent event;
    while ((*watch)->Next(&event)) {
      if (event.type == EtcdEvent::Type::kPut) {
        ApplyPut(event.kv);
      } else {
        ApplyDelete(event.kv.key);
      }
      absl::MutexLock lock(&mu_);
      state_.workers = static_cast<int>(known_.size());
    }
    {
      absl::MutexLock lock(&mu_);
      watch_ = nullptr;
      if (stopping_) return;
    }
    SetConnected(false, (*watch)->status().ToString());
    wait = absl::ZeroDuration();  // List again at once; a dead etcd fails fast.
  }
}

v1::Discovery DiscoveryStatus(const EtcdDiscovery* discovery) {
  v1::Discovery out;
  if (discovery == nullptr) {
    out.set_source("config");
    out.set_connected(true);
    return out;
  }
  const EtcdDiscovery::State state = discovery->state();
  out.set_source("etcd");
  out.set_connected(state.connected);
  out.set_error(state.error);
  out.set_since(absl::FormatTime(absl::RFC3339_sec, state.since, absl::UTCTimeZone()));
  return out;
}

}  // namespace pdserve
