// A program for meshrun's tests: behaves as told by its first argument.
//   env                 print the rank's environment
//   fail R CODE         rank R exits with CODE after 0.3 s; the others sleep 60 s
//   fail-first R        like "fail R 3" on the first attempt only; later attempts succeed
//   grandchild DIR      fork a child that sleeps; both write their pids to DIR; then sleep
//   allreduce           init_from_env, all_reduce(rank + 1), print the sum
//   hold                init_from_env, say "joined", wait 3 s, then as "allreduce"
//   stranger            rank 1 first plays a stranger on the job's store port:
//                       a forged failure report for rank 0 on a raw
//                       connection, then a store client without the token;
//                       then every rank does "allreduce"
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <iostream>
#include <string>
#include <thread>

#include <torch/torch.h>

#include "meshtrain/comm.h"
#include "comm/store.h"

// Says what the store answered to a stranger (the job's token is in this
// process's environment, but a stranger would not have it).
void forge_a_report_and_join_without_the_token() {
  const int port = std::atoi(std::getenv("MASTER_PORT"));
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) return;
  // kReport (9) "g0/r0" "forged by a stranger", as store_protocol.h frames it.
  std::string body(1, '\x09');
  for (const std::string field : {"g0/r0", "forged by a stranger"}) {
    const int64_t n = static_cast<int64_t>(field.size());
    body.append(reinterpret_cast<const char*>(&n), 8);
    body += field;
  }
  const uint32_t len = static_cast<uint32_t>(body.size());
  const std::string frame = std::string(reinterpret_cast<const char*>(&len), 4) + body;
  if (send(fd, frame.data(), frame.size(), MSG_NOSIGNAL) < 0) std::cout << "stranger: send failed" << std::endl;
  char buf[4096];
  ssize_t total = 0, n;
  while ((n = recv(fd, buf, sizeof buf, 0)) > 0) total += n;  // the greeting, then the close
  std::cout << "stranger: the store closed the connection after " << total << " bytes" << std::endl;
  close(fd);
  try {
    meshtrain::comm::TcpStore store("127.0.0.1", port, std::chrono::seconds(5), "");
    std::cout << "stranger: joined the store without the token" << std::endl;
  } catch (const std::exception& e) {
    std::cout << "stranger: refused: " << e.what() << std::endl;
  }
  std::cout << "token in the environment: " << std::string(std::getenv("MESHTRAIN_RDZV_TOKEN")).size() << " characters"
            << std::endl;
}

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "env";
  const int rank = std::atoi(std::getenv("RANK") ? std::getenv("RANK") : "-1");
  const int restart = std::atoi(std::getenv("MESHTRAIN_RESTART_COUNT") ? std::getenv("MESHTRAIN_RESTART_COUNT") : "0");
  if (mode == "env") {
    for (const char* v : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "OMP_NUM_THREADS"}) {
      std::cout << v << "=" << (std::getenv(v) ? std::getenv(v) : "") << std::endl;
    }
    std::cout << "line without newline";
    return 0;
  }
  if (mode == "fail" || mode == "fail-first") {
    const int who = std::atoi(argv[2]);
    const int code = mode == "fail" ? std::atoi(argv[3]) : 3;
    if (rank == who && (mode == "fail" || restart == 0)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      std::cerr << "rank " << rank << " exiting with " << code << std::endl;
      return code;
    }
    if (mode == "fail-first" && restart > 0) {
      std::cout << "attempt " << restart << " ok" << std::endl;
      return 0;
    }
    std::this_thread::sleep_for(std::chrono::seconds(60));
    return 0;
  }
  if (mode == "grandchild") {
    const std::string dir = argv[2];
    const pid_t child = fork();
    if (child == 0) {
      std::ofstream(dir + "/grandchild" + std::to_string(rank)) << getpid();
      std::this_thread::sleep_for(std::chrono::seconds(60));
      _exit(0);
    }
    std::ofstream(dir + "/rank" + std::to_string(rank)) << getpid();
    std::this_thread::sleep_for(std::chrono::seconds(60));
    return 0;
  }
  if (mode == "stranger" && rank == 1) forge_a_report_and_join_without_the_token();
  if (mode == "allreduce" || mode == "stranger" || mode == "hold") try {
    auto comm = meshtrain::comm::init_from_env();
    if (mode == "hold") {
      std::cout << "rank " << comm->rank() << " joined" << std::endl;
      std::this_thread::sleep_for(std::chrono::seconds(3));
    }
    auto t = torch::full({4}, static_cast<float>(comm->rank() + 1));
    comm->all_reduce(t);
    std::cout << "rank " << comm->rank() << " of " << comm->size() << " sum " << t[0].item<float>() << std::endl;
    return 0;
  } catch (const std::exception& e) {
    std::cerr << e.what() << std::endl;
    return 1;
  }
  return 2;
}
