// NUMA placement of the expert store and the CPU expert threads (libnuma), with llama.cpp's --numa modes:
// gpu (the node nearest the GPU, this project's default), distribute, isolate and numactl. A single-node host
// has nothing to place and says so.
#pragma once

#include <string>

namespace prescope {

/// The NUMA node of a PCI device ("0000:18:00.0") from /sys/bus/pci/devices/ID/numa_node; -1 when unknown.
int pci_numa_node(const std::string &pci_bus_id);

/// Applies `mode` to this process before the expert store is allocated and the CPU threads run:
///  - gpu: memory preferred on, and every CPU thread (the OpenMP team and the caller) bound to, gpu_node (or the
///    node the process runs on when gpu_node is -1);
///  - isolate: the same for the node the process runs on now (llama.cpp: threads only on that node);
///  - distribute: memory interleaved over all nodes, OpenMP thread i on node i % nodes (llama.cpp: spread evenly);
///  - numactl: nothing changed, the binding numactl set up is kept and reported.
/// Returns the line printed at start-up, e.g. "NUMA: 1 node (nothing to place)". Throws prescope::Error on an
/// unknown mode.
std::string apply_numa(const std::string &mode, int gpu_node);

} // namespace prescope
