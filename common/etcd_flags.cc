#include "common/etcd_flags.h"

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"

ABSL_FLAG(std::string, etcd, "",
          "etcd endpoints, comma-separated (http://HOST:2379,...): workers "
          "register there and routers watch them (docs/deployment.md, "
          "\"Discovery\"); empty: the router's config file lists the workers");
ABSL_FLAG(std::string, etcd_prefix, "/pdserve/",
          "Key prefix of this cluster in etcd (several clusters can share one "
          "etcd under different prefixes)");

ABSL_FLAG(std::string, etcd_cert_file, "",
          "TLS to etcd (https:// endpoints): PEM certificate chain this process "
          "presents to etcd (with --etcd_key_file and --etcd_ca_file; none: "
          "plaintext). Re-read on SIGHUP");
ABSL_FLAG(std::string, etcd_key_file, "", "TLS to etcd: PEM private key of --etcd_cert_file");
ABSL_FLAG(std::string, etcd_ca_file, "",
          "TLS to etcd: PEM bundle of the CAs that sign etcd's certificates");

namespace pdserve {

absl::StatusOr<std::unique_ptr<TlsCertificates>> EtcdTlsFromFlags() {
  return TlsCertificatesFromFlags(
      "etcd", absl::GetFlag(FLAGS_etcd_cert_file), absl::GetFlag(FLAGS_etcd_key_file),
      absl::GetFlag(FLAGS_etcd_ca_file), /*ca_required=*/true);
}

std::vector<std::string> EtcdEndpointsFromFlags() {
  return EtcdClient::SplitEndpoints(absl::GetFlag(FLAGS_etcd));
}

std::string EtcdPrefixFromFlags() {
  std::string prefix = absl::GetFlag(FLAGS_etcd_prefix);
  if (prefix.empty() || prefix.back() != '/') prefix += '/';
  return prefix;
}

std::string WorkerRegistrationKey(const std::string& prefix, const std::string& id) {
  return absl::StrCat(prefix, "workers/", id);
}

absl::StatusOr<std::string> AdvertisedAddress(const std::string& listen, int port,
                                              const std::string& advertise) {
  if (!advertise.empty()) return advertise;
  const size_t colon = listen.rfind(':');
  const std::string host = colon == std::string::npos ? listen : listen.substr(0, colon);
  if (host.empty() || host == "0.0.0.0" || host == "[::]" || host == "::") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--listen=", listen, " is a wildcard address that other machines cannot dial; "
        "pass --advertise=HOST:PORT with this worker's reachable address"));
  }
  return absl::StrCat(host, ":", port);
}

}  // namespace pdserve
