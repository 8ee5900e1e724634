#include "kv_transfer/tcp_frame.h"

#include <isa-l/crc.h>

#include <algorithm>
#include <climits>
#include <cstring>

namespace pdserve::kv {

void EncodeFrameHeader(const FrameHeader& h, std::byte out[kFrameHeaderBytes]) {
  std::memset(out, 0, kFrameHeaderBytes);
  StoreWire<uint32_t>(out, 0, kFrameMagic);
  StoreWire<uint8_t>(out, 4, static_cast<uint8_t>(h.type));
  StoreWire<uint32_t>(out, 8, h.region);
  StoreWire<uint32_t>(out, 12, h.length);
  StoreWire<uint32_t>(out, 16, h.segments);
  StoreWire<uint32_t>(out, 24, h.crc);
  StoreWire<uint64_t>(out, 32, h.landing);
}

bool DecodeFrameHeader(const std::byte in[kFrameHeaderBytes], FrameHeader& h) {
  if (LoadWire<uint32_t>(in, 0) != kFrameMagic) return false;
  const uint8_t type = LoadWire<uint8_t>(in, 4);
  if (type < 1 || type > 5) return false;
  if (LoadWire<uint8_t>(in, 5) != 0 || LoadWire<uint16_t>(in, 6) != 0 ||
      LoadWire<uint32_t>(in, 20) != 0 || LoadWire<uint32_t>(in, 28) != 0)
    return false;
  h.type = static_cast<FrameType>(type);
  h.region = LoadWire<uint32_t>(in, 8);
  h.length = LoadWire<uint32_t>(in, 12);
  h.segments = LoadWire<uint32_t>(in, 16);
  h.crc = LoadWire<uint32_t>(in, 24);
  h.landing = LoadWire<uint64_t>(in, 32);
  if (h.type == FrameType::kWrite) return h.segments >= 1 && h.segments <= kMaxWriteSegments;
  return h.segments == 0;
}

bool IsOlderFormat(const std::byte in[kFrameHeaderBytes]) {
  return LoadWire<uint32_t>(in, 0) == kFrameMagicV1;
}

void EncodeSegment(const WriteSegment& s, std::byte out[kSegmentBytes]) {
  StoreWire<uint64_t>(out, 0, s.offset);
  StoreWire<uint32_t>(out, 8, s.length);
  StoreWire<uint32_t>(out, 12, 0);
}

bool DecodeSegment(const std::byte in[kSegmentBytes], WriteSegment& s) {
  s.offset = LoadWire<uint64_t>(in, 0);
  s.length = LoadWire<uint32_t>(in, 8);
  return s.length > 0 && LoadWire<uint32_t>(in, 12) == 0;
}

uint32_t Crc32c(std::span<const std::byte> data, uint32_t prior) {
  // ISA-L picks its fastest version for this CPU at run time (folding with
  // carry-less multiplies, VPCLMULQDQ where the CPU has it). It neither
  // inverts its start value nor its result, so the standard CRC's two
  // inversions are done here; its length is an int, so huge spans go in
  // pieces.
  uint32_t crc = ~prior;
  while (!data.empty()) {
    const size_t n = std::min<size_t>(data.size(), INT_MAX);
    crc = crc32_iscsi(reinterpret_cast<unsigned char*>(const_cast<std::byte*>(data.data())),
                      static_cast<int>(n), crc);
    data = data.subspan(n);
  }
  return ~crc;
}

}  // namespace pdserve::kv
