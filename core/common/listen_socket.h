// The socket options of every HTTP listener wpub opens (wpubd's metrics port, the engine roles of
// wpub-recv): SO_REUSEADDR only, never SO_REUSEPORT. cpp-httplib's default sets SO_REUSEPORT,
// which lets a second process bind the same port and take half the connections -- a second
// wpubd on the metrics port would be scraped alternately with the first, a second engine would
// answer half a publisher's requests. Without it a second bind fails (EADDRINUSE) while the
// first process listens; SO_REUSEADDR still lets a restarted process bind a port whose old
// connections sit in TIME_WAIT. Pass to httplib::Server::set_socket_options.
#pragma once

#include <sys/socket.h>

namespace wpub {

inline void ExclusiveListenSocketOptions(int fd) {
  const int yes = 1;
  (void)::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
}

}  // namespace wpub
