// The TCP transport's wire format (internal to kv_transfer/, and used by its
// tests to craft raw frames and by pd-kv-transfer-bench to time the
// checksum). Every frame is a 40-byte little-endian header
// and `length` payload bytes:
//
//   u32 magic 'PDK2' | u8 type | 3 zero bytes | u32 region | u32 length |
//   u32 segments | u32 zero | u32 crc32c of the payload | u32 zero |
//   u64 landing
//
//   WRITE   lands `segments` (1 to kMaxWriteSegments) ranges of the
//           receiver's `region`: the payload is the segment table,
//           `segments` entries of {u64 offset | u32 length (> 0) | u32 zero},
//           then each segment's bytes in table order. Unless the receiver's
//           fence says `landing` is not open: then it is read and dropped
//           (kv::WriteFence). A paged KV cache's blocks are scattered, so
//           one frame carries many of them: one header and one system call
//           a side for a layer's blocks instead of one each.
//   NOTIFY  payload is a notification message
//   SYNC    no payload; the receiver answers ACK once everything before it
//           is in memory / queued
//   ACK     no payload
//   ERROR   region holds an absl::StatusCode, payload the message; the
//           receiver closes the connection after sending it
//
// `segments` is zero in every frame but WRITE. The magic names the format's
// version: a peer of another version is refused at its first frame.
#ifndef PDSERVE_KV_TRANSFER_TCP_FRAME_H_
#define PDSERVE_KV_TRANSFER_TCP_FRAME_H_

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

namespace pdserve::kv {

constexpr uint32_t kFrameMagic = 0x324B4450;  // "PDK2" little-endian.
// The format before it ("PDKV": a WRITE frame was one range); named in the
// errors a peer of that version gets and causes.
constexpr uint32_t kFrameMagicV1 = 0x564B4450;
constexpr size_t kFrameHeaderBytes = 40;
constexpr size_t kSegmentBytes = 16;
// At most this many segments a WRITE frame: its table is 4 KiB, and a
// frame's header, table and segments fit one sendmsg (IOV_MAX is 1024).
constexpr uint32_t kMaxWriteSegments = 256;
// The most segment bytes a WRITE frame may carry: every receiver accepts
// that much, whatever frame size it sends itself
// (TransportOptions::max_frame_bytes), so that workers of one format but
// different frame sizes (a cluster half way through a rolling upgrade)
// still exchange KV. Senders used 1 MiB frames until 2026-11-29.
constexpr uint32_t kMaxWritePayloadBytes = 1u << 20;

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
  uint32_t segments = 0;  // WRITE only.
  uint32_t crc = 0;
  uint64_t landing = 0;  // WRITE only: kv::WriteOp::landing.
};

// One entry of a WRITE frame's segment table.
struct WriteSegment {
  uint64_t offset = 0;
  uint32_t length = 0;
};

void EncodeFrameHeader(const FrameHeader& h, std::byte out[kFrameHeaderBytes]);
// False for a bad magic, unknown type, non-zero reserved bytes, or
// `segments` other than 1 to kMaxWriteSegments in a WRITE and 0 elsewhere.
bool DecodeFrameHeader(const std::byte in[kFrameHeaderBytes], FrameHeader& h);
// True when `in` begins with the older format's magic.
bool IsOlderFormat(const std::byte in[kFrameHeaderBytes]);

void EncodeSegment(const WriteSegment& s, std::byte out[kSegmentBytes]);
// False for an empty segment or non-zero reserved bytes.
bool DecodeSegment(const std::byte in[kSegmentBytes], WriteSegment& s);

// CRC-32C (Castagnoli), as iSCSI and ext4 use it. `crc` continues a
// checksum: Crc32c(b, Crc32c(a)) is the checksum of a then b.
uint32_t Crc32c(std::span<const std::byte> data, uint32_t crc = 0);

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
