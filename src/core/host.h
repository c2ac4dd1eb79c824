// What makes "this host" for the transports and the device library: the
// machine's boot id and this process's namespaces. Two processes are on the
// same host when they share the boot id and the network namespace (shared
// memory also needs the pid namespace, for pidfds); processes in another
// network namespace stand in for other machines in our tests.
#pragma once

#include <string>

namespace mooncake {

// The machine's boot id (one per boot).
std::string boot_id();
// This process's network and pid namespaces ("net:[4026531840]"; "?" when unreadable).
std::string net_namespace();
std::string pid_namespace();

}  // namespace mooncake
