// The Python module tandem_torch: importing it registers the backend "tandem" with
// torch.distributed, and init_process_group("tandem") / new_group(backend="tandem") then call
// create_process_group below.
//
// Rendezvous goes through the store PyTorch already made for the group (torchrun's
// MASTER_ADDR/MASTER_PORT, an init_method URL, or a store passed in), so the backend starts
// wherever PyTorch's own rendezvous works. Each rank publishes its host name, which gives the
// group's shape on hosts (local rank and size; a sub-group's differ from the job's); rank 0
// starts tandem's store on a port the kernel picks (port 0) and publishes the address it got
// with a fresh random token, so that no other process can take the port between its choice
// and its use; then every rank, rank 0 too, creates its td_comm against that store, which
// lives as long as the group. The address is MASTER_ADDR where set, 127.0.0.1 when the group
// is on one host, else rank 0's host name.
#include <cstdio>
#include <cstdlib>
#include <pybind11/chrono.h>
#include <pybind11/pybind11.h>
#include <string>
#include <torch/csrc/utils/pybind.h>
#include <unistd.h>
#include <vector>

#include "process_group.hpp"
#include "tandem/recorder.h"

namespace tandem_torch {
namespace {

std::string get_string(c10d::Store &store, const std::string &key) {
    std::vector<uint8_t> v = store.get(key);
    return std::string(v.begin(), v.end());
}

void set_string(c10d::Store &store, const std::string &key, const std::string &value) {
    store.set(key, std::vector<uint8_t>(value.begin(), value.end()));
}

// 128 random bits in hex: the job's token for tandem's store.
std::string random_token() {
    unsigned char raw[16];
    FILE *f = std::fopen("/dev/urandom", "rb");
    bool ok = f && std::fread(raw, 1, sizeof raw, f) == sizeof raw;
    if (f) std::fclose(f);
    TORCH_CHECK(ok, "tandem: cannot read /dev/urandom for the rendezvous token");
    char hex[2 * sizeof raw + 1];
    for (size_t i = 0; i < sizeof raw; i++) std::snprintf(hex + 2 * i, 3, "%02x", raw[i]);
    return hex;
}

std::string host_name() {
    char name[256] = "";
    gethostname(name, sizeof name - 1);
    return name;
}

} // namespace

c10::intrusive_ptr<c10d::ProcessGroup>
create_process_group(const c10::intrusive_ptr<c10d::Store> &store, int rank, int size,
                     std::chrono::milliseconds timeout) {
    // The rendezvous waits on other processes and needs no Python.
    pybind11::gil_scoped_release no_gil;
    TORCH_CHECK(store, "tandem: no store to meet the other ranks through");
    TORCH_CHECK(size >= 1 && rank >= 0 && rank < size, "tandem: rank ", rank,
                " is outside a group of ", size);
    td_comm_params p = td_comm_default_params();
    p.rank = rank;
    p.world_size = size;
    p.timeout_s = timeout.count() > 0 ? timeout.count() / 1000.0 : 0;

    std::vector<std::string> hosts(size);
    set_string(*store, "tandem/host/" + std::to_string(rank), host_name());
    for (int r = 0; r < size; r++)
        hosts[r] = get_string(*store, "tandem/host/" + std::to_string(r));
    p.local_rank = p.local_world_size = p.node_rank = 0;
    std::vector<std::string> seen;
    for (int r = 0; r < size; r++) {
        if (hosts[r] == hosts[rank]) {
            p.local_rank += r < rank;
            p.local_world_size++;
        }
        bool first = true;
        for (const std::string &h : seen) first = first && h != hosts[r];
        if (first) seen.push_back(hosts[r]);
        if (hosts[r] == hosts[rank] && first) p.node_rank = (int)seen.size() - 1;
    }
    // One host: shared memory, whatever launched the job (mpirun's ranks would otherwise pick
    // the mpi backend, whose groups are MPI's world only). Across hosts tandem chooses.
    p.backend = p.local_world_size == size ? TD_BACKEND_SHM : TD_BACKEND_AUTO;

    std::string address;
    td_store *host_store = nullptr; // rank 0: the store it hosts for the group
    if (rank == 0) {
        const char *master = std::getenv("MASTER_ADDR");
        std::string host = master && *master            ? master
                           : p.local_world_size == size ? "127.0.0.1"
                                                        : hosts[0];
        std::string token = random_token();
        td_store_params sp = td_store_default_params();
        sp.host = host.c_str();
        sp.port = 0;
        sp.is_server = 1;
        sp.token = token.c_str();
        sp.timeout_s = p.timeout_s;
        td_status s = td_store_create(&host_store, &sp);
        TORCH_CHECK(s == TD_OK, "tandem: rank 0 cannot start the rendezvous store on ", host, ": ",
                    td_last_error());
        address = host + " " + std::to_string(td_store_port(host_store)) + " " + token;
        set_string(*store, "tandem/rendezvous", address);
    } else {
        address = get_string(*store, "tandem/rendezvous");
    }
    char host[256], token[64];
    int port = 0;
    TORCH_CHECK(std::sscanf(address.c_str(), "%255s %d %63s", host, &port, token) == 3,
                "tandem: rank ", rank, ": malformed rendezvous '", address, "' in the store");
    p.master_addr = host;
    p.master_port = port;
    p.token = token;
    p.store_hosted = 1; // rank 0 hosts it above, not inside td_comm_create

    td_comm *comm = nullptr;
    td_status s = td_comm_create(&comm, &p);
    if (s != TD_OK) td_store_destroy(host_store);
    TORCH_CHECK(s == TD_OK, "tandem: rank ", rank, " of ", size,
                ": cannot create the group: ", td_last_error());
    return c10::make_intrusive<ProcessGroupTandem>(comm, host_store);
}

} // namespace tandem_torch

PYBIND11_MODULE(tandem_torch, m) {
    m.doc() = "tandem's collectives as the torch.distributed backend \"tandem\"";
    m.def("create_process_group", &tandem_torch::create_process_group, pybind11::arg("store"),
          pybind11::arg("rank"), pybind11::arg("size"), pybind11::arg("timeout"),
          "The process group of init_process_group(\"tandem\") (called by torch.distributed)");
    m.def("mark_step", &td_recorder_step, pybind11::arg("step"),
          "Marks the training step this rank is in, for the hang doctor's dumps");
    pybind11::module_ dist = pybind11::module_::import("torch.distributed");
    pybind11::object backend = dist.attr("Backend");
    if (!pybind11::hasattr(backend, "TANDEM"))
        backend.attr("register_backend")("tandem", m.attr("create_process_group"));
}
