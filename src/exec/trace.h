// The executor's trace is a Chrome trace (core/chrome_trace.h: class Trace), which
// the simulator also draws its predicted step in (sim/simulator.h:
// trace_from_simulation); it lives in core so that exec and sim share it without
// depending on each other.
//
//   Trace trace;
//   trace.slice("compute", "mb0.h0.attn.forward", 0.0010, 0.0032, {{"op", 17}});
#pragma once

#include "core/chrome_trace.h"
