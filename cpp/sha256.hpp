// SHA-256 and HMAC-SHA256 (FIPS 180-4, RFC 2104), for the TCP bridge handshake.
// Small and dependency-free on purpose: the backend links nothing but torch.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace kaitian {

using Digest = std::array<uint8_t, 32>;

Digest sha256(const void* data, size_t bytes);
Digest hmacSha256(const std::string& key, const std::string& message);
// Compares two digests in time independent of where they differ.
bool sameDigest(const uint8_t* a, const uint8_t* b);

}  // namespace kaitian
