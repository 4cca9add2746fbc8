// CopyEngine: asynchronous device ⇄ host copies with completion tickets, one queue
// per direction so that both directions run at once.
//
//   CopyEngine& ce = backend.copy_engine();
//   auto t = ce.copy(CopyDirection::HostToDevice, dev_ptr, host_ptr, bytes);
//   if (!t) return t.status();
//   ... other work ...
//   SPILLWAY_RETURN_IF_ERROR(ce.order_compute_after(*t));  // later compute sees the bytes
//   SPILLWAY_RETURN_IF_ERROR(ce.wait(*t));                 // or: the host waits
//
// Ordering rules, the same on every backend:
// - a copy starts only after all device compute submitted before copy() was called,
//   so a DeviceToHost copy reads what earlier ops wrote; with after_compute = false
//   it need not (the caller knows that no compute in flight touches dst or src: a
//   fetch into a region no op used since the last synchronization);
// - copies of one direction complete in the order they were submitted;
// - compute submitted after order_compute_after(t) runs after copy t completed.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/status.h"

namespace spillway {

enum class CopyDirection : uint8_t { HostToDevice = 0, DeviceToHost = 1 };

struct CopyTicket {
  CopyDirection direction = CopyDirection::HostToDevice;
  uint64_t sequence = 0;  // 1, 2, 3, ... per direction; 0 is "no copy" (always done)
};

class CopyEngine {
 public:
  virtual ~CopyEngine() = default;
  virtual Result<CopyTicket> copy(CopyDirection direction, void* dst, const void* src, size_t bytes,
                                  bool after_compute = true) = 0;
  // Non-blocking: has copy `t` completed? An error of the copy is reported by wait().
  virtual bool is_done(CopyTicket t) = 0;
  // Blocks the host until copy `t` (and every earlier copy in its direction) completed.
  virtual Status wait(CopyTicket t) = 0;
  // Device compute submitted after this call runs after copy `t` completed. On a
  // backend whose compute runs on the host thread this is wait(t).
  virtual Status order_compute_after(CopyTicket t) = 0;
  // Blocks until every submitted copy completed.
  virtual Status wait_all() = 0;
  // Bytes moved so far per direction (for metrics).
  virtual uint64_t bytes_copied(CopyDirection d) const = 0;
};

}  // namespace spillway
