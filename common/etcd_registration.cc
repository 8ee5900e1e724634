#include "common/etcd_registration.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/log.h"

namespace pdserve {

absl::StatusOr<std::unique_ptr<EtcdRegistration>> EtcdRegistration::Start(
    const Options& options) {
  if (options.key.empty()) return absl::InvalidArgumentError("etcd registration: empty key");
  if (options.ttl < absl::Seconds(2)) {
    return absl::InvalidArgumentError("etcd registration: the lease TTL must be at least 2 s");
  }
  absl::StatusOr<std::unique_ptr<EtcdClient>> client =
      EtcdClient::Create({.endpoints = options.endpoints,
                          .tls = options.tls,
                          .call_timeout = std::min(absl::Seconds(2), options.ttl / 3)});
  if (!client.ok()) return client.status();
  std::unique_ptr<EtcdRegistration> r(new EtcdRegistration(options, *std::move(client)));
  r->thread_ = std::thread([p = r.get()] { p->Run(); });
  return r;
}

EtcdRegistration::~EtcdRegistration() { Withdraw(); }

void EtcdRegistration::Withdraw() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (thread_.joinable()) thread_.join();
  int64_t lease;
  {
    absl::MutexLock lock(&mu_);
    lease = std::exchange(lease_, 0);
  }
  if (lease == 0) return;
  if (absl::Status s = client_->RevokeLease(lease); s.ok()) {
    PD_LOG(INFO) << "etcd: withdrew " << options_.key;
  } else {
    PD_LOG(WARNING) << "etcd: could not withdraw " << options_.key << " (" << s
                    << "); it goes when its lease expires";
  }
}

bool EtcdRegistration::registered() const {
  absl::MutexLock lock(&mu_);
  return lease_ != 0;
}

void EtcdRegistration::Run() {
  bool outage_logged = false;
  auto failed = [&](const absl::Status& s) {
    if (!outage_logged) {
      PD_LOG(WARNING) << "etcd: cannot register " << options_.key << " at "
                      << client_->current_endpoint() << ": " << s
                      << "; retrying every second";
      outage_logged = true;
    }
  };
  absl::Duration wait = absl::ZeroDuration();
  for (;;) {
    int64_t lease;
    {
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithTimeout(absl::Condition(&stopping_), wait);
      if (stopping_) return;
      lease = lease_;
    }
    if (lease == 0) {
      absl::StatusOr<int64_t> granted = client_->GrantLease(options_.ttl);
      absl::Status s = granted.status();
      if (granted.ok()) s = client_->Put(options_.key, options_.value, *granted);
      if (!s.ok()) {
        if (granted.ok()) client_->RevokeLease(*granted).IgnoreError();
        failed(s);
        wait = absl::Seconds(1);
        continue;
      }
      PD_LOG(INFO) << "etcd: registered " << options_.key << " at "
                   << client_->current_endpoint() << " (lease " << *granted << ", TTL "
                   << options_.ttl << ")";
      outage_logged = false;
      absl::MutexLock lock(&mu_);
      lease_ = *granted;
      wait = options_.ttl / 3;
      continue;
    }
    absl::StatusOr<absl::Duration> left = client_->KeepAlive(lease);
    if (left.ok()) {
      outage_logged = false;
      wait = options_.ttl / 3;
      continue;
    }
    if (absl::IsNotFound(left.status())) {
      // The lease ran out while etcd was away: routers have dropped this
      // worker; come back under a new one.
      PD_LOG(WARNING) << "etcd: " << left.status() << "; registering " << options_.key
                      << " again";
      absl::MutexLock lock(&mu_);
      lease_ = 0;
      wait = absl::ZeroDuration();
      continue;
    }
    failed(left.status());
    wait = absl::Seconds(1);
  }
}

}  // namespace pdserve
