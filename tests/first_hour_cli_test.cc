// The first hour, continued (issue 19): a missing socket answered at once (C++ client and
// refitctl), every listening port of a daemon on --listen's address, --data-ports, shared
// memory between daemons on one host, and refitctl's --json, help, --version and "pulled by".

#include <dirent.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <thread>

#include "catch2/catch.hpp"
#include "client/refit_client.h"
#include "nlohmann/json.hpp"
#include "tests/testing/daemon_process.h"
#include "tests/testing/required.h"

namespace refit {
namespace {

using client::SharedMemory;
using client::Slice;
using std::chrono::milliseconds;
using testing::ClientOf;
using testing::DaemonProcess;
using testing::StartDaemon;

bool Contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

std::string TempDir() {
  char dir_template[] = "/tmp/refit-cli-XXXXXX";
  REQUIRE(mkdtemp(dir_template) != nullptr);
  return dir_template;
}

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

TEST_CASE("a socket that does not exist, or that nothing listens on, fails at once",
          "[integration][first_hour]") {
  const std::string dir = TempDir();
  const std::string missing = dir + "/none.sock";
  // A socket file left by a daemon that exited: bound, never listening.
  const std::string stale = dir + "/stale.sock";
  const int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, stale.c_str(), sizeof(addr.sun_path) - 1);
  REQUIRE(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
  for (const std::string& path : {missing, stale}) {
    INFO(path);
    auto started = std::chrono::steady_clock::now();
    auto c = client::Client::Connect(path, std::chrono::seconds(5));
    CHECK(Seconds(started) < 0.5);
    REQUIRE(c.status().code() == absl::StatusCode::kUnavailable);
    CHECK(Contains(std::string(c.status().message()), path));
    started = std::chrono::steady_clock::now();
    auto cli = testing::RunCommand(
        {testing::RunfilePath("client/refitctl"), "--socket=" + path, "status"});
    CHECK(Seconds(started) < 0.5);
    CHECK(cli.exit_code == 3);
    CHECK(Contains(cli.err, "no refitd at " + path));
  }
  close(fd);
  auto c = client::Client::Connect(missing, std::chrono::seconds(5));
  CHECK(Contains(std::string(c.status().message()), "the socket does not exist"));
}

// Every TCP socket `pid` listens on, as "address:port" (IPv4-mapped IPv6 shown as IPv4).
std::vector<std::string> ListeningSockets(pid_t pid) {
  std::set<std::string> inodes;
  const std::string fd_dir = "/proc/" + std::to_string(pid) + "/fd";
  DIR* dir = opendir(fd_dir.c_str());
  REQUIRE(dir != nullptr);
  while (dirent* entry = readdir(dir)) {
    char target[256] = {};
    const std::string link = fd_dir + "/" + entry->d_name;
    if (readlink(link.c_str(), target, sizeof(target) - 1) <= 0) continue;
    const std::string t = target;
    if (t.rfind("socket:[", 0) == 0) inodes.insert(t.substr(8, t.size() - 9));
  }
  closedir(dir);
  std::vector<std::string> out;
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);  // header
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string slot, local, remote, state, queues, timer, retransmits, uid, timeout, inode;
      fields >> slot >> local >> remote >> state >> queues >> timer >> retransmits >> uid >>
          timeout >> inode;
      if (state != "0A" || !inodes.count(inode)) continue;  // 0A: LISTEN
      const auto colon = local.find(':');
      const std::string hex = local.substr(0, colon);
      const int port = std::stoi(local.substr(colon + 1), nullptr, 16);
      std::string address;
      const std::string v4 = hex.size() == 8 ? hex : hex.substr(24);  // ::ffff:a.b.c.d
      if (hex.size() == 8 || hex.substr(0, 24) == "0000000000000000FFFF0000") {
        const uint32_t raw = static_cast<uint32_t>(std::stoul(v4, nullptr, 16));
        address = std::to_string(raw & 0xff) + "." + std::to_string((raw >> 8) & 0xff) + "." +
                  std::to_string((raw >> 16) & 0xff) + "." + std::to_string(raw >> 24);
      } else {
        address = "[" + hex + "]";
      }
      out.push_back(address + ":" + std::to_string(port));
    }
  }
  return out;
}

