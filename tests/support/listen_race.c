// LD_PRELOAD shim: another rank of the host wins the race for this process's first listening port.
//
// Two sockets with SO_REUSEADDR may both bind a port nobody listens on yet; the first to listen
// keeps it and the other's listen() fails with EADDRINUSE. On this process's first listen() on a
// port in KT_RACE_PORTS=LO-HI, a second socket binds that port and listens first, so the real
// listen() meets exactly that failure.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>

int listen(int fd, int backlog) {
  static int (*real)(int, int);
  static int raced;
  if (!real) real = (int (*)(int, int))dlsym(RTLD_NEXT, "listen");
  struct sockaddr_in addr;
  socklen_t len = sizeof(addr);
  int lo, hi;
  const char* range = getenv("KT_RACE_PORTS");
  if (!raced && range && sscanf(range, "%d-%d", &lo, &hi) == 2 &&
      getsockname(fd, (struct sockaddr*)&addr, &len) == 0 && addr.sin_family == AF_INET &&
      ntohs(addr.sin_port) >= lo && ntohs(addr.sin_port) <= hi) {
    raced = 1;
    int winner = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    setsockopt(winner, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    // a bind or listen that fails here does so because another rank listens there already: the
    // same race, lost the same way
    if (bind(winner, (struct sockaddr*)&addr, len) == 0) real(winner, 1);
    fprintf(stderr, "listen_race: port %d taken between bind and listen\n", ntohs(addr.sin_port));
  }
  return real(fd, backlog);
}
