// NUMA placement with libnuma (numa.h): node count, preferred / interleaved memory, thread binding.
#include "runtime/numa.h"

#include "core/error.h"

#include <fmt/format.h>
#include <numa.h>
#include <omp.h>
#include <sched.h>

#include <fstream>

namespace prescope {

int pci_numa_node(const std::string &pci_bus_id) {
    std::string id = pci_bus_id;
    for (char &c : id) c = char(std::tolower(static_cast<unsigned char>(c)));
    std::ifstream in("/sys/bus/pci/devices/" + id + "/numa_node");
    int node = -1;
    if (!(in >> node)) return -1;
    return node;
}

std::string apply_numa(const std::string &mode, int gpu_node) {
    if (mode != "gpu" && mode != "distribute" && mode != "isolate" && mode != "numactl") {
        fail("--numa: expected gpu, distribute, isolate or numactl, got '{}'", mode);
    }
    if (numa_available() < 0) return "NUMA: not available on this host (libnuma: no kernel support); nothing to place\n";
    const int nodes = numa_num_configured_nodes();
    if (nodes <= 1) return fmt::format("NUMA: 1 node (nothing to place; --numa {} has no effect)\n", mode);
    if (mode == "numactl") {
        return fmt::format("NUMA: {} nodes; placement left to numactl (threads may run on nodes {})\n", nodes,
                           [] {
                               std::string s;
                               bitmask *m = numa_get_run_node_mask();
                               for (int n = 0; n < numa_num_configured_nodes(); ++n) {
                                   if (numa_bitmask_isbitset(m, unsigned(n))) s += (s.empty() ? "" : ",") + std::to_string(n);
                               }
                               numa_bitmask_free(m);
                               return s;
                           }());
    }
    if (mode == "distribute") {
        numa_set_interleave_mask(numa_all_nodes_ptr);
#pragma omp parallel
        numa_run_on_node(omp_get_thread_num() % nodes);
        return fmt::format("NUMA: {} nodes; memory interleaved, CPU threads spread over them (--numa distribute)\n",
                           nodes);
    }
    const int here = numa_node_of_cpu(sched_getcpu());
    const int node = mode == "gpu" && gpu_node >= 0 ? gpu_node : here;
    numa_set_preferred(node);
    numa_run_on_node(node);
#pragma omp parallel
    numa_run_on_node(node);
    return fmt::format("NUMA: {} nodes; expert store and CPU threads on node {} ({})\n", nodes, node,
                       mode == "gpu" ? (gpu_node >= 0 ? "the GPU's node" : "the GPU's node is unknown: the current one")
                                     : "--numa isolate: the node this process started on");
}

} // namespace prescope
