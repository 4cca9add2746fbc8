// ThreadCopyEngine: the CopyEngine of the CPU backend. One worker thread per
// direction, each draining its own FIFO queue with memcpy, so a HostToDevice and a
// DeviceToHost copy run at the same time while copies of one direction complete in
// the order they were submitted.
//
//   std::unique_ptr<CopyEngine> ce = make_thread_copy_engine();
//   auto t = ce->copy(CopyDirection::HostToDevice, dev_ptr, host_ptr, bytes);
//   if (!t) return t.status();
//   ... compute on other data ...
//   SPILLWAY_RETURN_IF_ERROR(ce->order_compute_after(*t));  // = wait(*t) on CPU
//   uint64_t moved = ce->bytes_copied(CopyDirection::HostToDevice);
//
// CPU compute runs on the host thread, so every compute op submitted before copy()
// has already finished when the copy is queued (the first ordering rule of
// io/copy_engine.h holds by construction), and order_compute_after(t) is wait(t).
// copy() rejects a null pointer with bytes > 0 and overlapping source and
// destination ranges; the source and destination must stay alive and untouched
// by the caller until the copy's ticket is done. The destructor finishes every
// queued copy before it returns.
#pragma once

#include <memory>

#include "io/copy_engine.h"

namespace spillway {

std::unique_ptr<CopyEngine> make_thread_copy_engine();

}  // namespace spillway
