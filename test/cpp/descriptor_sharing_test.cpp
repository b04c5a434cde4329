// Descriptors handed between processes (comm/descriptor_sharing.h): a child
// process fetches a memfd the parent's server offers and reads what the
// parent wrote in it; ids not offered, withdrawn ids, a server that is gone
// and a client that never asks are errors or no-ops, never hangs; no
// descriptor leaks on either side.
#include <gtest/gtest.h>
#include <dirent.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstring>
#include <string>
#include <thread>

#include "comm/descriptor_sharing.h"
#include "comm/error.h"

namespace fsdp_ext::comm {
namespace {

using std::chrono::milliseconds;

// A memfd holding `text`.
UniqueFd memfd_with(const std::string& text) {
  UniqueFd fd(memfd_create("descriptor_sharing_test", MFD_CLOEXEC));
  EXPECT_TRUE(fd.valid()) << std::strerror(errno);
  EXPECT_EQ(write(fd.get(), text.data(), text.size()), static_cast<ssize_t>(text.size()));
  return fd;
}

std::string contents(int fd) {
  char buffer[64] = {};
  const ssize_t n = pread(fd, buffer, sizeof(buffer), 0);
  return n > 0 ? std::string(buffer, static_cast<size_t>(n)) : std::string();
}

size_t open_descriptors() {
  size_t count = 0;
  DIR* dir = opendir("/proc/self/fd");
  while (dirent* entry = readdir(dir)) count += entry->d_name[0] != '.';
  closedir(dir);
  return count;
}

// Runs `body` in a child process; its exit status (0: the body returned true).
template <typename Body>
int in_child(Body body) {
  const pid_t child = fork();
  if (child == 0) {
    bool ok = false;
    try {
      ok = body();
    } catch (...) {
    }
    _exit(ok ? 0 : 1);
  }
  int status = -1;
  waitpid(child, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128;
}

TEST(DescriptorSharing, AnotherProcessReadsTheOfferedFile) {
  DescriptorServer server;
  {
    UniqueFd file = memfd_with("written by the owner");
    server.offer(7, file.get());
  }  // the server keeps its own duplicate
  ASSERT_LE(server.address().size(), DescriptorServer::kMaxAddressBytes);
  const int status = in_child([&] {
    UniqueFd fetched = fetch_descriptor(server.address(), 7, milliseconds(5000));
    // The child writes back through its copy: the same open file.
    const bool same = contents(fetched.get()) == "written by the owner";
    return same && pwrite(fetched.get(), "CHILD", 5, 0) == 5;
  });
  EXPECT_EQ(status, 0);
  EXPECT_EQ(server.served(), 1u);
  UniqueFd again = fetch_descriptor(server.address(), 7, milliseconds(5000));
  EXPECT_EQ(contents(again.get()), "CHILDen by the owner");
}

TEST(DescriptorSharing, IdsNotOfferedAreNamed) {
  DescriptorServer server;
  UniqueFd file = memfd_with("x");
  server.offer(1, file.get());
  try {
    fetch_descriptor(server.address(), 2, milliseconds(5000));
    FAIL() << "fetched an id never offered";
  } catch (const CommError& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find("fetching descriptor 2 from the server at @" + server.address()),
              std::string::npos) << message;
    EXPECT_NE(message.find("offers no descriptor 2"), std::string::npos) << message;
  }
  server.withdraw(1);
  EXPECT_THROW(fetch_descriptor(server.address(), 1, milliseconds(5000)), CommError);
  server.withdraw(99);  // unknown: ignored
  EXPECT_EQ(server.served(), 0u);
}

TEST(DescriptorSharing, AnOfferReplacesTheEarlierOneUnderItsId) {
  DescriptorServer server;
  UniqueFd first = memfd_with("first");
  UniqueFd second = memfd_with("second");
  server.offer(5, first.get());
  server.offer(5, second.get());
  EXPECT_EQ(contents(fetch_descriptor(server.address(), 5, milliseconds(5000)).get()), "second");
}

TEST(DescriptorSharing, AServerThatIsGoneIsAnErrorAtOnce) {
  std::string address;
  {
    DescriptorServer server;
    address = server.address();
  }
  const auto start = std::chrono::steady_clock::now();
  try {
    fetch_descriptor(address, 1, milliseconds(5000));
    FAIL() << "fetched from a server that was destroyed";
  } catch (const CommError& error) {
    EXPECT_EQ(error.kind(), ErrorKind::kPeerLost);
    EXPECT_NE(std::string(error.what()).find("no server there"), std::string::npos)
        << error.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(1));
}

TEST(DescriptorSharing, BadAddressesAreRefusedBeforeConnecting) {
  EXPECT_THROW(fetch_descriptor("", 1, milliseconds(100)), CommError);
  EXPECT_THROW(fetch_descriptor(std::string(DescriptorServer::kMaxAddressBytes + 1, 'a'), 1,
                                milliseconds(100)),
               CommError);
}

TEST(DescriptorSharing, AClientThatNeverAsksDoesNotStopTheServer) {
  DescriptorServer server;
  UniqueFd file = memfd_with("still served");
  server.offer(3, file.get());
  // Connects and sends nothing: the server drops it after its request
  // timeout and answers the next client.
  UniqueFd silent(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::memcpy(address.sun_path + 1, server.address().data(), server.address().size());
  ASSERT_EQ(connect(silent.get(), reinterpret_cast<sockaddr*>(&address),
                    static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 +
                                           server.address().size())),
            0)
      << std::strerror(errno);
  UniqueFd fetched = fetch_descriptor(server.address(), 3, milliseconds(10000));
  EXPECT_EQ(contents(fetched.get()), "still served");
}

TEST(DescriptorSharing, ManyFetchesLeakNoDescriptors) {
  const size_t before = open_descriptors();
  {
    DescriptorServer server;
    UniqueFd file = memfd_with("y");
    for (uint64_t id = 0; id < 8; ++id) server.offer(id, file.get());
    for (int round = 0; round < 100; ++round) {
      UniqueFd fetched = fetch_descriptor(server.address(), round % 8, milliseconds(5000));
      ASSERT_TRUE(fetched.valid());
      EXPECT_THROW(fetch_descriptor(server.address(), 100 + round, milliseconds(5000)),
                   CommError);
    }
    EXPECT_EQ(server.served(), 100u);
  }
  EXPECT_EQ(open_descriptors(), before);
}

TEST(DescriptorSharing, SeveralServersOfOneProcessHaveTheirOwnAddresses) {
  DescriptorServer one, two;
  EXPECT_NE(one.address(), two.address());
  UniqueFd a = memfd_with("one"), b = memfd_with("two");
  one.offer(1, a.get());
  two.offer(1, b.get());
  EXPECT_EQ(contents(fetch_descriptor(one.address(), 1, milliseconds(5000)).get()), "one");
  EXPECT_EQ(contents(fetch_descriptor(two.address(), 1, milliseconds(5000)).get()), "two");
}

}  // namespace
}  // namespace fsdp_ext::comm
