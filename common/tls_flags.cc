#include "common/tls_flags.h"

#include <string>

#include "absl/flags/flag.h"

ABSL_FLAG(std::string, mtls_cert_file, "",
          "Internal mTLS: PEM certificate chain this process presents to its "
          "peers (with --mtls_key_file and --mtls_ca_file; none: plaintext). "
          "Re-read on SIGHUP");
ABSL_FLAG(std::string, mtls_key_file, "",
          "Internal mTLS: PEM private key of --mtls_cert_file");
ABSL_FLAG(std::string, mtls_ca_file, "",
          "Internal mTLS: PEM bundle of the CAs whose certificates peers "
          "must present");

namespace pdserve {

absl::StatusOr<std::unique_ptr<TlsCertificates>> InternalTlsFromFlags() {
  return TlsCertificatesFromFlags(
      "mtls", absl::GetFlag(FLAGS_mtls_cert_file),
      absl::GetFlag(FLAGS_mtls_key_file), absl::GetFlag(FLAGS_mtls_ca_file),
      /*ca_required=*/true);
}

}  // namespace pdserve
