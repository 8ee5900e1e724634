// The TCP transport's wire format (internal to kv_transfer/, and used by its
// tests to craft raw frames). Every frame is a 40-byte little-endian header
// and `length` payload bytes:
//
//   u32 magic 'PDKV' | u8 type | 3 zero bytes | u32 region | u32 length |
//   u64 offset | u32 crc32c of the payload | u32 zero | u64 landing
//
//   WRITE   payload lands at (region, offset) of the receiver, unless the
//           receiver's fence says `landing` is not open (then it is read
//           and dropped: kv::WriteFence)
//   NOTIFY  payload is a notification message
//   SYNC    no payload; the receiver answers ACK once everything before it
//           is in memory / queued
//   ACK     no payload
//   ERROR   region holds an absl::StatusCode, payload the message; the
//           receiver closes the connection after sending it
#ifndef PDSERVE_KV_TRANSFER_TCP_FRAME_H_
#define PDSERVE_KV_TRANSFER_TCP_FRAME_H_

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

namespace pdserve::kv {

constexpr uint32_t kFrameMagic = 0x564B4450;  // "PDKV" little-endian.
constexpr size_t kFrameHeaderBytes = 40;

enum class FrameType : uint8_t {
  kWrite = 1,
  kNotify = 2,
  kSync = 3,
  kAck = 4,
  kError = 5
};

struct FrameHeader {
  FrameType type = FrameType::kWrite;
  uint32_t region = 0;
  uint32_t length = 0;
  uint64_t offset = 0;
  uint32_t crc = 0;
  uint64_t landing = 0;  // WRITE only: kv::WriteOp::landing.
};

void EncodeFrameHeader(const FrameHeader& h, std::byte out[kFrameHeaderBytes]);
// False for a bad magic, unknown type or non-zero reserved bytes.
bool DecodeFrameHeader(const std::byte in[kFrameHeaderBytes], FrameHeader& h);

// CRC-32C (Castagnoli), as iSCSI and ext4 use it.
uint32_t Crc32c(std::span<const std::byte> data);

// An integer of the wire formats (these frames, the device transports'
// control frames) stored at / loaded from byte `at`: little-endian, as
// every supported host is.
template <typename T>
void StoreWire(std::byte* out, size_t at, T v) {
  std::memcpy(out + at, &v, sizeof(T));
}
template <typename T>
T LoadWire(const std::byte* in, size_t at) {
  T v;
  std::memcpy(&v, in + at, sizeof(T));
  return v;
}

}  // namespace pdserve::kv

#endif  // PDSERVE_KV_TRANSFER_TCP_FRAME_H_
