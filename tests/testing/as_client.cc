// A refit client for tests that run it under another uid (setpriv): one operation, its outcome
// on stdout as "OK <value>" or "<STATUS_CODE> <message>". Exit 0 unless the usage is wrong.
//
//   as_client SOCKET status | health | release ID | publish MODEL VERSION ID
//   as_client SOCKET buffers                           (the buffer ids Status shows it)
//   as_client SOCKET register ROLE MODEL SHM_NAME      (ROLE: SOURCE or DESTINATION)
//   as_client SOCKET register-own ROLE MODEL           (creates its own 512 KiB shm object
//                                                       and registers it; refitd releases
//                                                       it when this process exits)
//   as_client SOCKET hold ROLE MODEL VERSION           (register-own, then a SOURCE publishes
//                                                       VERSION if it is not 0; prints the
//                                                       line, then stays until its standard
//                                                       input closes or it is killed)
//   as_client SOCKET pass-memfd                        (passes a new sealed 512 KiB memfd;
//                                                       prints "OK <token>")
//   as_client SOCKET register-memfd ROLE MODEL TOKEN   (registers a token someone passed)
//   as_client SOCKET register-sealed ROLE MODEL        (its own sealed memfd, passed and
//                                                       registered)

#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <iostream>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "client/refit_client.h"

namespace {

using refit::client::Slice;
namespace v1 = refit::v1;

int Print(const absl::Status& status, const std::string& value = "") {
  if (status.ok()) {
    std::cout << "OK " << value << std::endl;
  } else {
    std::cout << absl::StatusCodeToString(status.code()) << " " << status.message() << std::endl;
  }
  return 0;
}

std::vector<v1::TensorSlice> Tensors() { return {Slice("w", v1::BF16, {256, 1024}, 0)}; }

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: as_client SOCKET OP ARGS...\n";
    return 2;
  }
  const std::string socket = argv[1], op = argv[2];
  auto client = refit::client::Client::Connect(socket, std::chrono::milliseconds(5000));
  if (!client.ok()) return Print(client.status());
  auto& c = **client;
  if (op == "status") return Print(c.Status().status());
  if (op == "buffers") {  // the buffer ids Status shows this caller, comma-separated
    auto status = c.Status();
    std::string ids;
    if (status.ok()) {
      for (const auto& model : status->models()) {
        for (const auto& buffer : model.buffers())
          ids += (ids.empty() ? "" : ",") + buffer.buffer_id();
      }
    }
    return Print(status.status(), ids);
  }
  if (op == "health") {
    auto healthy = c.Healthy();
    return Print(healthy.status(), healthy.ok() && *healthy ? "SERVING" : "NOT_SERVING");
  }
  if (op == "release" && argc == 4) return Print(c.ReleaseBuffer(argv[3]));
  if (op == "publish" && argc == 6) {
    return Print(c.Publish(argv[3], std::stoull(argv[4]), {argv[5]}).status());
  }
  if (op == "hold" && argc == 6) {
    const v1::Role role = std::string(argv[3]) == "SOURCE" ? v1::SOURCE : v1::DESTINATION;
    auto shm = refit::client::SharedMemory::Create(
        "/refit-as-client-hold-" + std::to_string(getpid()), 256 * 1024 * 2);
    if (!shm.ok()) return Print(shm.status());
    std::memset(shm->data(), 0x5a, shm->size());
    auto id = c.RegisterBuffer(argv[4], role, shm->name(), Tensors(), "as_client-hold");
    if (!id.ok()) return Print(id.status());
    const uint64_t version = std::stoull(argv[5]);
    if (role == v1::SOURCE && version > 0) {
      auto published = c.Publish(argv[4], version, {*id});
      if (!published.ok()) return Print(published.status());
    }
    Print(absl::OkStatus(), *id);
    char byte;
    while (read(0, &byte, 1) > 0) {
    }
    return 0;  // without releasing: refitd releases it when this process is gone
  }
  if ((op == "register" && argc == 6) || (op == "register-own" && argc == 5)) {
    const v1::Role role = std::string(argv[3]) == "SOURCE" ? v1::SOURCE : v1::DESTINATION;
    std::optional<refit::client::SharedMemory> own;
    std::string name = op == "register" ? argv[5] : "";
    if (op == "register-own") {
      auto shm = refit::client::SharedMemory::Create("/refit-as-client-" + std::to_string(getpid()),
                                                     256 * 1024 * 2);
      if (!shm.ok()) return Print(shm.status());
      own.emplace(std::move(shm).value());
      name = own->name();
    }
    auto id = c.RegisterBuffer(argv[4], role, name, Tensors(), "as_client");
    return Print(id.status(), id.ok() ? *id : "");
  }
  if (op == "pass-memfd" && argc == 3) {
    auto memory = refit::client::SharedMemory::CreateSealed(256 * 1024 * 2, "as-client");
    if (!memory.ok()) return Print(memory.status());
    auto token = c.PassMemfd(memory->fd());
    return Print(token.status(), token.ok() ? *token : "");
  }
  if (op == "register-memfd" && argc == 6) {
    v1::RegisterBufferRequest request;
    request.set_model(argv[4]);
    request.set_role(std::string(argv[3]) == "SOURCE" ? v1::SOURCE : v1::DESTINATION);
    request.mutable_memory()->mutable_memfd()->set_token(argv[5]);
    for (const auto& t : Tensors()) *request.add_tensors() = t;
    auto id = c.RegisterBuffer(request);
    return Print(id.status(), id.ok() ? *id : "");
  }
  if (op == "register-sealed" && argc == 5) {
    auto memory = refit::client::SharedMemory::CreateSealed(256 * 1024 * 2, "as-client");
    if (!memory.ok()) return Print(memory.status());
    const v1::Role role = std::string(argv[3]) == "SOURCE" ? v1::SOURCE : v1::DESTINATION;
    auto id = c.RegisterBuffer(argv[4], role, *memory, Tensors(), "as_client");
    return Print(id.status(), id.ok() ? *id : "");
  }
  std::cerr << "as_client: unknown operation " << op << "\n";
  return 2;
}
