// TestPki: certificates for TLS tests, made by running the real `openssl`
// in a fresh temporary directory (removed with the object): CAs, and leaf
// certificates they sign for 127.0.0.1 and localhost, usable by a server and
// by a client, valid or already expired. EC P-256 keys: fast to make.
#ifndef PDSERVE_TESTS_COMMON_TEST_PKI_H_
#define PDSERVE_TESTS_COMMON_TEST_PKI_H_

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace pdserve::testing_util {

class TestPki {
 public:
  TestPki() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "pdserve-pki-XXXXXX").string();
    dir_ = mkdtemp(tmpl.data());
  }
  ~TestPki() {
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }
  TestPki(const TestPki&) = delete;
  TestPki& operator=(const TestPki&) = delete;

  const std::filesystem::path& dir() const { return dir_; }
  std::string Path(const std::string& file) const { return (dir_ / file).string(); }
  std::string Cert(const std::string& name) const { return Path(name + ".crt"); }
  std::string Key(const std::string& name) const { return Path(name + ".key"); }

  // A self-signed CA `name` (name.crt, name.key).
  absl::Status MakeCa(const std::string& name) {
    return Run(absl::StrCat("openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes",
                            " -keyout '", Key(name), "' -out '", Cert(name), "' -days 2 -subj '/CN=",
                            name, "' -addext basicConstraints=critical,CA:TRUE",
                            " -addext keyUsage=critical,keyCertSign,cRLSign"));
  }

  // A certificate `name` (name.crt, name.key) with common name `cn`, signed
  // by CA `ca`, for the names in `san` (default 127.0.0.1 and localhost),
  // server and client use; valid for `days` (-1: expired yesterday).
  absl::Status MakeLeaf(const std::string& name, const std::string& ca, const std::string& cn,
                        int days = 2, const std::string& san = "IP:127.0.0.1,DNS:localhost") {
    const std::string ext = Path(name + ".ext");
    {
      std::ofstream out(ext);
      out << "subjectAltName=" << san << "\n"
          << "extendedKeyUsage=serverAuth,clientAuth\n"
          << "basicConstraints=CA:FALSE\n";
    }
    if (absl::Status s = Run(absl::StrCat(
            "openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout '", Key(name),
            "' -out '", Path(name + ".csr"), "' -subj '/CN=", cn, "'"));
        !s.ok()) {
      return s;
    }
    return Run(absl::StrCat("openssl x509 -req -in '", Path(name + ".csr"), "' -CA '", Cert(ca),
                            "' -CAkey '", Key(ca), "' -set_serial ", ++serial_, " -days ", days,
                            " -extfile '", ext, "' -out '", Cert(name), "'"));
  }

  // Overwrites `file` with `text`.
  void Write(const std::string& file, const std::string& text) const {
    std::ofstream out(Path(file), std::ios::trunc);
    out << text;
  }
  static std::string Read(const std::string& path) {
    std::ifstream in(path);
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  }

 private:
  absl::Status Run(const std::string& command) {
    const std::string log = Path("openssl.log");
    const std::string full = absl::StrCat(command, " >'", log, "' 2>&1");
    if (std::system(full.c_str()) != 0) {
      return absl::InternalError(absl::StrCat(command, " failed: ", Read(log)));
    }
    return absl::OkStatus();
  }

  std::filesystem::path dir_;
  int serial_ = 1000;
};

}  // namespace pdserve::testing_util

#endif  // PDSERVE_TESTS_COMMON_TEST_PKI_H_
