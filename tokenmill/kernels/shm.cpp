// Shared-memory all-reduce for the tensor-parallel ranks of one host (see shm.h).
#include "shm.h"

#include <fcntl.h>
#include <immintrin.h>
#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstring>

namespace tokenmill {

// Layout: the header, then per rank two slots of slot_bytes. Counters sit on their own cache lines.
struct alignas(64) Counter {
  std::atomic<int64_t> value;
  char pad[64 - sizeof(std::atomic<int64_t>)];
};
struct ShmAllReduce::Header {
  alignas(64) std::atomic<int64_t> aborted;
  Counter published[64];  // per rank: the last step whose data is in its slot
};
static constexpr int64_t kMaxRanks = 64;

int64_t ShmAllReduce::bytes_needed(int64_t size, int64_t slot_bytes) {
  return static_cast<int64_t>(sizeof(Header)) + 2 * size * slot_bytes;
}

ShmAllReduce::ShmAllReduce(const std::string& path, int64_t rank, int64_t size, int64_t slot_bytes, double timeout_s)
    : rank_(rank), size_(size), slot_bytes_(slot_bytes), timeout_s_(timeout_s) {
  TORCH_CHECK(size >= 1 && size <= kMaxRanks && rank >= 0 && rank < size, "bad rank ", rank, " of ", size);
  TORCH_CHECK(slot_bytes >= 64 && slot_bytes % 64 == 0, "slot size must be a positive multiple of 64 bytes");
  const int fd = ::open(path.c_str(), O_RDWR);
  TORCH_CHECK(fd >= 0, "cannot open the tensor-parallel shared memory ", path);
  mapped_ = static_cast<size_t>(bytes_needed(size, slot_bytes));
  void* p = ::mmap(nullptr, mapped_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  TORCH_CHECK(p != MAP_FAILED, "cannot map the tensor-parallel shared memory ", path);
  base_ = static_cast<char*>(p);
  header_ = reinterpret_cast<Header*>(base_);
}

ShmAllReduce::~ShmAllReduce() {
  if (base_) ::munmap(base_, mapped_);
}

void ShmAllReduce::abort() { header_->aborted.store(1, std::memory_order_release); }

void ShmAllReduce::all_reduce_(at::Tensor t) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(),
              "shared-memory all-reduce takes a contiguous float32 CPU tensor");
  float* data = t.data_ptr<float>();
  const int64_t per = slot_bytes_ / static_cast<int64_t>(sizeof(float));
  for (int64_t off = 0, n = t.numel(); off < n; off += per) reduce_chunk(data + off, std::min(per, n - off));
}

void ShmAllReduce::reduce_chunk(float* data, int64_t n) {
  const int64_t step = ++step_;
  auto slot = [&](int64_t r) { return reinterpret_cast<float*>(base_ + sizeof(Header) + (2 * r + step % 2) * slot_bytes_); };
  std::memcpy(slot(rank_), data, n * sizeof(float));
  header_->published[rank_].value.store(step, std::memory_order_release);
  const auto start = std::chrono::steady_clock::now();
  for (int64_t r = 0; r < size_; ++r) {
    for (int64_t spins = 0; header_->published[r].value.load(std::memory_order_acquire) < step; ++spins) {
      if (header_->aborted.load(std::memory_order_relaxed))
        TORCH_CHECK(false, "tensor-parallel all-reduce aborted: a rank has stopped");
      if (spins < 20000) {
        _mm_pause();
        continue;
      }
      sched_yield();  // ranks sharing cores: let the others run
      if ((spins & 1023) == 0 &&
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > timeout_s_)
        TORCH_CHECK(false, "tensor-parallel all-reduce: rank ", r, " did not arrive within ", timeout_s_, " s");
    }
  }
  // every rank sums in rank order: the same bits everywhere
  std::memcpy(data, slot(0), n * sizeof(float));
  for (int64_t r = 1; r < size_; ++r) {
    const float* s = slot(r);
    for (int64_t i = 0; i < n; ++i) data[i] += s[i];
  }
}

}  // namespace tokenmill
// Registered in stack.cpp, before the decode stack whose methods take it.
