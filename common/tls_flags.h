// The internal mTLS flags, the same in every pdserve process (pd-router,
// pd-prefill, pd-decode): --mtls_cert_file, --mtls_key_file, --mtls_ca_file.
// Set, every internal gRPC server requires a client certificate signed by
// the CA and every internal channel presents the certificate and verifies
// its server by the CA (docs/security.md). Read only by the mains.
#ifndef PDSERVE_COMMON_TLS_FLAGS_H_
#define PDSERVE_COMMON_TLS_FLAGS_H_

#include <memory>

#include "absl/flags/declare.h"
#include "absl/status/statusor.h"
#include "common/tls.h"

ABSL_DECLARE_FLAG(std::string, mtls_cert_file);
ABSL_DECLARE_FLAG(std::string, mtls_key_file);
ABSL_DECLARE_FLAG(std::string, mtls_ca_file);

namespace pdserve {

// The certificates of the --mtls_* flags; null when none is set.
// INVALID_ARGUMENT naming the missing flag of a half-set group, or the file
// that cannot be read or parsed.
absl::StatusOr<std::unique_ptr<TlsCertificates>> InternalTlsFromFlags();

}  // namespace pdserve

#endif  // PDSERVE_COMMON_TLS_FLAGS_H_
