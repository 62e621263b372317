// Socket helpers of the TCP transport: listening, connecting, bounded reads and writes. Every
// system call's result is checked and errors carry errno's text and the peer's rank.
#pragma once

#include <chrono>
#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "core/transport/errors.h"

namespace xirang::transport {

std::string errnoStr(int e);

// Milliseconds until `d` for poll(): 0 when past, +1 so poll never returns just before `d`,
// capped at 1000000.
int msUntil(Deadline d);

void setNonBlocking(int fd, bool on);
// TCP_NODELAY: frames are sent whole by the exchange, small ones must not wait for Nagle.
void tuneSocket(int fd);

// Reads (write=false) or writes exactly n bytes on a non-blocking fd before `deadline`.
// Returns false with *why set ("connection closed", errno's text, "timed out") on failure.
bool ioExact(int fd, void* buf, size_t n, bool write, Deadline deadline, std::string* why);

// Writes what the socket takes now (non-blocking) of one frame: the rest of its kHeaderBytes
// header `hdr` from *hdr_off, then of its payload from *pay_off (header and payload in one
// sendmsg while header bytes remain). Returns the system call's result (bytes written, or -1
// with errno: EAGAIN when the socket is full) and advances the offsets.
ssize_t writeFrame(int fd, const uint8_t* hdr, size_t* hdr_off, const uint8_t* data, uint64_t bytes, uint64_t* pay_off);

// The message of an abort frame whose header (`payload_bytes` long message) has been read:
// at most kMaxAbortMessage bytes, read within 200 ms ("" if they do not come).
std::string readAbortMessage(int fd, uint64_t payload_bytes);

// Resolves the address to listen on: XIRANG_SOCKET_IFNAME's first IPv4 (else IPv6) address,
// else every getaddrinfo result of the hostname in turn (the first that binds), else loopback.
// Returns the bound, listening fd and sets `address` to "ip:port" ("[ip]:port" for IPv6).
// Throws TransportError when nothing can be bound.
int listenOnInterface(const std::string& ifname, std::string* address);

// Opens a TCP connection to "ip:port" / "[ip]:port", trying every getaddrinfo result, before
// `deadline`. Returns a connected blocking fd or throws TransportError (the listener has refused
// connections for 500 ms: its process exited or left the group) or TimeoutError.
// `between_tries` (optional) runs before each retry and may throw to give up early.
int connectTo(const std::string& address, Deadline deadline, int peer,
              const std::function<void()>& between_tries = nullptr);

// One non-blocking connection attempt to `address` bounded by `wait`: 1 if a listener accepted
// (the connected fd is returned in *fd_out, blocking mode), 0 if the connection was refused (no
// listener: the process that published the address is gone), -1 if nothing can be concluded
// (timeout, unreachable, bad address).
int probeConnect(const std::string& address, std::chrono::milliseconds wait, int* fd_out);

}  // namespace xirang::transport
