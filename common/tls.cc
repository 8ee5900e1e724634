#include "common/tls.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/check.h"
#include "common/log.h"
#include "grpcpp/security/tls_certificate_provider.h"
#include "grpcpp/security/tls_credentials_options.h"
#include "openssl/bio.h"
#include "openssl/err.h"
#include "openssl/pem.h"
#include "openssl/x509.h"

namespace pdserve {
namespace {

absl::StatusOr<std::string> ReadWholeFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot read ", path, ": ", std::strerror(errno)));
  }
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) {
    return absl::InvalidArgumentError(absl::StrCat("cannot read ", path));
  }
  return text.str();
}

struct BioFree {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct X509Free {
  void operator()(X509* x) const { X509_free(x); }
};
struct PkeyFree {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
using BioPtr = std::unique_ptr<BIO, BioFree>;
using X509Ptr = std::unique_ptr<X509, X509Free>;
using PkeyPtr = std::unique_ptr<EVP_PKEY, PkeyFree>;

BioPtr MemoryBio(const std::string& text) {
  return BioPtr(BIO_new_mem_buf(text.data(), static_cast<int>(text.size())));
}

// Every certificate of a PEM text, in order; INVALID_ARGUMENT naming `path`
// when there is none.
absl::StatusOr<std::vector<X509Ptr>> ParseCertificates(
    const std::string& text, const std::string& path) {
  std::vector<X509Ptr> certificates;
  BioPtr bio = MemoryBio(text);
  while (X509* x = PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr)) {
    certificates.emplace_back(x);
  }
  ERR_clear_error();  // The end of the text reads as an error.
  if (certificates.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, " holds no PEM certificate"));
  }
  return certificates;
}

// An anonymous in-memory file holding `text`; -1 with errno on failure.
int MemoryFile(const std::string& text) {
  const int fd = memfd_create("pdserve-tls", MFD_CLOEXEC);
  if (fd < 0) return -1;
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int error = errno;
      close(fd);
      errno = error;
      return -1;
    }
    done += static_cast<size_t>(n);
  }
  return fd;
}

std::string FdPath(int fd) { return absl::StrCat("/proc/self/fd/", fd); }

std::string IdentityCopy(const TlsPem& pem) {
  return absl::StrCat(pem.key, "\n", pem.chain);
}

}  // namespace

absl::StatusOr<std::optional<TlsFiles>> TlsFilesFromFlags(
    std::string_view prefix, std::string cert_file, std::string key_file,
    std::string ca_file, bool ca_required) {
  if (cert_file.empty() && key_file.empty() && ca_file.empty()) {
    return std::nullopt;
  }
  const auto missing = [&](std::string_view flag, std::string_view given) {
    const std::string group(prefix);
    return absl::InvalidArgumentError(
        absl::StrCat("--", group, "_", std::string(flag), " is required with --",
                     group, "_", std::string(given)));
  };
  if (cert_file.empty()) {
    return missing("cert_file", key_file.empty() ? "ca_file" : "key_file");
  }
  if (key_file.empty()) return missing("key_file", "cert_file");
  if (ca_required && ca_file.empty()) return missing("ca_file", "cert_file");
  return TlsFiles{std::move(cert_file), std::move(key_file),
                  std::move(ca_file)};
}

absl::StatusOr<TlsPem> ReadTlsFiles(const TlsFiles& files) {
  absl::StatusOr<std::string> chain = ReadWholeFile(files.cert_file);
  if (!chain.ok()) return chain.status();
  absl::StatusOr<std::string> key = ReadWholeFile(files.key_file);
  if (!key.ok()) return key.status();
  absl::StatusOr<std::vector<X509Ptr>> certificates =
      ParseCertificates(*chain, files.cert_file);
  if (!certificates.ok()) return certificates.status();
  BioPtr key_bio = MemoryBio(*key);
  PkeyPtr pkey(
      PEM_read_bio_PrivateKey(key_bio.get(), nullptr, nullptr, nullptr));
  ERR_clear_error();
  if (pkey == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        files.key_file, " holds no PEM private key (or one with a password)"));
  }
  if (X509_check_private_key(certificates->front().get(), pkey.get()) != 1) {
    ERR_clear_error();
    return absl::InvalidArgumentError(
        absl::StrCat("the key in ", files.key_file,
                     " does not match the certificate in ", files.cert_file));
  }
  if (X509_cmp_current_time(X509_get0_notAfter(certificates->front().get())) <
      0) {
    PD_LOG(WARNING) << "the certificate in " << files.cert_file
                    << " has expired: peers will refuse it";
  }
  TlsPem pem;
  pem.key = *std::move(key);
  pem.chain = *std::move(chain);
  if (!files.ca_file.empty()) {
    absl::StatusOr<std::string> ca = ReadWholeFile(files.ca_file);
    if (!ca.ok()) return ca.status();
    absl::StatusOr<std::vector<X509Ptr>> authorities =
        ParseCertificates(*ca, files.ca_file);
    if (!authorities.ok()) return authorities.status();
    pem.ca = *std::move(ca);
  }
  return pem;
}

