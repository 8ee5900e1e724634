// TLS for pdserve's gRPC servers and channels (and the router's HTTP API):
// a certificate chain, its private key and a CA bundle read from PEM files,
// checked, and re-read on Reload() (SIGHUP in every main, process.h).
// docs/security.md says what each process encrypts and authenticates.
//
//   auto tls = TlsCertificates::Load({.cert_file = "node.crt",
//                                     .key_file = "node.key",
//                                     .ca_file = "ca.crt"});
//   StartGrpcServer(address, {&service},
//                   (*tls)->ServerCredentials(ClientCertificates::kRequire));
//   grpc::CreateChannel(peer, (*tls)->ChannelCredentials());
//   ...
//   (*tls)->Reload();  // On SIGHUP.
//
// Reload: the files are read and checked (every PEM block parses, the key
// matches the first certificate, the CA bundle holds a certificate) before
// anything changes; files that fail keep the old credentials in use and
// the error is returned. gRPC's credentials read the checked copies (kept in
// anonymous memory, never written to disk) through a FileWatcher provider
// every kRefreshInterval, so after a successful Reload every new connection
// made from kRefreshInterval on uses the new certificates; connections open
// already keep theirs.
//
// Thread-safety: every method from any thread.
// Ownership: the credentials made here share the checked copies; the object
// must outlive every server and channel made from it (mains keep it until
// they return).
#ifndef PDSERVE_COMMON_TLS_H_
#define PDSERVE_COMMON_TLS_H_

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"

namespace grpc::experimental {
class CertificateProviderInterface;
}  // namespace grpc::experimental

namespace pdserve {

// The files of one TLS identity.
struct TlsFiles {
  // PEM certificate chain, the leaf first. Default: empty (required).
  std::string cert_file;
  // PEM private key of the leaf certificate. Default: empty (required).
  std::string key_file;
  // PEM bundle of the CAs that sign the peers' certificates. Empty: peers
  // are not verified (a server that asks no client certificate). Default:
  // empty.
  std::string ca_file;
};

// One group of TLS flags, e.g. --mtls_cert_file, --mtls_key_file,
// --mtls_ca_file for `prefix` "mtls": none set is nullopt (plaintext);
// a certificate without a key or the reverse, or a CA file without both
// (or, when `ca_required`, both without a CA file) is INVALID_ARGUMENT
// naming the missing flag.
absl::StatusOr<std::optional<TlsFiles>> TlsFilesFromFlags(
    std::string_view prefix, std::string cert_file, std::string key_file,
    std::string ca_file, bool ca_required);

// Whether a server asks its clients for a certificate.
enum class ClientCertificates {
  kNone,     // Any client (the public API without --tls_client_ca_file).
  kRequire,  // A certificate signed by the CA bundle, or no handshake.
};

// The checked PEM text of one identity.
struct TlsPem {
  std::string key;    // The private key.
  std::string chain;  // The certificate chain, the leaf first.
  std::string ca;     // Empty without a CA file.
};

class TlsCertificates {
 public:
  // How often gRPC's credentials look at the checked copies.
  static constexpr absl::Duration kRefreshInterval = absl::Seconds(1);

  // Reads and checks `files`. INVALID_ARGUMENT naming the file that cannot
  // be read, holds no PEM certificate or key, or whose key does not match
  // its certificate.
  static absl::StatusOr<std::unique_ptr<TlsCertificates>> Load(
      const TlsFiles& files);

  // Leaves the in-memory copies open: gRPC's provider may still read them
  // after its last credentials go (two descriptors per object).
  ~TlsCertificates();
  TlsCertificates(const TlsCertificates&) = delete;
  TlsCertificates& operator=(const TlsCertificates&) = delete;

  // Re-reads the files; see the file comment. Load's errors; on error
  // nothing changes.
  absl::Status Reload();

  // Credentials of a gRPC server presenting this identity. With kRequire
  // the files must have a CA (FAILED_PRECONDITION otherwise is a
  // programming error: CHECKed).
  std::shared_ptr<grpc::ServerCredentials> ServerCredentials(
      ClientCertificates clients) const;
  // Credentials of a gRPC channel presenting this identity and verifying
  // the server by the CA bundle and the target's host name (the server's
  // certificate must name it: a DNS or IP subjectAltName). CHECKs a CA.
  std::shared_ptr<grpc::ChannelCredentials> ChannelCredentials() const;

  // The PEM text in use now, and a number that grows with every successful
  // Reload (the HTTP server makes a new TLS context when it changes).
  TlsPem pem() const;
  uint64_t generation() const;

  const TlsFiles& files() const { return files_; }

 private:
  TlsCertificates(const TlsFiles& files, int identity_fd, int ca_fd,
                  TlsPem pem);

  const TlsFiles files_;
  // The checked copies gRPC's provider reads (tls.cc, ReplaceCopy): the key
  // and the chain in one in-memory file, the CA bundle in another (-1
  // without a CA). Reload puts new files behind the same descriptors.
  const int identity_fd_;
  const int ca_fd_;
  std::shared_ptr<grpc::experimental::CertificateProviderInterface> provider_;
  mutable absl::Mutex mu_;
  TlsPem pem_ ABSL_GUARDED_BY(mu_);
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
};

// One group of TLS flags loaded: TlsFilesFromFlags, then Load; null when
// none of the group is set.
absl::StatusOr<std::unique_ptr<TlsCertificates>> TlsCertificatesFromFlags(
    std::string_view prefix, std::string cert_file, std::string key_file,
    std::string ca_file, bool ca_required);

// SIGHUP's work in a main: Reload() of each non-null set, logging the
// outcome as `program` (an error keeps the old certificates in use).
void ReloadAndLog(std::string_view program,
                  std::initializer_list<TlsCertificates*> sets);

// Reads and checks `files` without keeping them: Load's errors.
absl::StatusOr<TlsPem> ReadTlsFiles(const TlsFiles& files);

}  // namespace pdserve

#endif  // PDSERVE_COMMON_TLS_H_