TEST_CASE("every port a daemon listens on follows --listen's address, UCX's too",
          "[integration][first_hour]") {
  auto d = StartDaemon({"--node=ports", "--listen=127.0.0.1:0", "--data-ports=47100-47199"});
  auto client = ClientOf(*d);
  auto status = client->Status();
  REQUIRE(status.ok());
  const auto sockets = ListeningSockets(d->pid());
  INFO("listening: " << sockets.size());
  // The peer port and at least one UCX tcp port.
  REQUIRE(sockets.size() >= 2);
  bool peer_port = false, data_port = false;
  for (const std::string& s : sockets) {
    INFO(s);
    CHECK(s.rfind("127.0.0.1:", 0) == 0);
    const int port = std::stoi(s.substr(s.rfind(':') + 1));
    peer_port = peer_port || port == status->listen_port();
    data_port = data_port || (port >= 47100 && port <= 47199);
  }
  CHECK(peer_port);
  CHECK(data_port);
  // A bad range is refused at startup with what a range looks like.
  const std::string dir = TempDir();
  auto bad = testing::RunCommand({testing::RunfilePath("daemon/refitd"), "--node=x",
                                  "--socket=" + dir + "/x.sock", "--listen=127.0.0.1:0",
                                  "--data-ports=7199-7100"});
  CHECK(bad.exit_code == 1);
  CHECK(Contains(bad.err, "e.g. --data-ports=7100-7199"));
  // So is a --listen address no interface here has.
  auto elsewhere = testing::RunCommand({testing::RunfilePath("daemon/refitd"), "--node=x",
                                        "--socket=" + dir + "/y.sock", "--listen=192.0.2.254:7070",
                                        "--allow-plaintext-peers"});
  CHECK(elsewhere.exit_code == 1);
  CHECK(Contains(elsewhere.err, "not an address of any interface"));
  // Secure by default: a non-loopback --listen without --tls-* is refused before anything
  // listens, saying how to fix it.
  for (const std::string listen : {"0.0.0.0:0", "192.0.2.254:7070"}) {
    auto plaintext = testing::RunCommand({testing::RunfilePath("daemon/refitd"), "--node=x",
                                          "--socket=" + dir + "/z.sock", "--listen=" + listen});
    CHECK(plaintext.exit_code == 1);
    CHECK(Contains(plaintext.err, "--listen=" + listen + " is not a loopback address"));
    CHECK(Contains(plaintext.err, "--tls-cert, --tls-key and --tls-ca"));
    CHECK(Contains(plaintext.err, "--allow-plaintext-peers"));
    CHECK_FALSE(std::filesystem::exists(dir + "/z.sock"));
  }
  // A state dir refitd can't write, and a TLS key it can't read: refused at start, named.
  auto state = testing::RunCommand({testing::RunfilePath("daemon/refitd"), "--node=x",
                                    "--socket=" + dir + "/s.sock", "--listen=127.0.0.1:0",
                                    "--state-dir=/proc"});
  CHECK(state.exit_code == 1);
  CHECK(Contains(state.err, "--state-dir=/proc: cannot write there"));
  std::ofstream(dir + "/cert.pem") << "-----BEGIN CERTIFICATE-----\n";
  auto key = testing::RunCommand(
      {testing::RunfilePath("daemon/refitd"), "--node=x", "--socket=" + dir + "/k.sock",
       "--listen=127.0.0.1:0", "--tls-cert=" + dir + "/cert.pem",
       "--tls-key=" + dir + "/no-such.key", "--tls-ca=" + dir + "/cert.pem"});
  CHECK(key.exit_code == 1);
  CHECK(Contains(key.err, "--tls-key: cannot read " + dir + "/no-such.key"));
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// Two daemons on one host, each logging to a file; the engine's node pulls one version.
struct OneHost {
  explicit OneHost(const std::vector<std::string>& env_prefix = {}) {
    dir = TempDir();
    auto logged = [&](const std::string& log) {
      std::vector<std::string> wrapper = {"/usr/bin/env"};
      wrapper.insert(wrapper.end(), env_prefix.begin(), env_prefix.end());
      wrapper.insert(wrapper.end(), {"/bin/sh", "-c", "exec \"$0\" \"$@\" 2>>" + log});
      return wrapper;
    };
    trainer_node = StartDaemon({"--node=trainer"}, {}, logged(dir + "/trainer.log"));
    auto trainer_status = ClientOf(*trainer_node)->Status();
    REQUIRE(trainer_status.ok());
    engine_node = StartDaemon(
        {"--node=engine", "--peers=127.0.0.1:" + std::to_string(trainer_status->listen_port())}, {},
        logged(dir + "/engine.log"));
    trainer = ClientOf(*trainer_node);
    engine = ClientOf(*engine_node);
    src = std::make_unique<SharedMemory>(
        std::move(SharedMemory::Create(testing::UniqueShmName("oh"), 1 << 20)).value());
    dst = std::make_unique<SharedMemory>(
        std::move(SharedMemory::Create(testing::UniqueShmName("oh"), 1 << 20)).value());
    auto s = trainer->RegisterBuffer("m", v1::SOURCE, src->name(),
                                     {Slice("w", v1::FP32, {1 << 18})}, "trainer");
    REQUIRE(s.ok());
    auto d = engine->RegisterBuffer("m", v1::DESTINATION, dst->name(),
                                    {Slice("w", v1::FP32, {1 << 18})}, "engine");
    REQUIRE(d.ok());
    for (int i = 0; i < (1 << 18); ++i) reinterpret_cast<float*>(src->data())[i] = float(i);
    REQUIRE(trainer->Publish("m", 1, {*s}).ok());
    REQUIRE(engine->WaitForVersion("m", 1, milliseconds(20000)).ok());
    REQUIRE(engine->Apply("m", 1, {*d}).ok());
    REQUIRE(std::memcmp(dst->data(), src->data(), 1 << 20) == 0);
  }
  std::string dir;
  std::unique_ptr<DaemonProcess> trainer_node, engine_node;
  std::unique_ptr<client::Client> trainer, engine;
  std::unique_ptr<SharedMemory> src, dst;
};

TEST_CASE("daemons on one host map each other's slots by default; UCX_TLS=tcp turns it off",
          "[integration][first_hour]") {
  {
    OneHost host;  // UCX_TLS unset (this test's environment leaves it so)
    CHECK(Contains(ReadFile(host.dir + "/engine.log"), "mapped here (shared memory, memcpy)"));
  }
  {
    OneHost host({"UCX_TLS=tcp"});
    const std::string log = ReadFile(host.dir + "/engine.log");
    CHECK(Contains(log, "read through the transport"));
    CHECK_FALSE(Contains(log, "mapped here"));
  }
}

TEST_CASE("refitctl: JSON numbers, peers as a list, pulled by, global flags, --version",
          "[integration][first_hour]") {
  OneHost host({"UCX_TLS=tcp"});
  const std::string refitctl = testing::RunfilePath("client/refitctl");
  auto status =
      testing::RunCommand({refitctl, "status", "--json", "--socket=" + host.engine_node->socket()});
  REQUIRE(status.exit_code == 0);
  const auto json = nlohmann::json::parse(status.out);
  CHECK(json["models"][0]["latest_version"] == 1);
  CHECK(json["models"][0]["latest_version"].is_number_unsigned());
  CHECK(json["models"][0]["version_bytes"] == 1 << 20);
  CHECK(json["listen_port"].is_number_integer());
  // The trainer's node knows who pulls from it.
  auto peers =
      testing::RunCommand({refitctl, "--json", "--socket=" + host.trainer_node->socket(), "peers"});
  REQUIRE(peers.exit_code == 0);
  const auto list = nlohmann::json::parse(peers.out);
  REQUIRE(list.is_array());
  REQUIRE(list.size() == 1);
  CHECK(list[0]["node"] == "engine");
  CHECK(list[0]["direction"] == "pulled_by");
  CHECK(list[0]["connected"] == true);
  auto engine_peers =
      testing::RunCommand({refitctl, "peers", "--json", "--socket=" + host.engine_node->socket()});
  const auto engine_list = nlohmann::json::parse(engine_peers.out);
  REQUIRE(engine_list.size() == 1);
  CHECK(engine_list[0]["node"] == "trainer");
  CHECK(engine_list[0]["direction"] == "pulls_from");
  auto text = testing::RunCommand({refitctl, "--socket=" + host.trainer_node->socket(), "peers"});
  CHECK(Contains(text.out, "engine"));
  CHECK(Contains(text.out, "pulled by"));
  for (const char* sub :
       {"status", "versions", "peers", "replicas", "watch", "metrics", "health", "drop"}) {
    auto help = testing::RunCommand({refitctl, sub, "--help"});
    INFO(sub << ": " << help.out);
    CHECK(help.exit_code == 0);
    CHECK(Contains(help.out, "--json"));
    CHECK(Contains(help.out, "--socket"));
    CHECK(Contains(help.out, "--timeout"));
  }
  auto version = testing::RunCommand({refitctl, "--version"});
  CHECK(version.exit_code == 0);
  CHECK(Contains(version.out, "refitctl 0."));
  auto replicas =
      testing::RunCommand({refitctl, "replicas", "m", "--socket=" + host.trainer_node->socket()});
  CHECK(replicas.exit_code == 0);
}

}  // namespace
}  // namespace refit