namespace {

// The checked copies gRPC's FileWatcher provider reads are anonymous memory
// files, named by /proc/self/fd paths. Reload swaps a new file in with
// dup3, atomically: a reader opens the old file or the new one, never half
// of one. The key and the chain share one file so that they change
// together (IdentityCopy); gRPC's parse of each skips the other's PEM
// blocks.
//
// A new copy holding `text`: its descriptor.
absl::StatusOr<int> NewCopy(const std::string& text) {
  const int fd = MemoryFile(text);
  if (fd < 0) {
    return absl::InternalError(
        absl::StrCat("memfd_create: ", std::strerror(errno)));
  }
  return fd;
}

// Puts a new copy holding `text` behind descriptor `fd`.
absl::Status ReplaceCopy(int fd, const std::string& text) {
  absl::StatusOr<int> fresh = NewCopy(text);
  if (!fresh.ok()) return fresh.status();
  const int replaced = dup3(*fresh, fd, O_CLOEXEC);
  const int error = errno;
  close(*fresh);
  if (replaced < 0) {
    return absl::InternalError(absl::StrCat("dup3: ", std::strerror(error)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<TlsCertificates>> TlsCertificates::Load(
    const TlsFiles& files) {
  absl::StatusOr<TlsPem> pem = ReadTlsFiles(files);
  if (!pem.ok()) return pem.status();
  absl::StatusOr<int> identity_fd = NewCopy(IdentityCopy(*pem));
  if (!identity_fd.ok()) return identity_fd.status();
  int ca_fd = -1;
  if (!pem->ca.empty()) {
    absl::StatusOr<int> fd = NewCopy(pem->ca);
    if (!fd.ok()) {
      close(*identity_fd);
      return fd.status();
    }
    ca_fd = *fd;
  }
  return std::unique_ptr<TlsCertificates>(
      new TlsCertificates(files, *identity_fd, ca_fd, *std::move(pem)));
}

TlsCertificates::TlsCertificates(const TlsFiles& files, int identity_fd,
                                 int ca_fd, TlsPem pem)
    : files_(files),
      identity_fd_(identity_fd),
      ca_fd_(ca_fd),
      pem_(std::move(pem)) {
  const std::string identity = FdPath(identity_fd_);
  const std::string ca = ca_fd_ >= 0 ? FdPath(ca_fd_) : std::string();
  provider_ = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      identity, identity, ca,
      static_cast<unsigned>(absl::ToInt64Seconds(kRefreshInterval)));
}

// The descriptors stay open: gRPC's provider is reference-counted inside
// gRPC and may read the copies after this object is gone (a connection
// still being torn down); a closed number could be reused for another file
// it would then read, and an empty file reads as an empty key, which gRPC
// asserts against. Two descriptors per object, a few per process.
TlsCertificates::~TlsCertificates() = default;

absl::Status TlsCertificates::Reload() {
  absl::StatusOr<TlsPem> pem = ReadTlsFiles(files_);
  if (!pem.ok()) return pem.status();
  absl::MutexLock lock(&mu_);
  if (absl::Status s = ReplaceCopy(identity_fd_, IdentityCopy(*pem)); !s.ok()) {
    return s;
  }
  if (ca_fd_ >= 0) {
    // A failure here leaves the new identity with the old CA: still a
    // checked, matching key and chain.
    if (absl::Status s = ReplaceCopy(ca_fd_, pem->ca); !s.ok()) return s;
  }
  pem_ = *std::move(pem);
  ++generation_;
  return absl::OkStatus();
}

std::shared_ptr<grpc::ServerCredentials> TlsCertificates::ServerCredentials(
    ClientCertificates clients) const {
  grpc::experimental::TlsServerCredentialsOptions options(provider_);
  options.watch_identity_key_cert_pairs();
  if (clients == ClientCertificates::kRequire) {
    PD_CHECK(!files_.ca_file.empty());
    options.watch_root_certs();
    options.set_cert_request_type(
        GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  } else {
    options.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  }
  return grpc::experimental::TlsServerCredentials(options);
}

std::shared_ptr<grpc::ChannelCredentials> TlsCertificates::ChannelCredentials()
    const {
  PD_CHECK(!files_.ca_file.empty());
  grpc::experimental::TlsChannelCredentialsOptions options;
  options.set_certificate_provider(provider_);
  options.watch_identity_key_cert_pairs();
  options.watch_root_certs();
  options.set_verify_server_certs(true);
  return grpc::experimental::TlsCredentials(options);
}

void ReloadAndLog(std::string_view program,
                  std::initializer_list<TlsCertificates*> sets) {
  for (TlsCertificates* set : sets) {
    if (set == nullptr) continue;
    if (absl::Status s = set->Reload(); !s.ok()) {
      PD_LOG(ERROR) << program << ": SIGHUP: " << s
                    << "; still serving with the certificates loaded before";
    } else {
      PD_LOG(INFO) << program << ": SIGHUP: reloaded "
                   << set->files().cert_file << " and "
                   << set->files().key_file
                   << (set->files().ca_file.empty()
                           ? std::string()
                           : absl::StrCat(" and ", set->files().ca_file));
    }
  }
}

absl::StatusOr<std::unique_ptr<TlsCertificates>> TlsCertificatesFromFlags(
    std::string_view prefix, std::string cert_file, std::string key_file,
    std::string ca_file, bool ca_required) {
  absl::StatusOr<std::optional<TlsFiles>> files =
      TlsFilesFromFlags(prefix, std::move(cert_file), std::move(key_file),
                        std::move(ca_file), ca_required);
  if (!files.ok()) return files.status();
  if (!files->has_value()) return nullptr;
  return TlsCertificates::Load(**files);
}

TlsPem TlsCertificates::pem() const {
  absl::MutexLock lock(&mu_);
  return pem_;
}

uint64_t TlsCertificates::generation() const {
  absl::MutexLock lock(&mu_);
  return generation_;
}

}  // namespace pdserve
